// Pausing a worker (issue 19): its owner or the operator pauses it through the hub, or the worker
// pauses itself (a phone on low battery or too hot). While paused, placements leave it out
// (backbones route it nothing new; what is in flight finishes) but it keeps its slices, leases
// and coverage: a pause is not a departure, and after a resume it serves again at once.
// A pause outlives a hub restart, but not its worker: a worker the hub stops seeing (it left, or
// the hub forgot it) keeps its pause for the operator's retention (`pauseRetentionMs`, counted from
// the later of the pause and its last sighting), then the pause is dropped; a quarantine (the only
// way the hub revokes a worker's identity: its tokens live a year) drops it at once.
import {
  HubError,
  type WorkerPauseBy,
  type WorkerPauseJson,
  type WorkerPauseRecordJson,
  workerPauseNotice,
} from "@moeswarm/core";
import type { RelayServerEvent } from "./relay.js";
import type { PauseStore, StoredPause } from "./store-pauses.js";
import { principalOf, type TokenClaims } from "./token.js";

/** The two pauses a worker may be under: the hub's (owner or operator) and its own. */
interface PauseSlots {
  hub?: WorkerPauseRecordJson & { by: "owner" | "operator" };
  self?: WorkerPauseRecordJson;
  /** When the hub last saw the worker, kept once the hub forgot it (store-pauses.ts `seen`). */
  seen?: number;
}

/** Why a pause was dropped without a resume. */
export type PauseDropReason = "retention" | "revoked";

export interface WorkerPausesOptions {
  /**
   * Where the hub's pauses (owner or operator) are kept across restarts (store-pauses.ts); each is
   * written before it is answered. Workers' own pauses are not kept: a worker tells its own again.
   */
  store: PauseStore;
  /** Placements leave the worker out (true) or list it again (false). */
  setPaused(id: string, paused: boolean): void;
  /** Tells a live worker (a relay notice); false when it is not connected. */
  notice(id: string, code: "MOESWARM_HUB_PAUSED" | "MOESWARM_HUB_RESUMED", msg: string): boolean;
  clock: () => number;
  /** A paused worker not seen for this long loses its pauses (ms, from the pause when later). */
  retentionMs: number;
  /** Whether the hub's worker book knows the worker: connected, and last seen (unix ms). */
  seen: (id: string) => { live: boolean; lastSeen: number } | undefined;
  /** Reports a change (the hub's onEvent); `dropped` when no one lifted it. */
  emit?: (event: {
    worker: string;
    paused: boolean;
    by: WorkerPauseBy;
    reason?: string;
    dropped?: PauseDropReason;
  }) => void;
  /** Counts a dropped pause (the hub's metrics). */
  dropped?: (reason: PauseDropReason) => void;
}

/**
 * The pauses in force, by worker id, kept apart from connections. The hub's pause (its owner's or
 * the operator's) is in the store too, so a restart on the same store keeps it; a worker's own
 * pause lives in memory only: a restart forgets it, and a self-paused worker says so again at its
 * next poll (and lifts it when it starts unpaused).
 */
export class WorkerPauses {
  readonly #slots = new Map<string, PauseSlots>();
  readonly #o: WorkerPausesOptions;
  /** Workers connected and not yet registered on that connection. */
  readonly #untold = new Set<string>();
  #queue: Promise<unknown> = Promise.resolve();
  /** Workers forgotten before load() (the book loads first): their last sighting, for the store. */
  #forgottenEarly: Map<string, number> | undefined = new Map();

  constructor(options: WorkerPausesOptions) {
    this.#o = options;
  }

  /** Takes the hub's pauses kept in the store (at start, before any connection). */
  async load(): Promise<void> {
    const early = this.#forgottenEarly ?? new Map<string, number>();
    this.#forgottenEarly = undefined;
    for (const p of await this.#o.store.list()) {
      const slots = this.#slots.get(p.worker) ?? {};
      slots.hub = { at: p.at, ...(p.reason !== undefined ? { reason: p.reason } : {}), by: p.by };
      const seen = early.get(p.worker);
      if (seen !== undefined && seen > (p.seen ?? 0)) await this.#o.store.setSeen(p.worker, seen);
      const kept = Math.max(seen ?? 0, p.seen ?? 0);
      if (kept > 0) slots.seen = kept;
      this.#set(p.worker, slots);
    }
  }

  /** Workers the hub forgot (worker-book.ts): a paused one's last sighting is kept with its pause. */
  forgotten(workers: ReadonlyArray<{ id: string; lastSeen: number }>): Promise<void> {
    if (this.#forgottenEarly) {
      for (const w of workers) this.#forgottenEarly.set(w.id, w.lastSeen);
      return Promise.resolve();
    }
    return this.#serial(async () => {
      for (const w of workers) {
        const slots = this.#slots.get(w.id);
        if (!slots) continue;
        if (slots.hub) await this.#o.store.setSeen(w.id, w.lastSeen);
        slots.seen = w.lastSeen;
      }
    });
  }

  /**
   * When the worker's pauses lapse: undefined while it is connected (or not paused); otherwise
   * its last sighting (the book's, else the one kept with the pause) and, per pause, when the
   * retention ends, counted from the later of the pause and that sighting.
   */
  #away(id: string, s: PauseSlots | undefined) {
    if (!s) return undefined;
    const book = this.#o.seen(id);
    if (book?.live) return undefined;
    const lastSeen = book?.lastSeen ?? s.seen;
    const ends = (at: number | undefined) =>
      at === undefined ? undefined : Math.max(at, lastSeen ?? 0) + this.#o.retentionMs;
    return { lastSeen, listed: book !== undefined, hub: ends(s.hub?.at), self: ends(s.self?.at) };
  }

  /** Drops the pauses whose retention ended (the hub runs it at each persist tick). */
  sweep(): Promise<number> {
    return this.#serial(async () => {
      const now = this.#o.clock();
      let n = 0;
      for (const [id, s] of [...this.#slots]) {
        const away = this.#away(id, s);
        if (away?.hub !== undefined && now >= away.hub) n += await this.#drop(id, "hub", "retention");
        if (away?.self !== undefined && now >= away.self) n += await this.#drop(id, "self", "retention");
      }
      return n;
    });
  }

  /** The worker's identity was revoked (quarantined): its pauses go, as nothing can lift them. */
  revoke(id: string): Promise<number> {
    return this.#serial(
      async () => (await this.#drop(id, "hub", "revoked")) + (await this.#drop(id, "self", "revoked")),
    );
  }

  async #drop(id: string, side: "hub" | "self", why: PauseDropReason): Promise<number> {
    const slots = this.#slots.get(id);
    const had = slots?.[side];
    if (!slots || !had) return 0;
    if (side === "hub") await this.#o.store.delete(id);
    delete slots[side];
    this.#set(id, slots);
    const by: WorkerPauseBy = side === "hub" ? (had as { by: "owner" | "operator" }).by : "self";
    this.#o.dropped?.(why);
    this.#o.emit?.({ worker: id, paused: this.isPaused(id), by, dropped: why });
    return 1;
  }

  /** Every worker under a pause, ordered by id. */
  list(): WorkerPauseJson[] {
    return [...this.#slots.keys()].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0)).map((id) => this.state(id));
  }

  state(id: string): WorkerPauseJson {
    const s = this.#slots.get(id);
    const out: WorkerPauseJson = { worker: id, paused: s !== undefined };
    if (s?.hub) out.hub = { ...s.hub };
    if (s?.self) out.self = { ...s.self };
    const away = this.#away(id, s);
    if (away) {
      out.away = {
        ...(away.lastSeen !== undefined ? { lastSeen: away.lastSeen } : {}),
        listed: away.listed,
        // the worker is unpaused once the last of its pauses lapses
        dropsAt: Math.max(away.hub ?? 0, away.self ?? 0),
      };
    }
    return out;
  }

  isPaused(id: string): boolean {
    return this.#slots.has(id);
  }

  /**
   * Pauses `id` as `by` (again with another reason or pauser: updated; the same again: nothing).
   * The hub's pause is stored first: a store that fails (HubError MOESWARM_HUB_STORE) changes nothing.
   */
  pause(id: string, by: WorkerPauseBy, reason?: string): Promise<WorkerPauseJson> {
    return this.#serial(() => this.#pause(id, by, reason));
  }

  /** Lifts the pause of `by`'s side: "self" the worker's own, "owner"/"operator" the hub's. */
  resume(id: string, by: WorkerPauseBy): Promise<WorkerPauseJson> {
    return this.#serial(() => this.#resume(id, by));
  }

  /**
   * One change at a time, in the order asked: a pause and a resume whose store writes interleave
   * could otherwise leave memory and the store disagreeing until the next restart.
   */
  #serial<T>(fn: () => Promise<T>): Promise<T> {
    const next = this.#queue.then(fn);
    this.#queue = next.catch(() => {});
    return next;
  }

  async #pause(id: string, by: WorkerPauseBy, reason?: string): Promise<WorkerPauseJson> {
    const had = by === "self" ? this.#slots.get(id)?.self : this.#slots.get(id)?.hub;
    // the same pause again (a worker repeats its own while it lasts): nothing changes
    if (had && had.reason === reason && (by === "self" || this.#slots.get(id)?.hub?.by === by)) {
      return this.state(id);
    }
    const record = { at: this.#o.clock(), ...(reason !== undefined ? { reason } : {}) };
    if (by !== "self") await this.#o.store.put({ worker: id, by, ...record } satisfies StoredPause);
    const slots = this.#slots.get(id) ?? {};
    if (by === "self") slots.self = record;
    else slots.hub = { ...record, by };
    this.#set(id, slots);
    // the worker knows its own pause; the hub's (new, or a new pauser or reason) it is told
    if (by !== "self") this.#o.notice(id, "MOESWARM_HUB_PAUSED", workerPauseNotice(true, by, reason));
    this.#o.emit?.({ worker: id, paused: true, by, ...(reason !== undefined ? { reason } : {}) });
    return this.state(id);
  }

  async #resume(id: string, by: WorkerPauseBy): Promise<WorkerPauseJson> {
    const before = this.#slots.get(id);
    if ((by === "self" ? before?.self : before?.hub) === undefined) return this.state(id);
    if (by !== "self") await this.#o.store.delete(id);
    const slots = this.#slots.get(id) ?? {};
    const hadHub = slots.hub !== undefined;
    if (by === "self") delete slots.self;
    else delete slots.hub;
    this.#set(id, slots);
    if (by !== "self" && hadHub) this.#o.notice(id, "MOESWARM_HUB_RESUMED", workerPauseNotice(false, by));
    this.#o.emit?.({ worker: id, paused: this.isPaused(id), by });
    return this.state(id);
  }

  close(): Promise<void> {
    return this.#o.store.close();
  }

  /** The pauses of workers the hub no longer lists (the dashboard shows them apart). */
  unlisted(): WorkerPauseJson[] {
    return this.list().filter((p) => p.away?.listed === false);
  }

  #set(id: string, slots: PauseSlots): void {
    const paused = slots.hub !== undefined || slots.self !== undefined;
    if (paused) this.#slots.set(id, slots);
    else this.#slots.delete(id);
    this.#o.setPaused(id, paused);
  }

  /**
   * A worker that connects while the hub pauses it is told at its first register on that
   * connection (right after the hello its client may not be listening yet).
   */
  onRelayEvent(event: RelayServerEvent): void {
    if (event.type === "connect" && event.role === "worker") {
      this.#untold.add(event.id);
      return;
    }
    if (event.type === "disconnect" && event.id !== undefined) this.#untold.delete(event.id);
    if (event.type !== "register" || !this.#untold.delete(event.id)) return;
    const hub = this.#slots.get(event.id)?.hub;
    if (hub) this.#o.notice(event.id, "MOESWARM_HUB_PAUSED", workerPauseNotice(true, hub.by, hub.reason));
  }
}

/**
 * Who is asking to pause or resume worker `id`, or why not: the operator (an admin token); the
 * worker itself (a token bound to `id`, or an unbound one where the hub allows them: it could say
 * hello as any id), as "self" when the body says `"self": true` and as its owner otherwise; or
 * another worker token of the same principal ("owner"). Anyone else: MOESWARM_HUB_NOT_OWNER.
 */
export function pauserOf(
  claims: TokenClaims,
  id: string,
  owner: string | undefined,
  self: boolean,
): WorkerPauseBy {
  if (claims.role === "admin") return "operator";
  const itself = claims.id === undefined || claims.id === id;
  if (itself) return self ? "self" : "owner";
  const mine = principalOf(claims, claims.id as string);
  if (owner !== undefined && mine === owner && !self) return "owner";
  throw new HubError(
    "MOESWARM_HUB_NOT_OWNER",
    self
      ? `only worker ${JSON.stringify(id)} itself may pause itself ("self": true)`
      : `worker ${JSON.stringify(id)} is not ${JSON.stringify(mine)}'s: only its owner or the hub's operator may pause or resume it`,
    { details: { worker: id, principal: mine } },
  );
}

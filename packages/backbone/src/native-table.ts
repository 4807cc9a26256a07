import { InvalidArgumentError } from "@moeswarm/core";
import type { Placement } from "@moeswarm/dispatch";
import type { NativeTableEntry, NativeTableFrame } from "./native-plane.js";

// The native plane's table: which remote layers the plugin may send straight to a worker
// (docs/architecture.md section 4). A layer ONE worker holds whole is one entry: its split is one
// dispatch in mode "sum" to that worker, exactly what the bridge would send it. A layer split over
// several workers (phase 2), each holding one contiguous range of its experts and nobody else any of
// them, is one entry per worker with its `experts` range: the plugin sends each a mode "each"
// dispatch and combines. Replicas (hedging, verification: phase 3) and gaps stay on the bridge path. The bridge decides whether the plane is on at all (trust
// "own", no spot checks); this module builds the entries, keeps their tickets fresh, and drops a
// worker the plugin reports failing for a backoff.

/** A worker's native listener as the hub's placement publishes it. */
export interface NativeRoute {
  /** `host:port` (IPv6 as `[::1]:port`), in the worker's order of preference. */
  readonly addrs: readonly string[];
  /** SHA-256 fingerprint of its certificate (AA:BB:...), pinned by the plugin. */
  readonly fingerprint: string;
}

/** What the table is built from: one version of the live placement. */
export interface NativePlacementView {
  readonly placement: Placement;
  /** The model's MoE layers. */
  readonly layers: readonly number[];
  /** Routed experts per layer. */
  readonly nExpert: number;
  /** Workers that advertise a native listener. */
  readonly native: ReadonlyMap<string, NativeRoute>;
}

/** A layer that can go native, before its ticket. */
export interface NativeCandidate {
  layer: number;
  worker: string;
  addr: string;
  fp: string;
  /** Set for an owner of a split layer: the range [lo, hi) of its experts. */
  experts?: [number, number];
}

/**
 * Per layer, its one owner when a single worker holds every expert of it (and nobody else holds
 * any), that worker is not excluded (quarantined, its circuit open) and it advertises a native
 * listener. A layer with a gap, a replica or a second owner of any expert is left out: the bridge
 * would split, hedge or verify it, which the plugin does not.
 */
export function wholeLayerOwners(view: NativePlacementView, exclude: ReadonlySet<string>): NativeCandidate[] {
  const out: NativeCandidate[] = [];
  for (const layer of view.layers) {
    let owner: string | undefined;
    let single = view.nExpert > 0;
    for (let e = 0; e < view.nExpert && single; e++) {
      const owners = view.placement.owners(layer, e);
      if (owners.length !== 1 || (owner !== undefined && owners[0] !== owner)) single = false;
      else owner = owners[0];
    }
    if (!single || owner === undefined || exclude.has(owner)) continue;
    const route = view.native.get(owner);
    const addr = route?.addrs[0];
    if (!route || addr === undefined) continue;
    out.push({ layer, worker: owner, addr, fp: route.fingerprint });
  }
  return out;
}

/**
 * Per layer, its owners when every expert of it is held by exactly one worker (no replica, no gap),
 * each owner holds one contiguous range of its experts, and every owner advertises a native listener
 * and is not excluded: one candidate per owner, `experts` set when there are several. A layer that
 * breaks any of that is left out (the bridge path). Layers in `view.layers` order.
 */
export function nativeLayerOwners(
  view: NativePlacementView,
  exclude: ReadonlySet<string>,
): NativeCandidate[][] {
  const out: NativeCandidate[][] = [];
  for (const layer of view.layers) {
    const ranges = ownerRanges(view, layer);
    if (!ranges) continue;
    const group: NativeCandidate[] = [];
    for (const [worker, lo, hi] of ranges) {
      const route = view.native.get(worker);
      const addr = route?.addrs[0];
      if (exclude.has(worker) || !route || addr === undefined) break;
      group.push({
        layer,
        worker,
        addr,
        fp: route.fingerprint,
        ...(ranges.length > 1 ? { experts: [lo, hi] as [number, number] } : {}),
      });
    }
    if (group.length === ranges.length) out.push(group);
  }
  return out;
}

/** A layer's owners as [worker, lo, hi) runs, or undefined (a gap, a replica, an owner of two runs). */
function ownerRanges(view: NativePlacementView, layer: number): Array<[string, number, number]> | undefined {
  const runs: Array<[string, number, number]> = [];
  for (let e = 0; e < view.nExpert; e++) {
    const owners = view.placement.owners(layer, e);
    if (owners.length !== 1) return undefined;
    const last = runs[runs.length - 1];
    if (last && last[0] === owners[0]) last[2] = e + 1;
    else runs.push([owners[0]!, e, e + 1]);
  }
  const workers = new Set(runs.map((r) => r[0]));
  return runs.length > 0 && workers.size === runs.length ? runs : undefined;
}

/** A ticket as the hub mints it (`POST /api/direct/tickets`). */
export interface NativeTicket {
  ticket: string;
  /** Expiry, unix ms. */
  exp: number;
}

/** 1 s doubling to 60 s, as the plugin and DirectTransport back off. */
export interface NativeBackoffOptions {
  initialMs?: number;
  maxMs?: number;
}

/** Per worker: how long it is out, and for how long the next time. */
export class WorkerBackoff {
  readonly #state = new Map<string, { delayMs: number; until: number }>();
  readonly #initial: number;
  readonly #max: number;

  constructor(options: NativeBackoffOptions = {}) {
    this.#initial = options.initialMs ?? 1000;
    this.#max = Math.max(this.#initial, options.maxMs ?? 60_000);
  }

  active(worker: string, now: number): boolean {
    const s = this.#state.get(worker);
    return s !== undefined && now < s.until;
  }

  /** When the backoff of `worker` ends (undefined: not backing off). */
  until(worker: string, now: number): number | undefined {
    const s = this.#state.get(worker);
    return s !== undefined && now < s.until ? s.until : undefined;
  }

  /**
   * A failure: starts the next backoff (the first 1 s, then doubling), unless one is running:
   * failures of splits already under way when the worker was dropped do not lengthen it.
   * Returns the delay started, or undefined.
   */
  fail(worker: string, now: number): number | undefined {
    const s = this.#state.get(worker);
    if (s && now < s.until) return undefined;
    const delayMs = s ? Math.min(this.#max, s.delayMs * 2) : this.#initial;
    this.#state.set(worker, { delayMs, until: now + delayMs });
    return delayMs;
  }

  /** A success after the backoff ended: the next failure starts at 1 s again. */
  succeeded(worker: string, now: number): void {
    if (!this.active(worker, now)) this.#state.delete(worker);
  }

  /** Forgets `worker`'s failures. */
  clear(worker: string): void {
    this.#state.delete(worker);
  }

  /** Workers backing off now. */
  list(now: number): string[] {
    return [...this.#state].filter(([, s]) => now < s.until).map(([w]) => w);
  }
}

export interface NativeTableOptions {
  /** The backbone's relay id (what its tickets name). */
  backbone: string;
  /** The plugin's deadline for a native split, ms. */
  deadlineMs: number;
  /** The live placement now (undefined: none yet, the table is empty). */
  view(): NativePlacementView | undefined;
  /** Workers the bridge would not send to now (quarantined, circuit open). */
  exclude(): ReadonlySet<string>;
  /** A ticket for `worker` from the hub. */
  ticket(worker: string, signal: AbortSignal): Promise<NativeTicket>;
  /** Called with each new table (a different content than the last). */
  onTable(table: NativeTableFrame): void;
  /** Ends ticket requests and timers. */
  signal: AbortSignal;
  /** Of a worker dropped after failures, and of ticket requests that failed. */
  backoff?: NativeBackoffOptions;
  /** A ticket request failed (it is retried with the backoff). */
  onTicketError?(worker: string, error: unknown): void;
}

/** A table entry is withdrawn this long before its ticket expires (a connect must still fit). */
const EXPIRY_MARGIN_MS = 5000;
/** A ticket is renewed once this share of its life has passed. */
const RENEW_AT = 0.8;

interface HeldTicket extends NativeTicket {
  renewAt: number;
}

export interface NativeTableCounters {
  /** Tables built (each with a new seq). */
  tables: number;
  ticketsFetched: number;
  ticketErrors: number;
  /** Times a worker was dropped after failures. */
  drops: number;
}

/** The table the bridge pushes: rebuilt on `refresh()`, at ticket renewals and backoff ends. */
export class NativeTable {
  readonly counters: NativeTableCounters = { tables: 0, ticketsFetched: 0, ticketErrors: 0, drops: 0 };
  readonly #o: NativeTableOptions;
  readonly #tickets = new Map<string, HeldTicket>();
  readonly #fetching = new Set<string>();
  readonly #ticketRetry: WorkerBackoff;
  readonly #dropped: WorkerBackoff;
  #table: NativeTableFrame;
  #key = "[]";
  #timer: NodeJS.Timeout | undefined;
  #timerAt = Number.POSITIVE_INFINITY;

  constructor(options: NativeTableOptions) {
    const d = options.deadlineMs;
    if (!Number.isSafeInteger(d) || d < 1 || d > 0xffff_ffff) {
      throw new InvalidArgumentError("native deadlineMs must be an integer in 1..2^32-1");
    }
    this.#o = options;
    this.#ticketRetry = new WorkerBackoff(options.backoff);
    this.#dropped = new WorkerBackoff(options.backoff);
    this.#table = { v: 1, t: "native-table", seq: 0, backbone: options.backbone, deadlineMs: d, layers: [] };
    options.signal.addEventListener("abort", () => this.#clearTimer(), { once: true });
  }

  /** The table now (seq 0 and empty before the first build). */
  current(): NativeTableFrame {
    return this.#table;
  }

  /** Workers dropped after failures, backing off now. */
  dropped(): string[] {
    return this.#dropped.list(Date.now());
  }

  /** The plugin reported failures for `worker`: out of the table for the next backoff. */
  failed(worker: string): void {
    if (this.#dropped.fail(worker, Date.now()) === undefined) return;
    this.counters.drops++;
    this.refresh();
  }

  /** The plugin reported native splits answered by `worker`: its next failure backs off 1 s again. */
  succeeded(worker: string): void {
    this.#dropped.succeeded(worker, Date.now());
  }

  /** Rebuilds the table from the placement now; pushes it when it changed; asks for tickets it lacks. */
  refresh(): void {
    if (this.#o.signal.aborted) return;
    const now = Date.now();
    const view = this.#o.view();
    const groups = view ? nativeLayerOwners(view, this.#o.exclude()) : [];
    const entries: NativeTableEntry[] = [];
    const known = new Set<string>();
    let wake = Number.POSITIVE_INFINITY;
    const later = (at: number | undefined) => {
      if (at !== undefined && at > now) wake = Math.min(wake, at);
    };
    for (const group of groups) {
      // a split layer goes on only with every owner on: one missing owner sends its ids to the bridge
      const layer: NativeTableEntry[] = [];
      for (const c of group) {
        known.add(c.worker);
        const droppedUntil = this.#dropped.until(c.worker, now);
        if (droppedUntil !== undefined) {
          later(droppedUntil);
          continue;
        }
        const held = this.#tickets.get(c.worker);
        if (!held || now >= held.renewAt) this.#fetch(c.worker, now);
        later(this.#ticketRetry.until(c.worker, now));
        if (!held || now >= held.exp - EXPIRY_MARGIN_MS) continue;
        later(held.renewAt);
        later(held.exp - EXPIRY_MARGIN_MS);
        layer.push({ ...c, ticket: held.ticket, exp: held.exp });
      }
      if (layer.length === group.length) entries.push(...layer);
    }
    // a worker gone from the placement: its ticket is of no use (a new one when it comes back)
    for (const w of this.#tickets.keys()) if (!known.has(w)) this.#tickets.delete(w);
    this.#schedule(wake);
    this.#publish(entries);
  }

  #publish(entries: NativeTableEntry[]): void {
    entries.sort((a, b) => a.layer - b.layer || (a.experts?.[0] ?? 0) - (b.experts?.[0] ?? 0));
    const key = JSON.stringify(entries);
    if (key === this.#key) return;
    this.#key = key;
    this.counters.tables++;
    this.#table = { ...this.#table, seq: this.#table.seq + 1, layers: entries };
    this.#o.onTable(this.#table);
  }

  #fetch(worker: string, now: number): void {
    if (this.#fetching.has(worker) || this.#ticketRetry.active(worker, now)) return;
    this.#fetching.add(worker);
    const { signal } = this.#o;
    // a ticket function that throws at once is a failed request like any other
    void Promise.resolve()
      .then(() => this.#o.ticket(worker, signal))
      .then((t) => {
        const at = Date.now();
        if (typeof t?.ticket !== "string" || !t.ticket.startsWith("mswt1.") || !Number.isSafeInteger(t.exp)) {
          throw new InvalidArgumentError("the hub answered no usable ticket ({ticket: mswt1..., exp})");
        }
        if (t.exp <= at + EXPIRY_MARGIN_MS) {
          throw new InvalidArgumentError(`the hub's ticket for ${worker} expires at once (exp ${t.exp})`);
        }
        this.counters.ticketsFetched++;
        this.#ticketRetry.clear(worker);
        this.#tickets.set(worker, { ticket: t.ticket, exp: t.exp, renewAt: at + (t.exp - at) * RENEW_AT });
      })
      .catch((error: unknown) => {
        if (signal.aborted) return;
        this.counters.ticketErrors++;
        this.#ticketRetry.fail(worker, Date.now());
        this.#o.onTicketError?.(worker, error);
      })
      .finally(() => {
        this.#fetching.delete(worker);
        this.refresh();
      });
  }

  /** One timer, at the earliest moment the table may change by itself. */
  #schedule(at: number): void {
    if (at === this.#timerAt) return;
    this.#clearTimer();
    if (!Number.isFinite(at)) return;
    this.#timerAt = at;
    this.#timer = setTimeout(
      () => {
        this.#timer = undefined;
        this.#timerAt = Number.POSITIVE_INFINITY;
        this.refresh();
      },
      Math.max(0, at - Date.now()),
    );
    this.#timer.unref?.();
  }

  #clearTimer(): void {
    if (this.#timer) clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#timerAt = Number.POSITIVE_INFINITY;
  }
}

import type { WorkerPauseJson } from "@moeswarm/core";
import type { Relay, RelayServerEvent } from "./relay.js";
import type { HubStore, StoredSlice, StoredWorker } from "./store.js";

interface MutableWorker {
  id: string;
  firstSeen: number;
  lastSeen: number;
  connected: boolean;
  draining: boolean;
  /** By `sliceKey` (model, layers, experts), in the order registered. */
  slices: Map<string, StoredSlice>;
  dirty: boolean;
}

/** A slice's identity: model, layers and experts (what makes two register frames the same). */
function sliceKey(s: { model: string; layers: readonly number[]; experts: readonly number[] }): string {
  return `${s.model}\0${s.layers.join(",")}\0${s.experts.join(",")}`;
}

/** A worker as `GET /api/workers` lists it: what the hub remembers, with live figures when connected. */
export interface HubWorkerInfo {
  id: string;
  live: boolean;
  draining: boolean;
  firstSeen: number;
  lastSeen: number;
  /** Dispatches routed to it and not yet answered (live workers). */
  inFlight?: number;
  /** Round trip of the relay's last heartbeat, ms (live workers). */
  rttMs?: number;
  /** Relay-side round trip of its dispatches (moving average, ms), once it answered one. */
  latencyMs?: number;
  /** The round trip backbones report for it in their receipts (moving average, ms). */
  reportedLatencyMs?: number;
  /** Expert-tokens it served (from the backbones' receipts), in all and per model. */
  credits?: { expertTokens: number; byModel: Record<string, number> };
  /** Set while the worker is quarantined (POST /api/models/:model/reports/quarantine). */
  quarantined?: { at: number; by: string; model: string; reason: string };
  /** Set while the worker is paused: by its owner or the operator (`hub`), or by itself (`self`). */
  paused?: Pick<WorkerPauseJson, "hub" | "self">;
  slices: StoredSlice[];
}

export interface WorkerBookOptions {
  store: HubStore;
  relay: () => Relay;
  /** Workers not seen for this long are forgotten (ms). */
  forgetAfterMs: number;
  onStoreError: (error: unknown) => void;
  /** Told of the workers forgotten, with when each was last seen (the pauses keep that: issue 19). */
  onForget?: (forgotten: Array<{ id: string; lastSeen: number }>) => Promise<void>;
}

function freeze(w: MutableWorker, connected = w.connected): StoredWorker {
  return {
    id: w.id,
    firstSeen: w.firstSeen,
    lastSeen: w.lastSeen,
    connected,
    draining: w.draining,
    slices: [...w.slices.values()],
  };
}

/**
 * What the hub knows of its workers: loaded from the store at start (all offline then), kept up
 * to date from the relay's events, written back in batches (soon after each change, and the
 * last-seen times periodically) through one queue, so writes land in order.
 */
export class WorkerBook {
  readonly #workers = new Map<string, MutableWorker>();
  readonly #o: WorkerBookOptions;
  #queue: Promise<void> = Promise.resolve();
  #soon: ReturnType<typeof setTimeout> | undefined;
  #lastForget = 0;

  constructor(options: WorkerBookOptions) {
    this.#o = options;
  }

  get size(): number {
    return this.#workers.size;
  }

  has(id: string): boolean {
    return this.#workers.has(id);
  }

  async load(now = Date.now()): Promise<void> {
    for (const w of await this.#o.store.listWorkers()) {
      this.#workers.set(w.id, {
        ...w,
        connected: false,
        slices: new Map(w.slices.map((s) => [sliceKey(s), s])),
        dirty: w.connected,
      });
    }
    // after loading, so that those forgotten now are told with their last-seen time
    await this.#forget(now);
  }

  /** Whether the worker is connected and when it was last seen; undefined when not known. */
  seen(id: string): { live: boolean; lastSeen: number } | undefined {
    const w = this.#workers.get(id);
    // the relay's connect and disconnect set both (a live worker's time lags: it is not dropped)
    return w && { live: w.connected, lastSeen: w.lastSeen };
  }

  #get(id: string, now: number): MutableWorker {
    let w = this.#workers.get(id);
    if (!w) {
      w = {
        id,
        firstSeen: now,
        lastSeen: now,
        connected: false,
        draining: false,
        slices: new Map(),
        dirty: true,
      };
      this.#workers.set(id, w);
    }
    return w;
  }

  /** Takes a relay event (the relay's hook must not throw: callers guard it). */
  onRelayEvent(event: RelayServerEvent): void {
    const now = Date.now();
    switch (event.type) {
      case "connect": {
        if (event.role !== "worker") return;
        const w = this.#get(event.id, now);
        // a new connection starts with no slice: the worker registers (or replays) what it serves
        w.connected = true;
        w.draining = false;
        w.slices.clear();
        w.lastSeen = now;
        w.dirty = true;
        break;
      }
      case "disconnect": {
        if (event.role !== "worker" || event.id === undefined) return;
        const w = this.#workers.get(event.id);
        if (!w) return;
        w.connected = false;
        w.lastSeen = now;
        w.dirty = true;
        break;
      }
      case "register": {
        const w = this.#get(event.id, now);
        const { capacity, backend } = event;
        const slice: StoredSlice = {
          model: event.model,
          layers: [...event.layers],
          experts: [...event.experts],
          registeredAt: now,
          // a capacity beyond 2^53 is not an amount anyone offers; it is not kept
          ...(capacity !== undefined && Number.isSafeInteger(capacity) && capacity >= 0 ? { capacity } : {}),
          ...(backend === undefined ? {} : { backend }),
        };
        // each register adds a slice; the same one again replaces itself (keeping its place)
        w.slices.set(sliceKey(slice), slice);
        w.draining = false;
        w.lastSeen = now;
        w.dirty = true;
        break;
      }
      case "unregister": {
        const w = this.#workers.get(event.id);
        if (!w) return;
        w.slices.delete(sliceKey(event));
        w.dirty = true;
        break;
      }
      case "drain": {
        const w = this.#workers.get(event.id);
        if (!w) return;
        // as on the relay: a draining worker serves nothing
        w.draining = true;
        w.slices.clear();
        w.dirty = true;
        break;
      }
      default:
        return;
    }
    this.#scheduleSoon();
  }

  #scheduleSoon(): void {
    if (this.#soon) return;
    this.#soon = setTimeout(() => {
      this.#soon = undefined;
      void this.flush();
    }, 50);
    this.#soon.unref?.();
  }

  /** Copies the relay's last-seen times in and writes what changed. */
  flush(options: { final?: boolean } = {}): Promise<void> {
    if (this.#soon) {
      clearTimeout(this.#soon);
      this.#soon = undefined;
    }
    const now = Date.now();
    if (!options.final) {
      for (const live of this.#o.relay().workers()) {
        const w = this.#workers.get(live.id);
        if (w && live.lastSeen > w.lastSeen) {
          w.lastSeen = live.lastSeen;
          w.dirty = true;
        }
      }
    }
    const batch: StoredWorker[] = [];
    for (const w of this.#workers.values()) {
      if (options.final && w.connected) {
        // the relay is gone: every worker is offline from the next start's point of view
        w.connected = false;
        w.lastSeen = Math.max(w.lastSeen, now);
        w.dirty = true;
      }
      if (!w.dirty) continue;
      w.dirty = false;
      batch.push(freeze(w));
    }
    this.#queue = this.#queue.then(async () => {
      try {
        if (batch.length > 0) await this.#o.store.putWorkers(batch);
        if (now - this.#lastForget > 3_600_000) await this.#forget(now);
      } catch (error) {
        for (const w of batch) {
          const mine = this.#workers.get(w.id);
          if (mine) mine.dirty = true; // retried at the next flush
        }
        this.#o.onStoreError(error);
      }
    });
    return this.#queue;
  }

  async #forget(now: number): Promise<void> {
    this.#lastForget = now;
    const before = now - this.#o.forgetAfterMs;
    await this.#o.store.deleteWorkersSeenBefore(before);
    const forgotten: Array<{ id: string; lastSeen: number }> = [];
    for (const [id, w] of this.#workers) {
      if (!w.connected && w.lastSeen < before) {
        this.#workers.delete(id);
        forgotten.push({ id, lastSeen: w.lastSeen });
      }
    }
    if (forgotten.length > 0) await this.#o.onForget?.(forgotten);
  }

  list(): HubWorkerInfo[] {
    const live = new Map(
      this.#o
        .relay()
        .workers()
        .map((w) => [w.id, w]),
    );
    return [...this.#workers.values()]
      .sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0))
      .map((w) => {
        const l = live.get(w.id);
        const info: HubWorkerInfo = {
          id: w.id,
          live: l !== undefined,
          draining: l?.draining ?? w.draining,
          firstSeen: w.firstSeen,
          lastSeen: Math.max(w.lastSeen, l?.lastSeen ?? 0),
          slices: [...w.slices.values()].map((s) => ({
            ...s,
            layers: [...s.layers],
            experts: [...s.experts],
          })),
        };
        if (l) {
          info.inFlight = l.inFlight;
          if (l.rttMs !== undefined) info.rttMs = l.rttMs;
        }
        return info;
      });
  }
}

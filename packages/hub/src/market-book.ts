import {
  type DirectEndpointJson,
  type DirectServedJson,
  HubError,
  isMoeswarmError,
  onAbort,
} from "@moeswarm/core";
import { DirectCredit, type DirectServedOutcome } from "./direct-credit.js";
import { asReported, ForwardLedger } from "./forward-ledger.js";
import { CoverageMarket, type Lease, type MarketModel, type MarketOptions } from "./market.js";
import type { RelayServerEvent } from "./relay.js";
import type { StatsReport } from "./stats.js";
import type { HubStore } from "./store.js";
import type { DirectPairRow, DirectStore, DirectWrite } from "./store-direct.js";

/** Figures of one backbone's last report of a model. */
export interface BackboneRate {
  id: string;
  model: string;
  tokensPerSecond: number;
  /** Unix ms the report arrived. */
  at: number;
}

export interface StatsOutcome {
  /** false for a retry (seq not above the last one seen): nothing was counted again. */
  accepted: boolean;
  layers: number;
  credited: string[];
  /** Receipts for workers this hub has never seen (not credited). */
  ignored: string[];
  /**
   * What the report asked for beyond what this hub's relay forwarded from the backbone (not
   * counted): expert-tokens of receipts, routing counts, tokens.
   */
  cut: { expertTokens: number; counts: number; tokens: number };
  /** Expert-tokens credited by this report, all workers. */
  creditedExpertTokens: number;
}

export interface MarketBookOptions {
  store: HubStore;
  market: MarketOptions;
  clock: () => number;
  /** Whether the hub knows this worker (receipts for others are ignored). */
  knownWorker: (id: string) => boolean;
  /** A report older than this no longer counts towards tokens/s (ms). */
  statsStaleMs: number;
  /** Take reports as they come, not bounded by what the relay forwarded (a trusted swarm). */
  trustReports?: boolean;
  /** Whether the hub minted `backbone` a direct-link ticket to `worker` (credits for direct traffic). */
  ticketed?: (backbone: string, worker: string) => boolean;
  /**
   * Where direct credits' unmatched halves, the workers' report seqs and the ticketed pairs are
   * kept across restarts (store-direct.ts; `pairs` is the hub's DirectKeys). Without it they live
   * in memory only.
   */
  direct?: {
    store: DirectStore;
    pairs: {
      load(pairs: readonly DirectPairRow[]): void;
      takeChanges(): Pick<DirectWrite, "pairs" | "forgetPairs"> | undefined;
      restoreChanges(change: Pick<DirectWrite, "pairs" | "forgetPairs">): void;
    };
  };
  onStoreError: (error: unknown) => void;
  onLeaseEnd?: (lease: Lease, why: "expired" | "fulfilled" | "revoked") => void;
}

interface Waiter {
  model: string;
  since: number;
  resolve: () => void;
}

/** Smoothing of the relay-side latency average (weight of the newest sample). */
const LATENCY_ALPHA = 0.2;

/**
 * The hub's side of the market: feeds it relay events and backbone reports, keeps what is not
 * the market's business (latencies, tokens/s, retries), persists its changes through one write
 * queue, and wakes placement long-polls when a model's placement changes.
 */
export class MarketBook {
  readonly market: CoverageMarket;
  /** What the relay forwarded per backbone: the bound on its reports (forward-ledger.ts). */
  readonly ledger: ForwardLedger;
  /** Both sides' counts of direct traffic, credited at their minimum (direct-credit.ts). */
  readonly direct: DirectCredit;
  readonly #o: MarketBookOptions;
  readonly #latency = new Map<string, { ms: number; results: number; errors: number }>();
  readonly #reported = new Map<string, number>();
  readonly #rates = new Map<string, BackboneRate>();
  readonly #seq = new Map<string, number>();
  /** Seqs taken since the last write (written with the credits they came with). */
  readonly #dirtySeq = new Map<string, { backbone: string; model: string; seq: number }>();
  readonly #waiters = new Set<Waiter>();
  readonly #served = new Map<string, number>();
  #queue: Promise<void> = Promise.resolve();
  #closed = false;

  constructor(options: MarketBookOptions) {
    this.#o = options;
    this.ledger = new ForwardLedger(options.clock);
    this.direct = new DirectCredit({ clock: options.clock, ticketed: options.ticketed ?? (() => false) });
    this.market = new CoverageMarket({
      ...options.market,
      onLeaseEnd: (lease, why) => {
        try {
          options.onLeaseEnd?.(lease, why);
        } catch {
          // an observer's failure is not the market's
        }
      },
    });
  }

  now(): number {
    return this.#o.clock();
  }

  async load(): Promise<void> {
    const [leases, demand, credits] = await Promise.all([
      this.#o.store.listLeases(),
      this.#o.store.listDemand(),
      this.#o.store.listCredits(),
    ]);
    this.market.load({ leases, demand, credits });
    for (const q of (await this.#o.store.listStatsSeqs?.()) ?? []) {
      this.#seq.set(`${q.backbone}\0${q.model}`, q.seq);
    }
    if (this.#o.direct) {
      const state = await this.#o.direct.store.load();
      this.#o.direct.pairs.load(state.pairs);
      this.direct.load(state);
    }
    this.#sweep();
  }

  // --- models and relay events ----------------------------------------------------------------

  addModel(model: MarketModel): void {
    this.market.addModel(model, this.now());
    this.#sweep();
    this.#wake();
  }

  removeModel(id: string): void {
    this.market.removeModel(id);
    this.#enqueue(() => this.#o.store.deleteDemand(id).then(() => undefined));
    this.#wake();
  }

  /** A worker's direct endpoints changed (PUT /api/workers/:id/direct): placements show them. */
  setDirect(id: string, direct: DirectEndpointJson | undefined): void {
    this.market.setDirect(id, direct, this.now());
    this.#wake();
  }

  /** A worker was paused or resumed: placements leave it out or list it again (backbones wake). */
  setPaused(id: string, paused: boolean): void {
    if (this.market.setPaused(id, paused, this.now())) this.#wake();
  }

  onRelayEvent(event: RelayServerEvent): void {
    const now = this.now();
    switch (event.type) {
      case "connect":
        // a new connection starts with no slice (a replaced one's are gone with it), and with the
        // dtypes its hello said (placements show them with its slices)
        if (event.role === "worker") {
          this.market.workerGone(event.id, now);
          this.market.setDtypes(event.id, event.dtypes);
        }
        break;
      case "disconnect":
        if (event.role === "worker" && event.id !== undefined) {
          this.market.workerGone(event.id, now);
          this.market.setDtypes(event.id, undefined);
        }
        break;
      case "register":
        // the leases it fulfils end on disk now, not at the next flush (no ghost after a kill -9)
        if (
          this.market.register(event.id, event.model, event.layers, event.experts, now, {
            ...(event.owner !== undefined ? { owner: event.owner } : {}),
            ...(event.backend !== undefined ? { computeClass: event.backend } : {}),
          }).length > 0
        ) {
          void this.#commit();
        }
        break;
      case "unregister":
        this.market.unregister(event.id, event.model, event.layers, event.experts, now);
        break;
      case "drain":
        this.market.drain(event.id, now);
        break;
      case "routed": {
        const l = this.#latency.get(event.to) ?? { ms: event.ms, results: 0, errors: 0 };
        if (event.outcome === "result") {
          l.ms = l.results === 0 ? event.ms : l.ms + LATENCY_ALPHA * (event.ms - l.ms);
          l.results++;
        } else l.errors++;
        this.#latency.set(event.to, l);
        return;
      }
      default:
        return;
    }
    this.#wake();
  }

  /** Relay-side round trip of a worker's dispatches (moving average, ms), with result and error counts. */
  latencyOf(worker: string): { ms: number; results: number; errors: number } | undefined {
    const l = this.#latency.get(worker);
    return l && { ...l };
  }

  /** The round trip a backbone reported for a worker (its receipts), ms. */
  reportedLatencyOf(worker: string): number | undefined {
    return this.#reported.get(worker);
  }

  // --- backbone reports -------------------------------------------------------------------------

  ingest(model: string, backbone: string, report: StatsReport): StatsOutcome {
    const now = this.now();
    const key = `${backbone}\0${model}`;
    const last = this.#seq.get(key);
    if (report.seq !== undefined) {
      if (last !== undefined && report.seq <= last) {
        return {
          accepted: false,
          layers: 0,
          credited: [],
          ignored: [],
          cut: { expertTokens: 0, counts: 0, tokens: 0 },
          creditedExpertTokens: 0,
        };
      }
    }
    // validated before anything changes: a report is counted whole or not at all
    this.market.checkCounts(model, report.counts);
    // then bounded by what the relay forwarded from this backbone (and that is used up)
    const shape = this.market.coverage(model, now);
    const bounded = this.#o.trustReports
      ? asReported(report)
      : this.ledger.take(backbone, model, report, (layer) => {
          const i = shape.layers.indexOf(layer);
          return i < 0 ? 0 : (shape.nExpert[i] ?? 0);
        });
    this.market.addCounts(model, bounded.counts, now);
    if (report.seq !== undefined) {
      this.#seq.set(key, report.seq);
      this.#dirtySeq.set(key, { backbone, model, seq: report.seq });
    }
    if (bounded.tokens !== undefined && bounded.ms !== undefined) {
      this.#rates.set(key, {
        id: backbone,
        model,
        tokensPerSecond: bounded.tokens / (bounded.ms / 1000),
        at: now,
      });
    }
    const credited: string[] = [];
    const ignored: string[] = [];
    let creditedExpertTokens = 0;
    for (const [worker, receipt] of report.receipts) {
      if (!this.#o.knownWorker(worker)) {
        ignored.push(worker);
        continue;
      }
      let credit = bounded.credits.get(worker) ?? 0;
      if (!this.#o.trustReports && receipt.expertTokens > credit) {
        // beyond the relay's forwards: the backbone's half of direct traffic, matched against the worker's
        const matched = this.direct.fromBackbone(backbone, worker, model, receipt.expertTokens - credit);
        credit += matched;
        bounded.cutCredits -= matched;
      }
      creditedExpertTokens += credit;
      this.market.credit(model, worker, credit, now);
      this.#served.set(model, (this.#served.get(model) ?? 0) + credit);
      if (receipt.ms !== undefined) {
        const had = this.#reported.get(worker);
        this.#reported.set(worker, had === undefined ? receipt.ms : had + LATENCY_ALPHA * (receipt.ms - had));
      }
      credited.push(worker);
    }
    return {
      accepted: true,
      layers: report.counts.size,
      credited,
      ignored,
      cut: { expertTokens: bounded.cutCredits, counts: bounded.cutCounts, tokens: bounded.cutTokens },
      creditedExpertTokens,
    };
  }

  /**
   * A worker's report of what it answered over direct links: each pair is credited the part the
   * backbone's receipts also accepted (direct-credit.ts). Models the hub does not serve are
   * refused like pairs without a ticket; a trusting hub already credited the receipts as reported.
   */
  ingestDirect(
    worker: string,
    report: DirectServedJson,
    hasModel: (id: string) => boolean,
  ): DirectServedOutcome {
    const known = { ...report, served: report.served.filter((e) => hasModel(e.model)) };
    const outcome = this.direct.fromWorker(worker, known);
    if (!outcome.accepted) return outcome;
    for (const e of report.served) {
      if (!hasModel(e.model)) outcome.refused.push({ backbone: e.backbone, model: e.model });
    }
    if (this.#o.trustReports) return { ...outcome, credited: [] };
    const now = this.now();
    for (const c of outcome.credited) {
      if (c.expertTokens === 0) continue;
      this.market.credit(c.model, worker, c.expertTokens, now);
      this.#served.set(c.model, (this.#served.get(c.model) ?? 0) + c.expertTokens);
    }
    return outcome;
  }

  /** Expert-tokens credited per model since this hub started (the metric's source). */
  servedSinceStart(): Map<string, number> {
    return new Map(this.#served);
  }

  /** Backbones whose last report of a model is fresh, with their rate. */
  rates(model?: string): BackboneRate[] {
    const now = this.now();
    return [...this.#rates.values()]
      .filter((r) => (model === undefined || r.model === model) && now - r.at <= this.#o.statsStaleMs)
      .sort((a, b) =>
        a.model < b.model ? -1 : a.model > b.model ? 1 : a.id < b.id ? -1 : a.id > b.id ? 1 : 0,
      )
      .map((r) => ({ ...r }));
  }

  tokensPerSecond(model?: string): number {
    return this.rates(model).reduce((s, r) => s + r.tokensPerSecond, 0);
  }

  // --- leases (written before they are answered) ------------------------------------------------

  /**
   * Grants or renews through `grant`, writes the lease with what ended with it (the leases it
   * replaced) in one transaction, and undoes it when the write fails.
   */
  async writeLease(grant: () => Lease, undo: (lease: Lease) => void): Promise<Lease> {
    const lease = grant();
    try {
      await this.#commit([lease], [], true);
    } catch (error) {
      undo(lease);
      throw isMoeswarmError(error)
        ? error
        : new HubError("MOESWARM_HUB_STORE", String(error), { cause: error });
    }
    return lease;
  }

  /** Writes a released lease's end (with the market's other changes) before it is answered. */
  async deleteLease(id: string): Promise<void> {
    await this.#commit([], [id], true);
  }

  /** Expires what is due (reported through onLeaseEnd). */
  #sweep(): void {
    this.market.expire(this.now());
  }

  // --- persistence ------------------------------------------------------------------------------

  /**
   * Runs `write` after the writes before it. `rethrow`: the caller waits for it and handles the
   * failure; otherwise it is reported (and the change is kept to be retried at the next flush).
   */
  #enqueue(write: () => Promise<void>, rethrow = false): Promise<void> {
    const done = this.#queue.then(write);
    this.#queue = done.catch((error) => {
      if (!rethrow) this.#o.onStoreError(error);
    });
    return rethrow ? done : this.#queue;
  }

  /**
   * Writes what the market changed (credits, demand, ended leases) in one transaction, after the
   * writes before it; rejects (HubError MOESWARM_HUB_STORE) when it cannot, the changes kept for
   * a later write. A stats report is acknowledged only after this, so a kill -9 cannot lose it.
   */
  commit(): Promise<void> {
    return this.#commit([], [], true);
  }

  /**
   * Expires leases and writes what changed (demand decay, expired leases): what an answer
   * depended on was written before it was given (#commit), so a lost flush loses nothing
   * acknowledged.
   */
  flush(): Promise<void> {
    return this.#commit();
  }

  /**
   * One transaction, after the writes before it: `put` (as the market holds them when the write
   * runs: a lease ended meanwhile is deleted, not written back), the ended leases `ended`, and
   * every change the market has not written yet (ended leases, credits, demand).
   */
  #commit(put: readonly Lease[] = [], ended: readonly string[] = [], rethrow = false): Promise<void> {
    return this.#enqueue(async () => {
      this.#sweep();
      const changes = this.market.takeChanges();
      const live = new Map(this.market.leases().map((l) => [l.id, l]));
      // what the caller put, and the titles of served slices the market renewed (trust: a registration
      // needs a live lease, so its renewal must survive a restart too)
      const byId = new Map<string, Lease>();
      for (const l of put) {
        const current = live.get(l.id);
        if (current) byId.set(l.id, current);
      }
      for (const l of changes.leases) byId.set(l.id, l);
      const leases = [...byId.values()];
      // a served slice's title can be both "fulfilled" (dead as a pending lease) and re-put: it stays
      const deleted = [
        ...new Set([...changes.deadLeases, ...ended, ...put.filter((l) => !live.has(l.id)).map((l) => l.id)]),
      ].filter((id) => !byId.has(id));
      const seqs = [...this.#dirtySeq.values()];
      this.#dirtySeq.clear();
      const n = leases.length + deleted.length + changes.credits.length + changes.demand.length;
      // the direct halves first: a crash between the two writes loses a credit, never doubles one
      try {
        await this.#writeDirect();
      } catch (error) {
        this.market.restoreChanges(changes);
        this.#restoreSeqs(seqs);
        throw error;
      }
      if (n + seqs.length === 0) return;
      try {
        await this.#o.store.putLeases(leases, {
          deleteLeases: deleted,
          credits: changes.credits,
          demand: changes.demand,
          ...(seqs.length > 0 ? { statsSeqs: seqs } : {}),
        });
      } catch (error) {
        this.market.restoreChanges(changes);
        this.#restoreSeqs(seqs);
        throw error;
      }
    }, rethrow);
  }

  #restoreSeqs(seqs: ReadonlyArray<{ backbone: string; model: string; seq: number }>): void {
    for (const q of seqs) {
      const key = `${q.backbone}\0${q.model}`;
      if (!this.#dirtySeq.has(key)) this.#dirtySeq.set(key, q);
    }
  }

  /** Writes what changed in the direct credits and ticketed pairs (kept for the next write if it fails). */
  async #writeDirect(): Promise<void> {
    const d = this.#o.direct;
    if (!d) return;
    const halves = this.direct.takeChanges();
    const pairs = d.pairs.takeChanges();
    if (!halves && !pairs) return;
    try {
      await d.store.write({
        pending: halves?.pending ?? [],
        seqs: halves?.seqs ?? [],
        pairs: pairs?.pairs ?? [],
        forgetPairs: pairs?.forgetPairs ?? [],
      });
    } catch (error) {
      if (halves) this.direct.restoreChanges(halves);
      if (pairs) d.pairs.restoreChanges(pairs);
      throw error;
    }
  }

  // --- placement long-polls ---------------------------------------------------------------------

  /**
   * Resolves when the placement version of `model` differs from `since`, after `ms`, when the
   * signal aborts, or when the book closes; whichever first. Never rejects.
   */
  waitForChange(model: string, since: number, ms: number, signal: AbortSignal): Promise<void> {
    return new Promise<void>((resolve) => {
      if (this.#closed || signal.aborted || this.#changed(model, since)) {
        resolve();
        return;
      }
      let timer: ReturnType<typeof setTimeout> | undefined;
      let aborted: Disposable | undefined;
      const waiter: Waiter = {
        model,
        since,
        resolve: () => {
          clearTimeout(timer);
          aborted?.[Symbol.dispose]();
          this.#waiters.delete(waiter);
          resolve();
        },
      };
      timer = setTimeout(waiter.resolve, ms);
      timer.unref?.();
      aborted = onAbort(signal, () => waiter.resolve());
      this.#waiters.add(waiter);
    });
  }

  #changed(model: string, since: number): boolean {
    return !this.market.hasModel(model) || this.market.version(model) !== since;
  }

  #wake(): void {
    for (const w of [...this.#waiters]) if (this.#changed(w.model, w.since)) w.resolve();
  }

  /** Answers every long-poll now, and any later one at once (the hub is closing). */
  stopWaiting(): void {
    this.#closed = true;
    for (const w of [...this.#waiters]) w.resolve();
  }

  /** Stops the long-polls and writes what is left. */
  async close(): Promise<void> {
    this.stopWaiting();
    await this.flush();
  }
}

// What the hub's relay forwarded, per backbone, as the bound on what that backbone may report:
// a stats report credits a worker at most the expert-token pairs the relay carried from that
// backbone to that worker, counts an expert at most as often as the relay carried selections of
// it, and claims at most as many tokens as the relay carried token rows of a layer. What a report
// uses up is gone, so the same figures cannot be credited twice, under any seq.
import type { ForwardInfo } from "./relay-types.js";
import type { StatsReport } from "./stats.js";

/** Layers and experts past these are not tracked (no model has them; a hostile frame may say so). */
const MAX_LAYER = 4096;
const MAX_EXPERT = 65_536;

interface LayerBudget {
  /** Token rows forwarded for this layer. */
  rows: number;
  /** Selections forwarded per expert. */
  experts: Map<number, number>;
}

interface BackboneModel {
  layers: Map<number, LayerBudget>;
  /** Expert-token pairs forwarded per worker, not yet credited. */
  pairs: Map<string, number>;
  /** The largest slots per token (`k`) seen. */
  k: number;
  /** When the first forward since the last report was seen (hub clock). */
  since: number | undefined;
  /** When the last report was taken (hub clock). */
  lastReport: number | undefined;
}

/** A report after bounding: what may be counted, and how much of it was cut. */
export interface BoundedReport {
  counts: Map<number, Uint32Array>;
  /** Credit per worker (receipt order). */
  credits: Map<string, number>;
  tokens: number | undefined;
  /** The span tok/s is computed over: the report's, or longer when the forwards took longer. */
  ms: number | undefined;
  /** Expert-tokens asked for beyond what was forwarded (not credited). */
  cutCredits: number;
  /** Routing counts asked for beyond what was forwarded (not counted). */
  cutCounts: number;
  /** Tokens asked for beyond the rows forwarded. */
  cutTokens: number;
}

/** A report taken as it came (a hub that trusts its backbones: `trustReports`). */
export function asReported(report: StatsReport): BoundedReport {
  const credits = new Map<string, number>();
  for (const [worker, receipt] of report.receipts) credits.set(worker, receipt.expertTokens);
  return {
    counts: report.counts,
    credits,
    tokens: report.tokens,
    ms: report.ms,
    cutCredits: 0,
    cutCounts: 0,
    cutTokens: 0,
  };
}

export class ForwardLedger {
  readonly #byKey = new Map<string, BackboneModel>();
  /** `backbone\0worker` pairs the relay ever carried a request between. */
  readonly #used = new Set<string>();
  readonly #clock: () => number;

  constructor(clock: () => number) {
    this.#clock = clock;
  }

  #entry(backbone: string, model: string): BackboneModel {
    const key = `${backbone}\0${model}`;
    let e = this.#byKey.get(key);
    if (!e) {
      e = { layers: new Map(), pairs: new Map(), k: 0, since: undefined, lastReport: undefined };
      this.#byKey.set(key, e);
    }
    return e;
  }

  /** Counts one forwarded dispatch: its filled slots (ids != -1) per expert and its token rows. */
  forward(f: ForwardInfo): void {
    const e = this.#entry(f.backbone, f.model);
    e.since ??= this.#clock();
    e.k = Math.max(e.k, f.k);
    let filled = 0;
    let layer: LayerBudget | undefined;
    if (Number.isSafeInteger(f.layer) && f.layer >= 0 && f.layer < MAX_LAYER) {
      layer = e.layers.get(f.layer);
      if (!layer) {
        layer = { rows: 0, experts: new Map() };
        e.layers.set(f.layer, layer);
      }
      layer.rows += f.n;
    }
    for (let i = 0; i < f.ids.length; i++) {
      const id = f.ids[i] as number;
      if (id === -1) continue;
      filled++;
      if (layer && id >= 0 && id < MAX_EXPERT) layer.experts.set(id, (layer.experts.get(id) ?? 0) + 1);
    }
    e.pairs.set(f.worker, (e.pairs.get(f.worker) ?? 0) + filled);
    this.#used.add(`${f.backbone}\0${f.worker}`);
  }

  /** Whether the relay ever carried a request of this backbone to this worker. */
  forwardedTo(backbone: string, worker: string): boolean {
    return this.#used.has(`${backbone}\0${worker}`);
  }

  /** Expert-token pairs forwarded from a backbone to a worker and not yet credited. */
  uncredited(backbone: string, worker: string, model: string): number {
    return this.#byKey.get(`${backbone}\0${model}`)?.pairs.get(worker) ?? 0;
  }

  /**
   * Bounds a report by what was forwarded and uses that up. `nExpert(layer)`: the layer's experts.
   * Layers the relay carried nothing of are the backbone's local ones: their counts are capped at
   * `tokens * k` in all and `tokens` per expert.
   */
  take(
    backbone: string,
    model: string,
    report: StatsReport,
    nExpert: (layer: number) => number,
  ): BoundedReport {
    const e = this.#entry(backbone, model);
    const now = this.#clock();
    let cutCredits = 0;
    let cutCounts = 0;
    let cutTokens = 0;
    const credits = new Map<string, number>();
    for (const [worker, receipt] of report.receipts) {
      const have = e.pairs.get(worker) ?? 0;
      const credit = Math.min(receipt.expertTokens, have);
      cutCredits += receipt.expertTokens - credit;
      if (have - credit > 0) e.pairs.set(worker, have - credit);
      else e.pairs.delete(worker);
      credits.set(worker, credit);
    }
    let tokens = report.tokens;
    if (tokens !== undefined) {
      let rows = 0;
      for (const l of e.layers.values()) rows = Math.max(rows, l.rows);
      const bounded = Math.min(tokens, rows);
      cutTokens = tokens - bounded;
      tokens = bounded;
      for (const l of e.layers.values()) l.rows = Math.max(0, l.rows - bounded);
    }
    const k = Math.max(1, e.k);
    const counts = new Map<number, Uint32Array>();
    for (const [layer, values] of report.counts) {
      const out = new Uint32Array(values.length);
      const relayed = e.layers.get(layer);
      if (relayed && relayed.experts.size > 0) {
        for (let x = 0; x < values.length; x++) {
          const have = relayed.experts.get(x) ?? 0;
          const v = Math.min(values[x] as number, have);
          out[x] = v;
          cutCounts += (values[x] as number) - v;
          if (have - v > 0) relayed.experts.set(x, have - v);
          else relayed.experts.delete(x);
        }
      } else {
        // a layer the backbone computes itself: an expert is chosen at most once per token
        const perExpert = tokens ?? 0;
        let sum = 0;
        for (let x = 0; x < values.length; x++) {
          out[x] = Math.min(values[x] as number, perExpert);
          sum += out[x] as number;
        }
        const cap = perExpert * Math.min(k, Math.max(1, nExpert(layer)));
        const scale = sum > cap ? cap / sum : 1;
        for (let x = 0; x < values.length; x++) {
          const v = Math.floor((out[x] as number) * scale);
          cutCounts += (values[x] as number) - v;
          out[x] = v;
        }
      }
      counts.set(layer, out);
    }
    let ms = report.ms;
    const from = e.lastReport ?? e.since;
    if (ms !== undefined && from !== undefined) ms = Math.max(ms, now - from);
    e.lastReport = now;
    e.since = undefined;
    return { counts, credits, tokens, ms, cutCredits, cutCounts, cutTokens };
  }
}

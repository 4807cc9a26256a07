import { InvalidArgumentError } from "@moeswarm/core";
import { type DispatchCallMetrics, FALLBACK_OWNER, REFERENCE_OWNER } from "@moeswarm/dispatch";
import type { BridgeStatsReport } from "./stats-report.js";

/** How often the router sent tokens of a layer to an expert (for the hub's coverage market). */
export interface RoutingCount {
  layer: number;
  expert: number;
  count: number;
}

interface Receipt {
  slots: number;
  requests: number;
  latencyMs: number;
}

/**
 * The current report span: what the router chose (every request, answered or not), the tokens that
 * went through each layer and what each worker served. `takeReport` hands it over and starts anew.
 */
export class RoutingStats {
  private routing = new Map<number, Map<number, number>>();
  private spanStart = performance.now();
  private spanTokens = new Map<number, number>();
  private receipts = new Map<string, Receipt>();

  /** The router's choices of one request: `ids` is its `[n x k]` expert ids (-1: no expert). */
  countSelections(layer: number, ids: Int32Array): void {
    let byExpert = this.routing.get(layer);
    if (!byExpert) {
      byExpert = new Map();
      this.routing.set(layer, byExpert);
    }
    for (const e of ids) if (e >= 0) byExpert.set(e, (byExpert.get(e) ?? 0) + 1);
  }

  /** `count` more router choices of `expert` in `layer` (a native split's, from the receipts). */
  countRouted(layer: number, expert: number, count: number): void {
    let byExpert = this.routing.get(layer);
    if (!byExpert) {
      byExpert = new Map();
      this.routing.set(layer, byExpert);
    }
    byExpert.set(expert, (byExpert.get(expert) ?? 0) + count);
  }

  /** An answered request: its tokens, and the slots each worker that answered computed. */
  countServed(layer: number, tokens: number, owners: DispatchCallMetrics["owners"]): void {
    this.spanTokens.set(layer, (this.spanTokens.get(layer) ?? 0) + tokens);
    for (const [id, o] of Object.entries(owners)) {
      if (o.failures === o.requests || id === REFERENCE_OWNER) continue;
      const rec = this.receipts.get(id) ?? { slots: 0, requests: 0, latencyMs: 0 };
      rec.slots += o.slots;
      rec.requests += o.requests - o.failures;
      rec.latencyMs += o.latencyMs;
      this.receipts.set(id, rec);
    }
  }

  /**
   * Native splits the plugin sent `worker` itself (its receipts): their token rows go through
   * `layer` and their filled ids are the worker's receipt, as if this bridge had routed them. The
   * per-expert routing counts come with the receipts' `routing` (countRouted).
   */
  countNative(layer: number, worker: string | undefined, tokens: number, expertTokens: number): void {
    this.spanTokens.set(layer, (this.spanTokens.get(layer) ?? 0) + tokens);
    if (worker === undefined) return; // a split layer's tokens alone (its owners' counts follow)
    const rec = this.receipts.get(worker) ?? { slots: 0, requests: 0, latencyMs: 0 };
    // no latency: the round trip's mean (`ms`) stays the one the bridge measured
    rec.slots += expertTokens;
    this.receipts.set(worker, rec);
  }

  /** The routing counts of the span, by layer then expert. */
  *counts(): IterableIterator<RoutingCount> {
    for (const layer of [...this.routing.keys()].sort((a, b) => a - b)) {
      const byExpert = this.routing.get(layer)!;
      for (const expert of [...byExpert.keys()].sort((a, b) => a - b)) {
        yield { layer, expert, count: byExpert.get(expert)! };
      }
    }
  }

  /** The span as the hub's report (`nExpert` counts per layer), and a new span from now. */
  takeReport(nExpert: number): BridgeStatsReport {
    if (!Number.isInteger(nExpert) || nExpert < 1 || nExpert > 65_536) {
      throw new InvalidArgumentError("takeStatsReport: nExpert must be an integer in 1..65536");
    }
    const counts: Record<string, number[]> = {};
    for (const [layer, byExpert] of this.routing) {
      const row = new Array<number>(nExpert).fill(0);
      for (const [e, c] of byExpert) {
        if (e >= nExpert) {
          throw new InvalidArgumentError(
            `takeStatsReport: expert ${e} was routed in layer ${layer}, nExpert is ${nExpert}`,
          );
        }
        row[e] = c;
      }
      counts[String(layer)] = row;
    }
    const receipts: BridgeStatsReport["receipts"] = {};
    for (const [id, r] of this.receipts) {
      // the fallback is this process, not a worker to credit
      if (id === FALLBACK_OWNER) continue;
      receipts[id] = { expertTokens: r.slots, ...(r.requests > 0 ? { ms: r.latencyMs / r.requests } : {}) };
    }
    const lowest = Math.min(...this.spanTokens.keys());
    const now = performance.now();
    const report: BridgeStatsReport = {
      tokens: this.spanTokens.size ? this.spanTokens.get(lowest)! : 0,
      ms: now - this.spanStart,
      counts,
      receipts,
    };
    this.routing = new Map();
    this.spanTokens = new Map();
    this.receipts = new Map();
    this.spanStart = now;
    return report;
  }
}

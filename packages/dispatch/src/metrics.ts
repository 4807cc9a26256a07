/** One worker's share of a dispatch call. */
export interface OwnerCallMetrics {
  /** Requests sent to it in this call (a retry on it counts again). */
  requests: number;
  tokens: number;
  /** (token, expert) slots it was asked to compute. */
  slots: number;
  /** Tensor payload bytes sent (x, ids, w) and received (y); frame headers not included. */
  bytesOut: number;
  bytesIn: number;
  /** Milliseconds from send to settle, summed over its requests in this call. */
  latencyMs: number;
  /** The slowest of its requests in this call. */
  latencyMsMax: number;
  /** Compute milliseconds the worker reported (`ms`), summed. */
  computeMs: number;
  /** Requests that failed, or whose answer a spot check refused. */
  failures: number;
}

/** What one `dispatchExperts` call did; a plain object for logs and the hub. */
export interface DispatchCallMetrics {
  layer: number;
  /** The call's mode ("auto" chooses per request: see `sumRequests`). */
  mode: "each" | "sum" | "auto";
  /** Requests that asked for the worker's sum (mode "sum", or "auto" where one worker held a token's every slot). */
  sumRequests: number;
  tokens: number;
  k: number;
  /** Requests sent, retries and fallback calls included. */
  requests: number;
  bytesOut: number;
  bytesIn: number;
  /** Failed requests whose experts were retried on a replica. */
  failovers: number;
  /**
   * Requests answered locally in place of a worker: the fallback after failover, experts nobody
   * holds, and (trust "verify") parts only one untrusted owner holds. Never an audit.
   */
  fallbacks: number;
  /** Trust "verify": local computes of audits (agreed answers re-computed before use). */
  audits: number;
  /** Worker answers compared with a re-computation (`verify`), and those that disagreed (replaced). */
  spotChecks: number;
  spotDisagreements: number;
  /** Answers drawn for a check that nothing could re-compute. */
  spotUnverifiable: number;
  /** Hedged requests sent (`hedgeMs`), and those the replica won. */
  hedges: number;
  hedgeWins: number;
  /** Trust "verify": parts two owners answered alike (or a third opinion decided). */
  verifiedParts: number;
  /** Trust "verify": pairs that disagreed, and third opinions asked. */
  verifyDisagreements: number;
  thirdOpinions: number;
  /** Trust "verify": payload bytes of the second and third opinions. */
  verifyExtraBytes: number;
  /** Requests that ran past their (adaptive) deadline. */
  timeouts: number;
  /** Per worker id; the fallback appears as "<fallback>", a spot check's reference as "<reference>". */
  owners: Record<string, OwnerCallMetrics>;
  wallMs: number;
  /** The error code when the call failed. */
  error?: string;
}

export interface OwnerTotals {
  requests: number;
  failures: number;
  slots: number;
  bytesOut: number;
  bytesIn: number;
  latencyMsTotal: number;
  latencyMsMax: number;
}

export interface DispatchMetricsSnapshot {
  calls: number;
  failedCalls: number;
  requests: number;
  /** Requests answered with the worker's sum (see {@link DispatchCallMetrics.sumRequests}). */
  sumRequests: number;
  bytesOut: number;
  bytesIn: number;
  failovers: number;
  /** Local answers in place of a worker (see {@link DispatchCallMetrics.fallbacks}). */
  fallbacks: number;
  /** Local computes of trust "verify"'s audits (see {@link DispatchCallMetrics.audits}). */
  audits: number;
  spotChecks: number;
  spotDisagreements: number;
  spotUnverifiable: number;
  /** Hedged requests sent (`hedgeMs`), and those the replica won. */
  hedges: number;
  hedgeWins: number;
  /** Trust "verify" (see {@link DispatchCallMetrics.verifiedParts}). */
  verifiedParts: number;
  verifyDisagreements: number;
  thirdOpinions: number;
  verifyExtraBytes: number;
  timeouts: number;
  wallMsTotal: number;
  owners: Record<string, OwnerTotals>;
  /** Failed calls by error code. */
  errors: Record<string, number>;
}

/** The fallback's key in {@link DispatchCallMetrics.owners}. */
export const FALLBACK_OWNER = "<fallback>";

/** The key of a spot check's local re-computation (`SpotCheck` `reference`) in {@link DispatchCallMetrics.owners}. */
export const REFERENCE_OWNER = "<reference>";

/**
 * Aggregates {@link DispatchCallMetrics} over many calls (pass it as `metrics` to
 * `dispatchExperts`); the backbone and hub read {@link DispatchMetrics.snapshot}.
 */
export class DispatchMetrics {
  #s: DispatchMetricsSnapshot = DispatchMetrics.#empty();

  static #empty(): DispatchMetricsSnapshot {
    return {
      calls: 0,
      failedCalls: 0,
      requests: 0,
      sumRequests: 0,
      bytesOut: 0,
      bytesIn: 0,
      failovers: 0,
      fallbacks: 0,
      audits: 0,
      spotChecks: 0,
      spotDisagreements: 0,
      spotUnverifiable: 0,
      hedges: 0,
      hedgeWins: 0,
      verifiedParts: 0,
      verifyDisagreements: 0,
      thirdOpinions: 0,
      verifyExtraBytes: 0,
      timeouts: 0,
      wallMsTotal: 0,
      owners: Object.create(null) as Record<string, OwnerTotals>,
      errors: Object.create(null) as Record<string, number>,
    };
  }

  record(call: DispatchCallMetrics): void {
    const s = this.#s;
    s.calls++;
    if (call.error !== undefined) {
      s.failedCalls++;
      s.errors[call.error] = (Object.hasOwn(s.errors, call.error) ? s.errors[call.error]! : 0) + 1;
    }
    s.requests += call.requests;
    s.sumRequests += call.sumRequests ?? 0;
    s.bytesOut += call.bytesOut;
    s.bytesIn += call.bytesIn;
    s.failovers += call.failovers;
    s.fallbacks += call.fallbacks;
    // `?? 0`: calls recorded by code built before these counters existed
    s.audits += call.audits ?? 0;
    s.spotChecks += call.spotChecks ?? 0;
    s.spotDisagreements += call.spotDisagreements ?? 0;
    s.spotUnverifiable += call.spotUnverifiable ?? 0;
    s.hedges += call.hedges ?? 0;
    s.hedgeWins += call.hedgeWins ?? 0;
    s.verifiedParts += call.verifiedParts ?? 0;
    s.verifyDisagreements += call.verifyDisagreements ?? 0;
    s.thirdOpinions += call.thirdOpinions ?? 0;
    s.verifyExtraBytes += call.verifyExtraBytes ?? 0;
    s.timeouts += call.timeouts ?? 0;
    s.wallMsTotal += call.wallMs;
    for (const [id, o] of Object.entries(call.owners)) {
      let t = Object.hasOwn(s.owners, id) ? s.owners[id] : undefined;
      if (!t) {
        t = {
          requests: 0,
          failures: 0,
          slots: 0,
          bytesOut: 0,
          bytesIn: 0,
          latencyMsTotal: 0,
          latencyMsMax: 0,
        };
        s.owners[id] = t;
      }
      t.requests += o.requests;
      t.failures += o.failures;
      t.slots += o.slots;
      t.bytesOut += o.bytesOut;
      t.bytesIn += o.bytesIn;
      t.latencyMsTotal += o.latencyMs;
      t.latencyMsMax = Math.max(t.latencyMsMax, o.latencyMsMax);
    }
  }

  /** A deep copy of the totals. */
  snapshot(): DispatchMetricsSnapshot {
    return structuredClone(this.#s);
  }

  reset(): void {
    this.#s = DispatchMetrics.#empty();
  }
}

import type { ExpertHandler, ExpertTransport } from "@moeswarm/core";
import { DEFAULT_DEADLINE_MS, type DispatchOptions } from "./dispatch-options.js";
import type { Liveness } from "./liveness.js";
import {
  type DispatchCallMetrics,
  FALLBACK_OWNER,
  type OwnerCallMetrics,
  REFERENCE_OWNER,
} from "./metrics.js";
import type { Placement } from "./placement.js";
import type { Routing } from "./route.js";
import type { SpotCheck } from "./spot-check.js";
import { resolveTrust } from "./trust.js";
import type { Verification } from "./verification.js";

export type Precision = "f32" | "f64";

/**
 * Whether a call has ended early, and why: read like an AbortSignal's `aborted` and `reason`. A
 * plain object rather than an AbortController's signal: nothing outside the call listens to it
 * (each request's transport gets its attempt's own signal), and an AbortController per call was
 * ~5% of a one-token dispatchExperts (issue #15).
 */
export interface CallEnd {
  readonly aborted: boolean;
  readonly reason: unknown;
}

/**
 * What one dispatch call shares between its requests: the settings, the (possibly expanded)
 * input, the call's metrics, and the early end (caller abort or a failure) that ends every
 * outstanding request.
 */
export class CallState {
  readonly precision: Precision;
  readonly layer: number;
  readonly model: string;
  readonly mode: "each" | "sum" | "auto";
  readonly deadlineMs: number;
  readonly placement: Placement;
  readonly transport: ExpertTransport;
  readonly fallback: ExpertHandler | undefined;
  readonly retry: boolean;
  readonly verify: SpotCheck | undefined;
  /** A fixed hedge delay (ms > 0), "adaptive" (liveness's per-worker delay) or undefined: no hedge. */
  readonly hedgeMs: number | "adaptive" | undefined;
  /** Trust "verify": every part answered by two owners (verify-step.ts); undefined for "own". */
  readonly verification: Verification | undefined;
  /** Per-worker adaptive deadlines and the circuit breaker; undefined: fixed deadlines. */
  readonly liveness: Liveness | undefined;
  /** The local third opinion of trust "verify" (its reference, else the fallback). */
  readonly thirdOpinion: { readonly handler: ExpertHandler; readonly key: string } | undefined;
  readonly hidden: Float32Array | Float64Array;
  readonly routing: Routing;
  readonly embd: number;
  readonly rotation: number;
  /** Set when the call ends early (caller abort or a failure); see {@link end}. */
  readonly #end: { aborted: boolean; reason: unknown } = { aborted: false, reason: undefined };
  /** Outstanding attempts, ended together when the call ends early (one listener, not one each). */
  readonly #active = new Set<(reason: unknown) => void>();
  readonly metrics: DispatchCallMetrics;

  constructor(
    precision: Precision,
    options: DispatchOptions,
    hidden: Float32Array | Float64Array,
    routing: Routing,
    embd: number,
  ) {
    this.precision = precision;
    this.layer = options.layer;
    this.model = options.model ?? options.placement.model;
    this.mode = precision === "f64" && options.mode !== "sum" ? "each" : (options.mode ?? "each");
    this.deadlineMs = options.deadlineMs ?? DEFAULT_DEADLINE_MS;
    this.placement = options.placement;
    this.transport = options.transport;
    this.fallback = options.fallback;
    this.retry = options.retry ?? true;
    this.verify = options.verify;
    const trust = resolveTrust(options);
    this.verification = trust.verification;
    this.liveness = trust.liveness;
    this.hedgeMs = trust.hedgeMs;
    const ref = trust.verification?.reference;
    this.thirdOpinion = ref
      ? { handler: ref, key: REFERENCE_OWNER }
      : options.fallback
        ? { handler: options.fallback, key: FALLBACK_OWNER }
        : undefined;
    this.hidden = hidden;
    this.routing = routing;
    this.embd = embd;
    this.rotation = options.placement.nextRotation();
    this.metrics = emptyCallMetrics(options.layer, this.mode, routing);
  }

  /** Whether (and why) the call ended early. */
  get signal(): CallEnd {
    return this.#end;
  }

  /**
   * Ends the call early: `signal.aborted` becomes true, then every outstanding attempt's listener
   * runs once (each aborts its own request's signal), as an AbortController's abort did. A second
   * end does nothing.
   */
  end(reason: unknown): void {
    if (this.#end.aborted) return;
    this.#end.aborted = true;
    this.#end.reason = reason;
    for (const listener of [...this.#active]) listener(reason);
  }

  /**
   * Calls `listener` when the call ends early ({@link end}); a call with hundreds of requests
   * keeps them in one set, with no event listener each.
   */
  onEnd(listener: (reason: unknown) => void): Disposable {
    this.#active.add(listener);
    return { [Symbol.dispose]: () => this.#active.delete(listener) };
  }

  /** The call's metrics for worker (or pseudo-owner) `id`, created at first use. */
  owner(id: string): OwnerCallMetrics {
    let o = Object.hasOwn(this.metrics.owners, id) ? this.metrics.owners[id] : undefined;
    if (!o) {
      o = {
        requests: 0,
        tokens: 0,
        slots: 0,
        bytesOut: 0,
        bytesIn: 0,
        latencyMs: 0,
        latencyMsMax: 0,
        computeMs: 0,
        failures: 0,
      };
      this.metrics.owners[id] = o;
    }
    return o;
  }

  /** Workers `choose` must skip: the quarantined ones, those whose circuit is open, plus `also`. */
  exclude(also?: string): Set<string> | undefined {
    let out = this.verify?.excluded();
    for (const more of [this.verification?.excluded(), this.liveness?.excluded()]) {
      if (!more || more.size === 0) continue;
      if (!out) out = more;
      else for (const id of more) out.add(id);
    }
    if (also === undefined) return out;
    return out ? out.add(also) : new Set([also]);
  }

  /** Another owner of every expert of the part, not quarantined, chosen as `choose` would. */
  replicaOfAll(
    worker: string,
    experts: readonly number[],
    avoid?: string | ReadonlySet<string>,
  ): string | undefined {
    const exclude = this.exclude(worker)!;
    if (typeof avoid === "string") exclude.add(avoid);
    else if (avoid) for (const id of avoid) exclude.add(id);
    const first = experts[0]!;
    for (const id of this.placement.owners(this.layer, first)) {
      if (exclude.has(id)) continue;
      if (!experts.every((e) => this.placement.owners(this.layer, e).includes(id))) exclude.add(id);
    }
    return this.placement.choose(this.layer, first, { rotation: this.rotation, exclude });
  }
}

/** A call's metrics before anything happened (also what a caller reports for a call that never ran). */
export function emptyCallMetrics(
  layer: number,
  mode: "each" | "sum" | "auto",
  shape: { readonly n: number; readonly k: number },
): DispatchCallMetrics {
  return {
    layer,
    mode,
    sumRequests: 0,
    tokens: shape.n,
    k: shape.k,
    requests: 0,
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
    // worker ids are untrusted (a peer may call itself "__proto__"): no prototype to pollute
    owners: Object.create(null) as Record<string, OwnerCallMetrics>,
    wallMs: 0,
  };
}

import type { ExpertHandler, ExpertTransport } from "@moeswarm/core";
import { InvalidArgumentError } from "@moeswarm/core";
import { Liveness } from "./liveness.js";
import type { DispatchCallMetrics, DispatchMetrics } from "./metrics.js";
import type { Placement } from "./placement.js";
import { SpotCheck } from "./spot-check.js";
import { Verification } from "./verification.js";

export interface DispatchOptions {
  /** The MoE layer (block index) the routing belongs to. */
  readonly layer: number;
  readonly placement: Placement;
  readonly transport: ExpertTransport;
  /** Model id in the requests; default `placement.model`. */
  readonly model?: string;
  readonly signal?: AbortSignal;
  /** How long to wait for each request before failing over (default 30000 ms). */
  readonly deadlineMs?: number;
  /**
   * "each" (default): workers return every slot's output and the combine here is in the router's
   * k order, bit-identical whatever the placement. "auto" (recommended; the backbone bridge uses
   * it): per worker request, "sum" when the worker holds every filled slot of every token it is
   * sent (its weighted sum, products rounded to f32 and added in slot order, is then the whole sum,
   * the same bits as the combine here: k times fewer bytes back), else "each"; bit-identical to
   * "each" whatever the placement, but every worker must answer both modes as the protocol says.
   * "sum": workers always return their partial sums; partials from several workers are added here,
   * which is not bit-identical across placements (f32 addition is not associative; see README).
   * The f64 path treats "auto" as "each".
   */
  readonly mode?: "each" | "sum" | "auto";
  /** Serves experts whose workers failed (after the replica retry) or that have no owner. */
  readonly fallback?: ExpertHandler;
  /** Retry a failed request once on replicas (default true). */
  readonly retry?: boolean;
  /** Aggregate collector; every call, failed ones too, is recorded. */
  readonly metrics?: DispatchMetrics;
  /**
   * Hedged requests (tail latency): a worker that has not answered after this many ms gets a
   * twin request to a replica owning all the same experts; the first good answer is used and the
   * other request is cancelled. `0` turns hedging off. Default: off, except under trust "own" with
   * liveness on (an untrusted transport), where the delay adapts per worker (about 2x its p50
   * round time). Replicas on other hardware round differently, so with hedging the output bits can
   * depend on which replica was faster (the values never do).
   */
  readonly hedgeMs?: number;
  /**
   * Who the owners are. "verify": strangers; every part is answered by two distinct owners and
   * compared (trust.ts, verify-step.ts), a lie is decided by a third opinion and its owner
   * quarantined, and a part only one owner holds is served by `fallback` or fails with
   * MOESWARM_VERIFY_UNAVAILABLE. "own": the caller's own devices; answers are taken as they come.
   * Default: "own" when the transport says it is `trusted` (in-process, worker threads), else "verify".
   */
  readonly trust?: "verify" | "own";
  /** The state of trust "verify" shared across calls (quarantine, counters, `onQuarantine`); default: one per transport. */
  readonly verification?: Verification;
  /**
   * Per-worker adaptive deadlines and the circuit breaker, shared across calls. Default: one per
   * transport when the transport is not `trusted`; `false` turns it off.
   */
  readonly liveness?: Liveness | false;
  /**
   * Result spot-checking, shared across calls: a sampled share of the workers' answers is
   * re-computed (its `reference`, else a replica) before the combine; a disagreeing answer is
   * replaced and its worker struck, and quarantined workers get no requests.
   */
  readonly verify?: SpotCheck;
}

export interface DispatchResult<T extends Float32Array | Float64Array> {
  /** `[n x embd]`. */
  readonly output: T;
  readonly metrics: DispatchCallMetrics;
}

export const DEFAULT_DEADLINE_MS = 30_000;
export const MAX_TOKENS = 65_536;
export const MAX_EMBD = 65_536;

/** Checks the options eagerly, before anything is sent. */
export function validateOptions(options: DispatchOptions): void {
  if (typeof options !== "object" || options === null)
    throw new InvalidArgumentError("dispatchExperts: options are required");
  if (!Number.isInteger(options.layer) || options.layer < 0) {
    throw new InvalidArgumentError("dispatchExperts: layer must be a non-negative integer");
  }
  const p = options.placement as Partial<Placement> | undefined;
  if (!p || typeof p.choose !== "function" || typeof p.owners !== "function") {
    throw new InvalidArgumentError("dispatchExperts: placement must be a Placement");
  }
  if (!options.transport || typeof options.transport.request !== "function") {
    throw new InvalidArgumentError("dispatchExperts: transport must have request()");
  }
  const d = options.deadlineMs;
  if (d !== undefined && !(Number.isFinite(d) && d > 0 && d <= 2_147_483_647)) {
    throw new InvalidArgumentError("dispatchExperts: deadlineMs must be in (0, 2^31)");
  }
  const mode = options.mode;
  if (mode !== undefined && mode !== "each" && mode !== "sum" && mode !== "auto") {
    throw new InvalidArgumentError(`dispatchExperts: unknown mode ${String(mode)}`);
  }
  if (options.fallback !== undefined && typeof options.fallback !== "function") {
    throw new InvalidArgumentError("dispatchExperts: fallback must be a function");
  }
  const h = options.hedgeMs;
  if (h !== undefined && !(typeof h === "number" && Number.isFinite(h) && h >= 0)) {
    throw new InvalidArgumentError("dispatchExperts: hedgeMs must be a finite number >= 0");
  }
  const t = options.trust;
  if (t !== undefined && t !== "verify" && t !== "own") {
    throw new InvalidArgumentError(`dispatchExperts: trust must be "verify" or "own", got ${String(t)}`);
  }
  if (options.verification !== undefined && !(options.verification instanceof Verification)) {
    throw new InvalidArgumentError("dispatchExperts: verification must be a Verification");
  }
  const l = options.liveness;
  if (l !== undefined && l !== false && !(l instanceof Liveness)) {
    throw new InvalidArgumentError("dispatchExperts: liveness must be a Liveness or false");
  }
  if (options.verify !== undefined && !(options.verify instanceof SpotCheck)) {
    throw new InvalidArgumentError("dispatchExperts: verify must be a SpotCheck");
  }
}

import { formatRange, toRanges } from "@moeswarm/core";

// The vocabulary of a dispatch call's pipeline. A call groups its experts by owner; each group is
// served as Parts by small steps composed around the transport call, in the manner of undici's
// interceptors: attempt (one request, its deadline, the result's acceptance) <- hedge <- spot
// check, and around those failover to replicas and the fallback (failover.ts).

/** One answered request: which tokens and experts it covered and the worker's `y`. */
export interface Part {
  readonly tokens: Int32Array;
  readonly ids: Int32Array;
  readonly y: Float32Array | Float64Array;
  /** The layout of `y`: the request's mode. */
  readonly mode: "each" | "sum";
  readonly experts: readonly number[];
  /** The worker that answered; undefined for the fallback and the reference. */
  readonly worker: string | undefined;
  /** A spot check compared it (or it is the re-computation that replaced a worker's answer). */
  readonly verified: boolean;
  /**
   * Trust "verify": the other owners whose answers agreed with this one (bit for bit when they
   * share a compute class). A later check that disproves this answer convicts them with it.
   */
  readonly twins?: ReadonlyArray<{ readonly worker: string; readonly y: Float32Array | Float64Array }>;
  /** Payload bytes it moved (request out + answer in) and the compute ms its answerer reported. */
  readonly bytes?: number;
  readonly computeMs?: number | undefined;
}

/** What a step is asked: a worker's share of the call. */
export interface Ask {
  readonly worker: string;
  readonly experts: readonly number[];
  /** A worker a hedge must not go to (the one whose failure this ask replaces). */
  readonly avoid?: string;
  /** Ends this ask early without blaming the worker (the hedge's twin answered first). */
  readonly cancel?: AbortSignal;
  /** Trust "verify": the second owner chosen for the part (see verify-step.ts). */
  readonly second?: string;
}

/** Serves an ask as one part, or rejects. */
export type Answer = (ask: Ask) => Promise<Part>;

/** A step around an Answer. */
export type Interceptor = (next: Answer) => Answer;

/** `answer` wrapped by `steps`, the first innermost. */
export function compose(answer: Answer, ...steps: (Interceptor | undefined)[]): Answer {
  return steps.reduce<Answer>((inner, step) => (step ? step(inner) : inner), answer);
}

/** Expert ids as ranges, for messages: "0-3,7". */
export function describeExperts(experts: readonly number[]): string {
  return toRanges(experts).map(formatRange).join(",");
}

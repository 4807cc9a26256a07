import { AbortError } from "@moeswarm/core";
import type { CallState } from "./call-state.js";
import type { Answer, Ask, Interceptor, Part } from "./part.js";

/**
 * The hedge step: the ask, and after `hedgeMs` without an answer a twin to a replica owning all
 * the same experts: the first good answer wins and the other request is cancelled. When both
 * fail, the worker's own error is thrown (failover takes it from there).
 */
export function withHedge(call: CallState, hedgeMs: number | "adaptive"): Interceptor {
  return (next) => (ask) => {
    // adaptive: about 2x the worker's p50 round time; no history yet, no hedge
    const ms = hedgeMs === "adaptive" ? call.liveness?.hedgeDelay(ask.worker) : hedgeMs;
    return ms === undefined ? next(ask) : hedged(call, next, ms, ask);
  };
}

async function hedged(call: CallState, next: Answer, hedgeMs: number, ask: Ask): Promise<Part> {
  const { worker, experts, avoid } = ask;
  // with liveness the twin never cancels the first request (see below): no controller, which
  // saves an AbortController and a listener on every hedged request
  const cancelFirst = call.liveness ? undefined : new AbortController();
  const first = next({ ...ask, cancel: cancelFirst?.signal });
  const early = await settledWithin(first, hedgeMs);
  if (early !== undefined) {
    if ("error" in early) throw early.error;
    return early.part;
  }
  const replica = call.replicaOfAll(worker, experts, avoid);
  if (replica === undefined || call.signal.aborted) return first;
  call.metrics.hedges++;
  const cancelSecond = new AbortController();
  const second = next({ worker: replica, experts, cancel: cancelSecond.signal });
  const twinFirst = () => new AbortError("the hedge's twin answered first");
  return new Promise<Part>((resolve, reject) => {
    let failed = 0;
    let firstError: unknown;
    const lost = () => {
      if (++failed === 2) reject(firstError);
    };
    first.then(
      (part) => {
        cancelSecond.abort(twinFirst());
        resolve(part);
      },
      (error: unknown) => {
        firstError = error;
        lost();
      },
    );
    second.then(
      (part) => {
        call.metrics.hedgeWins++;
        // with liveness the slow request runs on to its own deadline (its answer is dropped): a
        // worker that hangs then times out and its circuit opens, instead of being hedged around
        // on every call
        cancelFirst?.abort(twinFirst());
        resolve(part);
      },
      (error: unknown) => {
        firstError ??= error;
        lost();
      },
    );
  });
}

/**
 * How `pending` settled if it did within `ms`, else undefined (and no timer is left behind).
 * A bare timer, not `sleep` with an AbortController: this runs on every hedged request, and
 * aborting a controller without a reason builds a DOMException (a stack capture) each time.
 */
function settledWithin(
  pending: Promise<Part>,
  ms: number,
): Promise<{ part: Part } | { error: unknown } | undefined> {
  return new Promise((resolve) => {
    const timer = setTimeout(() => resolve(undefined), ms);
    pending.then(
      (part) => {
        clearTimeout(timer);
        resolve({ part });
      },
      (error: unknown) => {
        clearTimeout(timer);
        resolve({ error });
      },
    );
  });
}

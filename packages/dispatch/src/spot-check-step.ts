import { attempt } from "./attempt.js";
import type { CallState } from "./call-state.js";
import type { Interceptor, Part } from "./part.js";
import type { SpotCheck } from "./spot-check.js";
import { clampCos, digest, norm } from "./verify-step.js";

/**
 * The spot-check step: a sampled answer is re-computed (the reference, else a replica) and
 * compared before the combine. The draw is made before the ask is sent, so the draws follow the
 * call's (deterministic) send order, not the order answers arrive in.
 */
export function withSpotCheck(call: CallState, verify: SpotCheck): Interceptor {
  return (next) => async (ask) => {
    const sampled = verify.sample();
    const part = await next(ask);
    // a local answer (the fallback's: no worker) is not a worker's to check, nor to blame on the
    // worker it stands in for
    return sampled && part.worker !== undefined ? spotCheck(call, verify, part.worker, part) : part;
  };
}

/**
 * Re-computes a worker's part and compares. The worker's part when it agrees or cannot be
 * checked; the re-computation when it disagrees (and a strike).
 */
async function spotCheck(call: CallState, v: SpotCheck, worker: string, part: Part): Promise<Part> {
  const { experts } = part;
  const replica = v.reference ? undefined : call.replicaOfAll(worker, experts);
  const unverifiable = () => {
    v.unverifiable();
    call.metrics.spotUnverifiable++;
    return part;
  };
  if (!v.reference && replica === undefined) return unverifiable();
  let ref: Part;
  try {
    ref = await (replica === undefined
      ? attempt(call, "reference")({ worker, experts })
      : attempt(call, "transport")({ worker: replica, experts }));
  } catch (error) {
    if (call.signal.aborted) throw error;
    return unverifiable();
  }
  const n = part.tokens.length;
  const c = v.compare(part.mode, n, call.routing.k, call.embd, part.ids, part.tokens, part.y, ref.y);
  call.metrics.spotChecks++;
  if (c.reason === undefined) {
    v.agreed();
    return { ...part, verified: true };
  }
  call.metrics.spotDisagreements++;
  // its answer was refused: no credit for it
  call.owner(worker).failures++;
  const shape = { mode: part.mode, n, k: call.routing.k, embd: call.embd, ids: part.ids };
  v.disagreed({
    worker,
    layer: call.layer,
    experts,
    cosine: c.cosine,
    reason: `${replica === undefined ? "the reference" : `replica ${replica}`} disagrees: ${c.reason}`,
    requestDigest: digest(call, experts),
    expected: { norm: norm(shape, ref.y) },
    got: { norm: norm(shape, part.y), cosine: clampCos(c.cosine) },
    decidedBy: replica ?? "the reference",
  });
  return { ...ref, verified: true };
}

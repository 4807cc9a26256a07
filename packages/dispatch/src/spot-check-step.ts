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
  const shape = { mode: part.mode, n, k: call.routing.k, embd: call.embd, ids: part.ids };
  const by = replica === undefined ? "the reference" : `replica ${replica}`;
  const requestDigest = digest(call, experts);
  const convict = (w: string, y: Float32Array | Float64Array, cmp: typeof c, twinOf?: string) => {
    // its answer was refused: no credit for it
    call.owner(w).failures++;
    v.disagreed({
      worker: w,
      layer: call.layer,
      experts,
      cosine: cmp.cosine,
      reason: `${by} disagrees${twinOf ? ` (the twin of ${twinOf}, which gave the same answer)` : ""}: ${cmp.reason}`,
      requestDigest,
      expected: { norm: norm(shape, ref.y) },
      got: { norm: norm(shape, y), cosine: clampCos(cmp.cosine) },
      decidedBy: replica ?? "the reference",
    });
  };
  convict(worker, part.y, c);
  // the owners that returned the same answer for the same request are convicted with it (each
  // compared on its own bits: a twin of another compute class is judged by its own answer)
  for (const twin of part.twins ?? []) {
    if (twin.worker === replica) continue;
    const ct =
      twin.y === part.y
        ? c
        : v.compare(part.mode, n, call.routing.k, call.embd, part.ids, part.tokens, twin.y, ref.y);
    if (ct.reason !== undefined) convict(twin.worker, twin.y, ct, worker);
  }
  return { ...ref, verified: true };
}

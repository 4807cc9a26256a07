import { createHash } from "node:crypto";
import { DispatchError } from "@moeswarm/core";
import { attempt } from "./attempt.js";
import { buildRequest } from "./build-request.js";
import type { CallState } from "./call-state.js";
import { type Answer, type Ask, describeExperts, type Interceptor, type Part } from "./part.js";
import type { Verification } from "./verification.js";

// The step of trust "verify" (verification.ts says what it proves and what it cannot): the part
// asked of two owners, compared; a mismatch decided by a third opinion; the liar quarantined.

/** The redundancy step around the attempt (and hedge) steps. */
export function withRedundancy(call: CallState, v: Verification): Interceptor {
  return (next) => (ask) => redundant(call, v, next, ask);
}

type Settled = { part: Part } | { error: unknown };

function settle(p: Promise<Part>): Promise<Settled> {
  return p.then(
    (part) => ({ part }),
    (error: unknown) => ({ error }),
  );
}

/**
 * A second owner of all the ask's experts: the one grouping chose, else any not yet excluded. It
 * must belong to another principal than every owner already asked (`also` and the ask's worker):
 * two ids of one owner are one opinion (a colluder with two enrolments).
 */
function secondOwner(call: CallState, ask: Ask, also: readonly string[]): string | undefined {
  const excluded = call.exclude(ask.worker)!;
  for (const id of also) excluded.add(id);
  if (ask.avoid !== undefined) excluded.add(ask.avoid);
  for (const id of [ask.worker, ...also]) for (const w of call.placement.samePrincipal(id)) excluded.add(w);
  if (ask.second !== undefined && !excluded.has(ask.second)) return ask.second;
  return call.replicaOfAll(ask.worker, ask.experts, excluded);
}

async function redundant(call: CallState, v: Verification, next: Answer, ask: Ask): Promise<Part> {
  const { worker, experts } = ask;
  const second = secondOwner(call, ask, []);
  if (second === undefined) {
    // another owner exists, but of the same principal: say so in the stats
    if (call.replicaOfAll(worker, experts) !== undefined) v.count("samePrincipal");
    return unverifiable(call, v, ask);
  }
  const cancel = ask.cancel;
  const asked = (w: string) => settle(next({ worker: w, experts, ...(cancel ? { cancel } : {}) }));
  let [a, b] = await Promise.all([asked(worker), asked(second)]);
  let pair: [string, string] = [worker, second];
  // one side failed (timeout, error): one more owner in its place, else the error (failover goes on)
  if ("error" in a || "error" in b) {
    const good = "part" in a ? a : "part" in b ? b : undefined;
    const failed = "error" in a ? a : (b as { error: unknown });
    if (!good || call.signal.aborted) throw failed.error;
    const goodWorker = good === a ? worker : second;
    const other = secondOwner(call, { worker: goodWorker, experts }, [worker, second]);
    if (other === undefined) throw failed.error;
    const c = await asked(other);
    if ("error" in c) throw c.error;
    [a, b] = [good, c];
    pair = [goodWorker, other];
  }
  return decide(call, v, next, ask, pair, (a as { part: Part }).part, (b as { part: Part }).part);
}

/** Two answers in hand: agree, or ask a third opinion and convict the owner it disproves. */
async function decide(
  call: CallState,
  v: Verification,
  next: Answer,
  ask: Ask,
  [wa, wb]: [string, string],
  pa: Part,
  pb: Part,
): Promise<Part> {
  const shape = { ...pa, n: pa.tokens.length, k: call.routing.k, embd: call.embd };
  spend(call, v, pb);
  const exact = v.sameClass(wa, wb, call.placement);
  const c = v.compare(exact, shape, pa.y, pb.y);
  if (c.reason === undefined) {
    if (call.thirdOpinion && v.shouldAudit([wa, wb])) {
      const audited = await audit(call, v, ask, shape, [
        [wa, pa],
        [wb, pb],
      ]);
      if (audited) return audited;
    }
    v.count("partsVerified");
    call.metrics.verifiedParts++;
    // the twin that agreed answers for the same bits: a later check that disproves them convicts both
    return { ...pa, verified: true, twins: [{ worker: wb, y: pb.y }] };
  }
  v.count("disagreements");
  call.metrics.verifyDisagreements++;
  const third = await thirdOpinion(call, next, ask, [wa, wb]);
  if (third === undefined) {
    v.count("failed");
    throw new DispatchError(
      "MOESWARM_VERIFY_FAILED",
      `layer ${call.layer}: workers ${wa} and ${wb} disagree on experts ${describeExperts(ask.experts)} (${c.reason}) and there is no third opinion (no fallback, no third owner)`,
      { details: { layer: call.layer, workers: [wa, wb], experts: describeExperts(ask.experts) } },
    );
  }
  v.count("thirdOpinions");
  call.metrics.thirdOpinions++;
  spend(call, v, third.part);
  // a lie is an answer outside the tolerance of the third opinion; a difference in numerics alone
  // (an honest owner of another compute class, or an unknown one) never convicts
  const near = (p: Part) => v.compare(false, shape, p.y, third.part.y).reason === undefined;
  const same = (w: string, p: Part) =>
    third.exact(w) && v.compare(true, shape, p.y, third.part.y).reason === undefined;
  const nearA = near(pa);
  const nearB = near(pb);
  // both near: the one with the third's very bits, else the first owner's
  const pick =
    nearA && nearB ? (same(wb, pb) && !same(wa, pa) ? pb : pa) : nearA ? pa : nearB ? pb : undefined;
  const evidence = (liar: string, lie: Part, truth: Part) => {
    // its answer was refused: no credit for it
    call.owner(liar).failures++;
    const cmp = v.compare(false, shape, lie.y, truth.y);
    v.convict({
      worker: liar,
      layer: call.layer,
      experts: ask.experts,
      reason:
        `${liar} disagrees with ${liar === wa ? wb : wa} and ${third.by}: ${cmp.reason ?? c.reason}`.slice(
          0,
          500,
        ),
      requestDigest: digest(call, ask.experts),
      expected: { norm: norm(shape, truth.y) },
      got: { norm: norm(shape, lie.y), cosine: clampCos(cmp.cosine) },
      decidedBy: third.by,
      at: Math.floor(Date.now()),
    });
  };
  if (pick !== undefined || third.local) {
    // a local third is trusted: what it disproves is a lie even when it agrees with neither
    const truth = pick ?? third.part;
    if (!nearA) evidence(wa, pa, truth);
    if (!nearB) evidence(wb, pb, truth);
    v.count("partsVerified");
    call.metrics.verifiedParts++;
    return pick ? { ...pick, verified: true } : { ...third.part, worker: undefined, verified: true };
  }
  v.count("failed");
  throw new DispatchError(
    "MOESWARM_VERIFY_FAILED",
    `layer ${call.layer}: workers ${wa}, ${wb} and ${third.by} answer experts ${describeExperts(ask.experts)} three ways (${c.reason})`,
    { details: { layer: call.layer, workers: [wa, wb, third.by], experts: describeExperts(ask.experts) } },
  );
}

type Shape = {
  mode: "each" | "sum";
  n: number;
  k: number;
  embd: number;
  ids: Int32Array;
  tokens: Int32Array;
};

/**
 * Probation or a sampled audit: the agreed answers compared with the local third opinion before
 * the combine. Every owner it disproves is convicted (colluding twins together); the answer used
 * is an owner's that it confirms, else its own. Undefined when the local compute failed (the
 * agreement stands, as without an audit).
 */
async function audit(
  call: CallState,
  v: Verification,
  ask: Ask,
  shape: Shape,
  answers: ReadonlyArray<readonly [string, Part]>,
): Promise<Part | undefined> {
  const t0 = performance.now();
  let ref: Part;
  try {
    ref = await attempt(call, "audit")({ worker: ask.worker, experts: ask.experts });
  } catch (error) {
    if (call.signal.aborted) throw error;
    return undefined;
  }
  let good: Part | undefined;
  let disproved = 0;
  for (const [w, p] of answers) {
    const cmp = v.compare(false, shape, p.y, ref.y);
    if (cmp.reason === undefined) {
      v.passed(w);
      good ??= p;
      continue;
    }
    disproved++;
    call.owner(w).failures++;
    v.convict({
      worker: w,
      layer: call.layer,
      experts: ask.experts,
      reason: `${w}'s answer disagrees with the reference (audit; its twin ${answers
        .filter(([x]) => x !== w)
        .map(([x]) => x)
        .join(", ")} agreed with it): ${cmp.reason}`.slice(0, 500),
      requestDigest: digest(call, ask.experts),
      expected: { norm: norm(shape, ref.y) },
      got: { norm: norm(shape, p.y), cosine: clampCos(cmp.cosine) },
      decidedBy: "the reference",
      at: Math.floor(Date.now()),
    });
  }
  v.audited(performance.now() - t0, disproved);
  v.count("partsVerified");
  call.metrics.verifiedParts++;
  return good ? { ...good, verified: true } : { ...ref, worker: undefined, verified: true };
}

interface Third {
  readonly part: Part;
  readonly by: string;
  readonly local: boolean;
  /** Whether the third must match owner `w` bit for bit. */
  readonly exact: (w: string) => boolean;
}

/** The local reference or fallback, else a third owner of all the experts; undefined when none answers. */
async function thirdOpinion(
  call: CallState,
  next: Answer,
  ask: Ask,
  pair: [string, string],
): Promise<Third | undefined> {
  const v = call.verification!;
  if (call.thirdOpinion) {
    try {
      const part = await attempt(call, "third")({ worker: ask.worker, experts: ask.experts });
      // the local compute's numerics are not a worker's: bits are compared only when they match
      return { part, by: "the reference", local: true, exact: () => false };
    } catch (error) {
      if (call.signal.aborted) throw error;
    }
  }
  const w = secondOwner(call, { worker: pair[0], experts: ask.experts }, pair);
  if (w === undefined) return undefined;
  try {
    const part = await next({ worker: w, experts: ask.experts });
    return { part, by: `worker ${w}`, local: false, exact: (x) => v.sameClass(w, x) };
  } catch (error) {
    if (call.signal.aborted) throw error;
    return undefined;
  }
}

/** A part only one untrusted owner holds: the local fallback, else the typed error saying what to do. */
async function unverifiable(call: CallState, v: Verification, ask: Ask): Promise<Part> {
  if (call.thirdOpinion) {
    v.count("unverifiableLocal");
    return { ...(await attempt(call, "local")(ask)), verified: true };
  }
  v.count("failed");
  throw new DispatchError(
    "MOESWARM_VERIFY_UNAVAILABLE",
    `layer ${call.layer}: experts ${describeExperts(ask.experts)} have only one owner that is not quarantined (${ask.worker}), so its answers cannot be verified: run the hub with --replicas 2 (or add workers), give the dispatcher a local fallback, or pass trust "own" if every worker is your own device`,
    { details: { layer: call.layer, worker: ask.worker, experts: describeExperts(ask.experts) } },
  );
}

function spend(call: CallState, v: Verification, p: Part): void {
  const bytes = p.bytes ?? 0;
  v.spent(bytes, p.computeMs);
  call.metrics.verifyExtraBytes += bytes;
}

/** sha256 of the request payload (x, ids, w) the owners answered, rebuilt (transports may detach theirs). */
/** sha256 (hex) of the request a part answered (x, ids, w bytes): the evidence of a quarantine. */
export function digest(call: CallState, experts: readonly number[]): string {
  const { request } = buildRequest(call, new Set(experts));
  const h = createHash("sha256");
  for (const a of [request.x, request.ids, request.w]) {
    if (a) h.update(new Uint8Array(a.buffer, a.byteOffset, a.byteLength));
  }
  return h.digest("hex");
}

/** L2 norm over the values the combine reads. */
export function norm(
  shape: { mode: "each" | "sum"; n: number; k: number; embd: number; ids: Int32Array },
  y: Float32Array | Float64Array,
): number {
  const { mode, n, k, embd, ids } = shape;
  let s = 0;
  const rows = mode === "each" ? n * k : n;
  for (let r = 0; r < rows; r++) {
    if (mode === "each" && ids[r]! < 0) continue;
    for (let i = r * embd; i < (r + 1) * embd; i++) s += y[i]! * y[i]!;
  }
  return Math.sqrt(s);
}

export function clampCos(c: number): number {
  return Number.isFinite(c) ? Math.max(-1, Math.min(1, c)) : -1;
}

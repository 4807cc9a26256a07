import { InvalidArgumentError } from "./errors.js";

// Comparison helpers for checking computed tensors against a reference. Everything is computed
// in f64 whatever the input type, with each vector scaled by its largest magnitude first so that
// sums of squares cannot overflow even for f64 inputs near the top of the range.
//
// Non-finite inputs: if any element of either input is NaN or ±Infinity, every function returns
// NaN. A comparison like `expect(cosine(a, b)).toBeGreaterThan(0.999)` then fails, which is what a
// test wants when a kernel produced garbage; use an explicit check to locate the bad element.

type Vector = ArrayLike<number>;

function checkPair(a: Vector, b: Vector, what: string): void {
  if (a == null || b == null || typeof a.length !== "number" || typeof b.length !== "number") {
    throw new InvalidArgumentError("MOESWARM_NUMERIC", `${what}: both inputs must be array-like`);
  }
  if (a.length !== b.length) {
    throw new InvalidArgumentError(
      "MOESWARM_NUMERIC",
      `${what}: inputs have different lengths (${a.length} and ${b.length})`,
      { details: { a: a.length, b: b.length } },
    );
  }
}

/** Largest |x|, or NaN if any element is not finite. */
function maxAbs(v: Vector): number {
  let m = 0;
  for (let i = 0; i < v.length; i++) {
    const x = v[i]!;
    if (!Number.isFinite(x)) return Number.NaN;
    const ax = Math.abs(x);
    if (ax > m) m = ax;
  }
  return m;
}

/**
 * Cosine similarity in f64, clamped to [-1, 1]. Zero vectors: two zero vectors (or two empty
 * ones) are identical, so the result is 1; a zero vector against a non-zero one gives 0.
 */
export function cosine(a: Vector, b: Vector): number {
  checkPair(a, b, "cosine");
  const ma = maxAbs(a);
  const mb = maxAbs(b);
  if (Number.isNaN(ma) || Number.isNaN(mb)) return Number.NaN;
  if (ma === 0 && mb === 0) return 1;
  if (ma === 0 || mb === 0) return 0;
  let dot = 0;
  let na = 0;
  let nb = 0;
  for (let i = 0; i < a.length; i++) {
    const x = a[i]! / ma;
    const y = b[i]! / mb;
    dot += x * y;
    na += x * x;
    nb += y * y;
  }
  const c = dot / (Math.sqrt(na) * Math.sqrt(nb));
  return Math.min(1, Math.max(-1, c));
}

/** max_i |a_i - b_i| in f64 (0 for empty inputs). */
export function maxAbsDiff(a: Vector, b: Vector): number {
  checkPair(a, b, "maxAbsDiff");
  let m = 0;
  for (let i = 0; i < a.length; i++) {
    const x = a[i]!;
    const y = b[i]!;
    if (!Number.isFinite(x) || !Number.isFinite(y)) return Number.NaN;
    const d = Math.abs(x - y);
    if (d > m) m = d;
  }
  return m;
}

/**
 * Relative L2 error ||a - b|| / ||b|| in f64, with `b` the reference. A zero reference gives 0
 * when `a` is zero too (and for empty inputs), else Infinity.
 */
export function relL2(a: Vector, b: Vector): number {
  checkPair(a, b, "relL2");
  const ma = maxAbs(a);
  const mb = maxAbs(b);
  if (Number.isNaN(ma) || Number.isNaN(mb)) return Number.NaN;
  if (mb === 0) return ma === 0 ? 0 : Number.POSITIVE_INFINITY;
  // |a_i - b_i| <= ma + mb: scaling the difference by that bound (each term first, so that
  // nothing overflows) keeps every square <= 1; the reference gets its own scale
  const s = ma + mb;
  let num = 0;
  let den = 0;
  for (let i = 0; i < a.length; i++) {
    const d = a[i]! / s - b[i]! / s;
    const y = b[i]! / mb;
    num += d * d;
    den += y * y;
  }
  return (Math.sqrt(num) / Math.sqrt(den)) * (s / mb);
}

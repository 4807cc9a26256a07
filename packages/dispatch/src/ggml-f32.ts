// f32 arithmetic as ggml-cpu performs it, one function per ggml op that routing uses. Each value
// is rounded to f32 (`Math.fround`) exactly where ggml stores or computes a `float`; where ggml
// accumulates in `ggml_float` (double) we accumulate in a JS number, which is a double.
//
// Residual differences against ggml-cpu (documented in README.md, "Numerics"):
// - `expf`/`logf`: JS `Math.exp`/`Math.log` in f64 then rounded to f32 give the correctly rounded
//   f32 result except in rare double-rounding cases; glibc's expf/logf are within 1 ulp too, so an
//   element may differ by 1 ulp.
// - softmax on x86 with AVX2/AVX512 uses ggml's polynomial `ggml_v_expf` for full 8/16-lane chunks
//   and adds each chunk's f32 horizontal sum to the double accumulator; we follow the scalar tail
//   path (`expf`, element by element into the double). Both can move a probability by ~1 ulp.

const fround = Math.fround;

/**
 * ggml_compute_forward_soft_max_f32 for one row without mask/scale (ggml-cpu/ops.cpp:5584):
 * max in f32, `expf(x - max)` per element, sum in double, then every element times
 * `(float)(1.0 / sum)`.
 */
export function softmaxRowF32(
  src: ArrayLike<number>,
  srcOffset: number,
  n: number,
  dst: Float32Array,
  dstOffset: number,
): void {
  let max = Number.NEGATIVE_INFINITY;
  for (let i = 0; i < n; i++) {
    const v = src[srcOffset + i]!;
    if (v > max) max = v;
  }
  let sum = 0;
  for (let i = 0; i < n; i++) {
    const e = fround(Math.exp(fround(src[srcOffset + i]! - max)));
    dst[dstOffset + i] = e;
    sum += e;
  }
  const inv = fround(1 / sum);
  for (let i = 0; i < n; i++) dst[dstOffset + i] = fround(dst[dstOffset + i]! * inv);
}

/** op_sigmoid (ggml-cpu/unary-ops.cpp:31): `1.f / (1.f + expf(-x))`. */
export function sigmoidF32(x: number): number {
  return fround(1 / fround(1 + fround(Math.exp(-x))));
}

/** op_softplus (unary-ops.cpp:80): `x > 20 ? x : logf(1 + expf(x))`. */
export function softplusF32(x: number): number {
  return x > 20 ? x : fround(Math.log(fround(1 + fround(Math.exp(x)))));
}

/** sqrtf is correctly rounded, and so is the f64 sqrt of an f32 rounded back to f32. */
export function sqrtF32(x: number): number {
  return fround(Math.sqrt(x));
}

/** ggml_vec_sum_f32 (ggml-cpu/vec.h:1495): double accumulator, rounded to float at the end. */
export function sumF32(src: ArrayLike<number>, offset: number, n: number): number {
  let s = 0;
  for (let i = 0; i < n; i++) s += src[offset + i]!;
  return fround(s);
}

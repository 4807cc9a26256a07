// Scalar helpers that reproduce what ggml's C code does in `float` on x86-64/aarch64 (SSE/NEON
// scalar semantics, no fused multiply-add, FLT_EVAL_METHOD 0). A JS number operation on two f32
// values followed by Math.fround is the correctly rounded f32 result (double rounding is
// innocuous for + - * / and sqrt when 53 >= 2*24 + 2), so every C float expression is mirrored
// as a chain of `fround`s in the same evaluation order.

export const fround = Math.fround;

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
const i32 = new Int32Array(f32.buffer);

/** Bits of a value rounded to f32. */
export function f32Bits(value: number): number {
  f32[0] = value;
  return u32[0]!;
}

/** The f32 whose bits are given. */
export function f32FromBits(bits: number): number {
  u32[0] = bits >>> 0;
  return f32[0]!;
}

/**
 * ggml's `nearest_int` (ggml-quants.c): adds 1.5 * 2^23 in f32 and reads the low mantissa bits,
 * i.e. round-half-to-even for |x| < 2^22. Out of that range (where ggml only asserts in debug
 * builds) the same bit trick is replayed, so the garbage matches too.
 */
export function nearestInt(x: number): number {
  const val = fround(x + 12582912);
  if (val >= 8388608 && val < 16777216) return val - 12582912;
  f32[0] = val;
  return (i32[0]! & 0x007fffff) - 0x00400000;
}

/**
 * C's float -> int32 conversion as x86 `cvttss2si` does it: truncation toward zero, and the
 * "integer indefinite" 0x80000000 for NaN or out-of-range values (undefined behaviour in C; this is
 * what the compiled code yields).
 */
export function truncToInt32(x: number): number {
  if (!(x > -2147483649 && x < 2147483648)) return -2147483648;
  return Math.trunc(x) | 0;
}

/** `(int8_t)(float)x`: converted through int32, then wrapped to 8 bits as the compiled code does. */
export function truncToInt8(x: number): number {
  return (truncToInt32(x) << 24) >> 24;
}

/** `(uint8_t)(float)x`. */
export function truncToUint8(x: number): number {
  return truncToInt32(x) & 0xff;
}

/** ggml's `MAX(a, b)` macro: `a > b ? a : b`, which (unlike Math.max) yields b when a is NaN. */
export function cMax(a: number, b: number): number {
  // biome-ignore lint/complexity/useMathMinMax: the macro's NaN behaviour is the point
  return a > b ? a : b;
}

/** C `roundf`: half away from zero (exact for f32 inputs, whose |x| + 0.5 fits a double). */
export function roundf(x: number): number {
  return x < 0 ? -Math.floor(-x + 0.5) : Math.floor(x + 0.5);
}

/**
 * `(int)lroundf(x)`: glibc converts an out-of-range or NaN argument with a 64-bit cvttss2si
 * (LONG_MIN), whose low 32 bits are 0.
 */
export function lroundfToInt32(x: number): number {
  if (!(Math.abs(x) < 2 ** 63)) return 0;
  return roundf(x) | 0;
}

/** glibc `log2f` for positive finite input (correctly rounded in practice: f64 log2 then f32). */
export function log2f(x: number): number {
  return fround(Math.log2(x));
}

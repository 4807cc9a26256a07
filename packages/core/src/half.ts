// IEEE half (f16) and bfloat16 conversions, bit-compatible with ggml's
// ggml_compute_fp32_to_fp16 / ggml_compute_fp32_to_bf16 (ggml/src/ggml-impl.h): round to nearest
// even, subnormals kept, overflow to infinity, NaN to a quiet NaN (f16: canonical 0x7e00 with
// the sign, as ggml; bf16: the top half with the quiet bit forced, as ggml).

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** f32 (a JS number, first rounded to f32) to f16 bits. */
export function f32ToF16Bits(value: number): number {
  f32[0] = value;
  const bits = u32[0]!;
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | (mant !== 0 ? 0x7e00 : 0x7c00);
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rem = mant & ((1 << shift) - 1);
    const halfway = 1 << (shift - 1);
    if (rem > halfway || (rem === halfway && (half & 1) === 1)) half++;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rem = mant & 0x1fff;
  // a carry out of the mantissa correctly bumps the exponent (and reaches infinity at the top)
  if (rem > 0x1000 || (rem === 0x1000 && (half & 1) === 1)) half++;
  return sign | half;
}

let f16Table: Float32Array | undefined;

function buildF16Table(): Float32Array {
  const t = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const sign = h & 0x8000 ? -1 : 1;
    const e = (h >>> 10) & 0x1f;
    const m = h & 0x3ff;
    if (e === 0) t[h] = sign * m * 2 ** -24;
    else if (e === 31) t[h] = m !== 0 ? Number.NaN : sign * Number.POSITIVE_INFINITY;
    else t[h] = sign * (1 + m / 1024) * 2 ** (e - 15);
  }
  return t;
}

/** f16 bits to the number they encode (exact). */
export function f16BitsToF32(bits: number): number {
  f16Table ??= buildF16Table();
  return f16Table[bits & 0xffff]!;
}

/** f32 to bf16 bits, as ggml rounds. */
export function f32ToBf16Bits(value: number): number {
  f32[0] = value;
  const bits = u32[0]!;
  if ((bits & 0x7fffffff) > 0x7f800000) return ((bits >>> 16) | 64) & 0xffff;
  return ((bits + (0x7fff + ((bits >>> 16) & 1))) >>> 16) & 0xffff;
}

/** bf16 bits to the number they encode (exact). */
export function bf16BitsToF32(bits: number): number {
  u32[0] = (bits & 0xffff) << 16;
  return f32[0]!;
}

/** Encodes a whole array into f16 bits. */
export function encodeF16(values: ArrayLike<number>, out = new Uint16Array(values.length)): Uint16Array {
  for (let i = 0; i < values.length; i++) out[i] = f32ToF16Bits(values[i]!);
  return out;
}

export function decodeF16(bits: ArrayLike<number>, out = new Float32Array(bits.length)): Float32Array {
  f16Table ??= buildF16Table();
  const t = f16Table;
  for (let i = 0; i < bits.length; i++) out[i] = t[bits[i]! & 0xffff]!;
  return out;
}

export function encodeBf16(values: ArrayLike<number>, out = new Uint16Array(values.length)): Uint16Array {
  for (let i = 0; i < values.length; i++) out[i] = f32ToBf16Bits(values[i]!);
  return out;
}

export function decodeBf16(bits: ArrayLike<number>, out = new Float32Array(bits.length)): Float32Array {
  const o32 = new Uint32Array(out.buffer, out.byteOffset, out.length);
  for (let i = 0; i < bits.length; i++) o32[i] = (bits[i]! & 0xffff) << 16;
  return out;
}

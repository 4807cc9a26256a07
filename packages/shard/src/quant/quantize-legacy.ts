// Float copies (F32/F16/BF16) and the legacy block formats: q4_0, q4_1, q5_0, q5_1, q8_0 and the
// 1-/2-bit q1_0, q2_0 (`quantize_row_*_ref` in ggml-quants.c).
import { f32ToF16Bits } from "@moeswarm/core";
import { cMax, fround as f, roundf, truncToInt8, truncToInt32, truncToUint8 } from "./float32.js";
import { f32BitsToBf16Bits } from "./half-bits.js";
import { type BlockQuantizer, FLT_MAX, putF16, putU32 } from "./quantize-common.js";

export const f32: BlockQuantizer = (x, xo, n, dst, o) => {
  const bits = new Uint32Array(x.buffer, x.byteOffset, x.length);
  for (let i = 0; i < n; i++, o += 4) putU32(dst, o, bits[xo + i]!);
};

export const f16: BlockQuantizer = (x, xo, n, dst, o) => {
  const bits = new Uint32Array(x.buffer, x.byteOffset, x.length);
  for (let i = 0; i < n; i++, o += 2) {
    const b = bits[xo + i]!;
    // ggml_compute_fp32_to_fp16 turns every NaN into 0x7e00 with the sign: decide on the bits
    const h = (b & 0x7fffffff) >>> 0 > 0x7f800000 ? ((b >>> 16) & 0x8000) | 0x7e00 : f32ToF16Bits(x[xo + i]!);
    dst[o] = h & 0xff;
    dst[o + 1] = h >>> 8;
  }
};

export const bf16: BlockQuantizer = (x, xo, n, dst, o) => {
  const bits = new Uint32Array(x.buffer, x.byteOffset, x.length);
  for (let i = 0; i < n; i++, o += 2) {
    const h = f32BitsToBf16Bits(bits[xo + i]!);
    dst[o] = h & 0xff;
    dst[o + 1] = h >>> 8;
  }
};

/** Value of largest magnitude (the first one on ties), as q4_0/q5_0 pick it. */
function signedAbsMax(x: Float32Array, xo: number, n: number): number {
  let amax = 0;
  let max = 0;
  for (let j = 0; j < n; j++) {
    const v = x[xo + j]!;
    if (amax < Math.abs(v)) {
      amax = Math.abs(v);
      max = v;
    }
  }
  return max;
}

export const q4_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 32, o += 18) {
    const d = f(signedAbsMax(x, xo, 32) / -8);
    const id = d !== 0 ? f(1 / d) : 0;
    putF16(dst, o, d);
    for (let j = 0; j < 16; j++) {
      const x0 = f(x[xo + j]! * id);
      const x1 = f(x[xo + 16 + j]! * id);
      const xi0 = Math.min(15, truncToInt8(f(x0 + 8.5))) & 0xff;
      const xi1 = Math.min(15, truncToInt8(f(x1 + 8.5))) & 0xff;
      dst[o + 2 + j] = xi0 | (xi1 << 4);
    }
  }
};

function minMax(x: Float32Array, xo: number, n: number): [number, number] {
  let min = FLT_MAX;
  let max = -FLT_MAX;
  for (let j = 0; j < n; j++) {
    const v = x[xo + j]!;
    if (v < min) min = v;
    if (v > max) max = v;
  }
  return [min, max];
}

export const q4_1: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 32, o += 20) {
    const [min, max] = minMax(x, xo, 32);
    const d = f(f(max - min) / 15);
    const id = d !== 0 ? f(1 / d) : 0;
    putF16(dst, o, d);
    putF16(dst, o + 2, min);
    for (let j = 0; j < 16; j++) {
      const x0 = f(f(x[xo + j]! - min) * id);
      const x1 = f(f(x[xo + 16 + j]! - min) * id);
      const xi0 = Math.min(15, truncToInt8(f(x0 + 0.5))) & 0xff;
      const xi1 = Math.min(15, truncToInt8(f(x1 + 0.5))) & 0xff;
      dst[o + 4 + j] = xi0 | (xi1 << 4);
    }
  }
};

export const q5_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 32, o += 22) {
    const d = f(signedAbsMax(x, xo, 32) / -16);
    const id = d !== 0 ? f(1 / d) : 0;
    putF16(dst, o, d);
    let qh = 0;
    for (let j = 0; j < 16; j++) {
      const x0 = f(x[xo + j]! * id);
      const x1 = f(x[xo + 16 + j]! * id);
      const xi0 = Math.min(31, truncToInt8(f(x0 + 16.5))) & 0xff;
      const xi1 = Math.min(31, truncToInt8(f(x1 + 16.5))) & 0xff;
      dst[o + 6 + j] = (xi0 & 0x0f) | ((xi1 & 0x0f) << 4);
      qh |= ((xi0 & 0x10) >>> 4) << j;
      qh |= ((xi1 & 0x10) >>> 4) << (j + 16);
    }
    putU32(dst, o + 2, qh >>> 0);
  }
};

export const q5_1: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 32, o += 24) {
    const [min, max] = minMax(x, xo, 32);
    const d = f(f(max - min) / 31);
    const id = d !== 0 ? f(1 / d) : 0;
    putF16(dst, o, d);
    putF16(dst, o + 2, min);
    let qh = 0;
    for (let j = 0; j < 16; j++) {
      const x0 = f(f(x[xo + j]! - min) * id);
      const x1 = f(f(x[xo + 16 + j]! - min) * id);
      const xi0 = truncToUint8(f(x0 + 0.5));
      const xi1 = truncToUint8(f(x1 + 0.5));
      dst[o + 8 + j] = (xi0 & 0x0f) | ((xi1 & 0x0f) << 4);
      qh |= ((xi0 & 0x10) >>> 4) << j;
      qh |= ((xi1 & 0x10) >>> 4) << (j + 16);
    }
    putU32(dst, o + 4, qh >>> 0);
  }
};

export const q8_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 32, o += 34) {
    let amax = 0;
    for (let j = 0; j < 32; j++) {
      const a = Math.abs(x[xo + j]!);
      amax = cMax(amax, a);
    }
    const d = f(amax / 127);
    const id = d !== 0 ? f(1 / d) : 0;
    putF16(dst, o, d);
    for (let j = 0; j < 32; j++) dst[o + 2 + j] = truncToInt8(roundf(f(x[xo + j]! * id))) & 0xff;
  }
};

export const q1_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 128, o += 18) {
    let sumAbs = 0;
    for (let j = 0; j < 128; j++) sumAbs = f(sumAbs + Math.abs(x[xo + j]!));
    putF16(dst, o, f(sumAbs / 128));
    for (let j = 0; j < 128; j++) if (x[xo + j]! >= 0) dst[o + 2 + (j >>> 3)]! |= 1 << (j & 7);
  }
};

export const q2_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 64, o += 18) {
    let amax = 0;
    for (let j = 0; j < 64; j++) {
      const a = Math.abs(x[xo + j]!);
      if (a > amax) amax = a;
    }
    const d = amax;
    const id = d > 0 ? f(1 / d) : 0;
    putF16(dst, o, d);
    for (let j = 0; j < 64; j++) {
      let q = truncToInt32(roundf(f(x[xo + j]! * id))) + 1;
      if (q < 0) q = 0;
      if (q > 3) q = 3;
      dst[o + 2 + (j >>> 2)]! |= q << ((j & 3) * 2);
    }
  }
};

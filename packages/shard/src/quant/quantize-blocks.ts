// Reference quantisers, one per ggml type, each a transcription of what `ggml_quantize_chunk`
// runs without an importance matrix at the pinned llama.cpp release (`quantize_row_*_ref` in
// ggml/src/ggml-quants.c; `quantize_iq4_nl`/`quantize_iq4_xs` with ntry 7; the row converters of
// ggml.c for F16/BF16), so the bytes are identical to ggml's. Every float expression is replayed in
// f32 in C's evaluation order; C's float -> integer conversions are replayed as x86 does them, and
// C's truth tests on floats are written as comparisons with 0 (a NaN is true in C, false in JS).

import { f32ToF16Bits } from "@moeswarm/core";
import { GgmlType } from "../ggml-type.js";
import { e8m0ToF32Half, KVALUES_IQ4NL, KVALUES_MXFP4, scaleMinK4, ue4m3ToF32 } from "./dequantize-blocks.js";
import {
  cMax,
  fround as f,
  f32Bits,
  log2f,
  lroundfToInt32,
  nearestInt,
  roundf,
  truncToInt8,
  truncToInt32,
  truncToUint8,
} from "./float32.js";
import { f16ToF32Table, f32BitsToBf16Bits } from "./half-bits.js";
import {
  bestIndexInt8,
  GROUP_MAX_EPS,
  makeQ3Quants,
  makeQkx2Quants,
  makeQxQuants,
} from "./k-quant-search.js";

/** Encodes `nBlocks` blocks from `x[xOff...]` into `dst[dOff...]` (`dst` starts zeroed). */
export type BlockQuantizer = (
  x: Float32Array,
  xOff: number,
  nBlocks: number,
  dst: Uint8Array,
  dOff: number,
) => void;

const QK_K = 256;
const FLT_MAX = f(3.4028234663852886e38);

function putF16(dst: Uint8Array, off: number, value: number): void {
  const h = f32ToF16Bits(value);
  dst[off] = h & 0xff;
  dst[off + 1] = h >>> 8;
}

function putU32(dst: Uint8Array, off: number, v: number): void {
  dst[off] = v & 0xff;
  dst[off + 1] = (v >>> 8) & 0xff;
  dst[off + 2] = (v >>> 16) & 0xff;
  dst[off + 3] = (v >>> 24) & 0xff;
}

const f32: BlockQuantizer = (x, xo, n, dst, o) => {
  const bits = new Uint32Array(x.buffer, x.byteOffset, x.length);
  for (let i = 0; i < n; i++, o += 4) putU32(dst, o, bits[xo + i]!);
};

const f16: BlockQuantizer = (x, xo, n, dst, o) => {
  const bits = new Uint32Array(x.buffer, x.byteOffset, x.length);
  for (let i = 0; i < n; i++, o += 2) {
    const b = bits[xo + i]!;
    // ggml_compute_fp32_to_fp16 turns every NaN into 0x7e00 with the sign: decide on the bits
    const h = (b & 0x7fffffff) >>> 0 > 0x7f800000 ? ((b >>> 16) & 0x8000) | 0x7e00 : f32ToF16Bits(x[xo + i]!);
    dst[o] = h & 0xff;
    dst[o + 1] = h >>> 8;
  }
};

const bf16: BlockQuantizer = (x, xo, n, dst, o) => {
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

const q4_0: BlockQuantizer = (x, xo, n, dst, o) => {
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

const q4_1: BlockQuantizer = (x, xo, n, dst, o) => {
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

const q5_0: BlockQuantizer = (x, xo, n, dst, o) => {
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

const q5_1: BlockQuantizer = (x, xo, n, dst, o) => {
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

const q8_0: BlockQuantizer = (x, xo, n, dst, o) => {
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

function bestIndexMxfp4(x: number, e: number): number {
  let bestIndex = 0;
  let bestErr = Math.abs(f(f(KVALUES_MXFP4[0]! * e) - x));
  for (let i = 1; i < 16; i++) {
    const err = Math.abs(f(f(KVALUES_MXFP4[i]! * e) - x));
    if (err < bestErr) {
      bestIndex = i;
      bestErr = err;
    }
  }
  return bestIndex;
}

const mxfp4: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 32, o += 17) {
    let amax = 0;
    for (let j = 0; j < 32; j++) if (amax < Math.abs(x[xo + j]!)) amax = Math.abs(x[xo + j]!);
    // (uint8_t)(floorf(log2f(amax)) - 2 + 127), each step in float
    const e = amax > 0 ? truncToUint8(f(f(Math.floor(log2f(amax)) - 2) + 127)) : 0;
    const d = e8m0ToF32Half(e);
    dst[o] = e;
    for (let j = 0; j < 16; j++) {
      dst[o + 1 + j] = bestIndexMxfp4(x[xo + j]!, d) | (bestIndexMxfp4(x[xo + 16 + j]!, d) << 4);
    }
  }
};

/** ggml_fp32_to_ue4m3 (ggml-impl.h). */
function f32ToUe4m3(value: number): number {
  if (!(value > 0)) return 0;
  let x = value;
  if (x > 448) x = 448;
  const bits = f32Bits(x);
  const fp32Exp = ((bits >>> 23) & 0xff) - 127;
  const fp32Man = (bits >>> 20) & 0x7;
  let ue4m3Exp = fp32Exp + 7;
  if (ue4m3Exp <= 0) {
    let man = truncToInt32(f(f(x * 512) + 0.5));
    if (man > 7) man = 7;
    if (man < 1) return 0;
    return man;
  }
  if (ue4m3Exp >= 15) return 0x7e;
  const roundBit = (bits >>> 19) & 1;
  let ue4m3Man = fp32Man + roundBit;
  if (ue4m3Man > 7) {
    ue4m3Man = 0;
    ue4m3Exp++;
    if (ue4m3Exp >= 15) return 0x7e;
  }
  return (ue4m3Exp << 3) | ue4m3Man;
}

const nvfp4: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, o += 36) {
    for (let s = 0; s < 4; s++, xo += 16) {
      let amax = 0;
      for (let j = 0; j < 16; j++) if (amax < Math.abs(x[xo + j]!)) amax = Math.abs(x[xo + j]!);
      const ue = f32ToUe4m3(f(amax / 6));
      dst[o + s] = ue;
      const d = ue4m3ToF32(ue);
      for (let j = 0; j < 8; j++) {
        dst[o + 4 + s * 8 + j] = bestIndexMxfp4(x[xo + j]!, d) | (bestIndexMxfp4(x[xo + 8 + j]!, d) << 4);
      }
    }
  }
};

const q1_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += 128, o += 18) {
    let sumAbs = 0;
    for (let j = 0; j < 128; j++) sumAbs = f(sumAbs + Math.abs(x[xo + j]!));
    putF16(dst, o, f(sumAbs / 128));
    for (let j = 0; j < 128; j++) if (x[xo + j]! >= 0) dst[o + 2 + (j >>> 3)]! |= 1 << (j & 7);
  }
};

const q2_0: BlockQuantizer = (x, xo, n, dst, o) => {
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

/** Packs 2-bit levels L[0..255] as q2_K/q3_K do: byte j/4+l holds L[j+l], L[j+l+32], ... */
function pack2Bit(L: ArrayLike<number>, dst: Uint8Array, o: number): void {
  for (let j = 0; j < QK_K; j += 128) {
    for (let l = 0; l < 32; l++) {
      dst[o + j / 4 + l] = L[j + l]! | (L[j + l + 32]! << 2) | (L[j + l + 64]! << 4) | (L[j + l + 96]! << 6);
    }
  }
}

const q2_K: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Uint8Array(QK_K);
  const Laux = new Uint8Array(16);
  const weights = new Float32Array(16);
  const mins = new Float32Array(16);
  const scales = new Float32Array(16);
  const q4scale = 15;
  for (let i = 0; i < n; i++, xo += QK_K, o += 84) {
    let maxScale = 0;
    let maxMin = 0;
    for (let j = 0; j < 16; j++) {
      for (let l = 0; l < 16; l++) weights[l] = Math.abs(x[xo + 16 * j + l]!);
      const [scale, min] = makeQkx2Quants(
        16,
        3,
        x,
        xo + 16 * j,
        weights,
        L,
        16 * j,
        Laux,
        -0.5,
        f(0.1),
        15,
        true,
      );
      scales[j] = scale;
      mins[j] = min;
      if (scale > maxScale) maxScale = scale;
      if (min > maxMin) maxMin = min;
    }
    // block_q2_K: scales[16] at 0, qs[64] at 16, d at 80, dmin at 82
    if (maxScale > 0) {
      const iscale = f(q4scale / maxScale);
      for (let j = 0; j < 16; j++) dst[o + j] = nearestInt(f(iscale * scales[j]!)) & 0xff;
      putF16(dst, o + 80, f(maxScale / q4scale));
    } else {
      for (let j = 0; j < 16; j++) dst[o + j] = 0;
      putF16(dst, o + 80, 0);
    }
    if (maxMin > 0) {
      const iscale = f(q4scale / maxMin);
      for (let j = 0; j < 16; j++)
        dst[o + j] = (dst[o + j]! | (nearestInt(f(iscale * mins[j]!)) << 4)) & 0xff;
      putF16(dst, o + 82, f(maxMin / q4scale));
    } else {
      putF16(dst, o + 82, 0);
    }
    const dAll = f16ToF32Table()[dst[o + 80]! | (dst[o + 81]! << 8)]!;
    const mAll = f16ToF32Table()[dst[o + 82]! | (dst[o + 83]! << 8)]!;
    for (let j = 0; j < 16; j++) {
      const d = f(dAll * (dst[o + j]! & 0xf));
      if (d === 0) continue;
      const dm = f(mAll * (dst[o + j]! >>> 4));
      for (let ii = 0; ii < 16; ii++) {
        const l = nearestInt(f(f(x[xo + 16 * j + ii]! + dm) / d));
        L[16 * j + ii] = Math.max(0, Math.min(3, l));
      }
    }
    pack2Bit(L, dst, o + 16);
  }
};

const q3_K: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Int8Array(QK_K);
  const scales = new Float32Array(16);
  for (let i = 0; i < n; i++, xo += QK_K, o += 110) {
    // block_q3_K: hmask[32] at 0, qs[64] at 32, scales[12] at 96, d at 108
    let maxScale = 0;
    let amax = 0;
    for (let j = 0; j < 16; j++) {
      scales[j] = makeQ3Quants(16, 4, x, xo + 16 * j, L, 16 * j, true);
      const scale = Math.abs(scales[j]!);
      if (scale > amax) {
        amax = scale;
        maxScale = scales[j]!;
      }
    }
    const s = o + 96;
    for (let j = 0; j < 12; j++) dst[s + j] = 0;
    if (maxScale !== 0) {
      const iscale = f(-32 / maxScale);
      for (let j = 0; j < 16; j++) {
        let l = (nearestInt(f(iscale * scales[j]!)) << 24) >> 24;
        l = Math.max(-32, Math.min(31, l)) + 32;
        if (j < 8) dst[s + j] = l & 0xf;
        else dst[s + j - 8] = dst[s + j - 8]! | ((l & 0xf) << 4);
        l >>= 4;
        dst[s + (j % 4) + 8] = dst[s + (j % 4) + 8]! | (l << (2 * (j >> 2)));
      }
      putF16(dst, o + 108, f(1 / iscale));
    } else {
      putF16(dst, o + 108, 0);
    }
    const dAll = f16ToF32Table()[dst[o + 108]! | (dst[o + 109]! << 8)]!;
    for (let j = 0; j < 16; j++) {
      let sc = j < 8 ? dst[s + j]! & 0xf : dst[s + j - 8]! >>> 4;
      sc = (sc | (((dst[s + 8 + (j % 4)]! >>> (2 * (j >> 2))) & 3) << 4)) - 32;
      const d = f(dAll * sc);
      if (d === 0) continue;
      for (let ii = 0; ii < 16; ii++) {
        const l = nearestInt(f(x[xo + 16 * j + ii]! / d));
        L[16 * j + ii] = Math.max(-4, Math.min(3, l)) + 4;
      }
    }
    // high bit of the first 32 levels into bit 0 of hmask[0..31], the next 32 into bit 1, ...
    for (let j = 0; j < 32; j++) dst[o + j] = 0;
    let m = 0;
    let hm = 1;
    for (let j = 0; j < QK_K; j++) {
      if (L[j]! > 3) {
        dst[o + m] = dst[o + m]! | hm;
        L[j] = L[j]! - 4;
      }
      if (++m === 32) {
        m = 0;
        hm <<= 1;
      }
    }
    pack2Bit(L, dst, o + 32);
  }
};

/** The q4_K/q5_K first pass: per 32-value sub-block scale and min from make_qkx2_quants. */
function kSubblockScales(
  x: Float32Array,
  xo: number,
  nmax: number,
  rmin: number,
  rdelta: number,
  nstep: number,
  L: Uint8Array,
  Laux: Uint8Array,
  weights: Float32Array,
  scales: Float32Array,
  mins: Float32Array,
): [number, number] {
  let maxScale = 0;
  let maxMin = 0;
  for (let j = 0; j < 8; j++) {
    let sumX2 = 0;
    for (let l = 0; l < 32; l++) {
      const v = x[xo + 32 * j + l]!;
      sumX2 = f(sumX2 + f(v * v));
    }
    const avX = f(Math.sqrt(f(sumX2 / 32)));
    for (let l = 0; l < 32; l++) weights[l] = f(avX + Math.abs(x[xo + 32 * j + l]!));
    const [scale, min] = makeQkx2Quants(
      32,
      nmax,
      x,
      xo + 32 * j,
      weights,
      L,
      32 * j,
      Laux,
      rmin,
      rdelta,
      nstep,
      false,
    );
    scales[j] = scale;
    mins[j] = min;
    if (scale > maxScale) maxScale = scale;
    if (min > maxMin) maxMin = min;
  }
  return [maxScale, maxMin];
}

/** Packs the 6-bit scales and mins into the 12 bytes at `s` and writes d/dmin at `o`, `o + 2`. */
function packKScales(
  dst: Uint8Array,
  o: number,
  s: number,
  scales: Float32Array,
  mins: Float32Array,
  maxScale: number,
  maxMin: number,
): void {
  const invScale = maxScale > 0 ? f(63 / maxScale) : 0;
  const invMin = maxMin > 0 ? f(63 / maxMin) : 0;
  for (let j = 0; j < 8; j++) {
    const ls = Math.min(63, nearestInt(f(invScale * scales[j]!)) & 0xff);
    const lm = Math.min(63, nearestInt(f(invMin * mins[j]!)) & 0xff);
    if (j < 4) {
      dst[s + j] = ls;
      dst[s + j + 4] = lm;
    } else {
      dst[s + j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
      dst[s + j - 4] = dst[s + j - 4]! | ((ls >> 4) << 6);
      dst[s + j] = dst[s + j]! | ((lm >> 4) << 6);
    }
  }
  putF16(dst, o, f(maxScale / 63));
  putF16(dst, o + 2, f(maxMin / 63));
}

/** Requantises each sub-block against the stored (f16) scales, as the K reference quantisers do. */
function kRequantize(
  x: Float32Array,
  xo: number,
  dst: Uint8Array,
  o: number,
  nmax: number,
  L: Uint8Array,
): void {
  const dAll = f16ToF32Table()[dst[o]! | (dst[o + 1]! << 8)]!;
  const mAll = f16ToF32Table()[dst[o + 2]! | (dst[o + 3]! << 8)]!;
  for (let j = 0; j < 8; j++) {
    const [sc, m] = scaleMinK4(j, dst, o + 4);
    const d = f(dAll * sc);
    if (d === 0) continue;
    const dm = f(mAll * m);
    for (let ii = 0; ii < 32; ii++) {
      const l = nearestInt(f(f(x[xo + 32 * j + ii]! + dm) / d));
      L[32 * j + ii] = Math.max(0, Math.min(nmax, l));
    }
  }
}

const q4_K: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Uint8Array(QK_K);
  const Laux = new Uint8Array(32);
  const weights = new Float32Array(32);
  const mins = new Float32Array(8);
  const scales = new Float32Array(8);
  for (let i = 0; i < n; i++, xo += QK_K, o += 144) {
    // block_q4_K: d, dmin, scales[12] at 4, qs[128] at 16
    const [maxScale, maxMin] = kSubblockScales(x, xo, 15, -1, f(0.1), 20, L, Laux, weights, scales, mins);
    packKScales(dst, o, o + 4, scales, mins, maxScale, maxMin);
    kRequantize(x, xo, dst, o, 15, L);
    let q = o + 16;
    for (let j = 0; j < QK_K; j += 64) {
      for (let l = 0; l < 32; l++) dst[q + l] = L[j + l]! | (L[j + l + 32]! << 4);
      q += 32;
    }
  }
};

const q5_K: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Uint8Array(QK_K);
  const Laux = new Uint8Array(32);
  const weights = new Float32Array(32);
  const mins = new Float32Array(8);
  const scales = new Float32Array(8);
  for (let i = 0; i < n; i++, xo += QK_K, o += 176) {
    // block_q5_K: d, dmin, scales[12] at 4, qh[32] at 16, qs[128] at 48
    const [maxScale, maxMin] = kSubblockScales(x, xo, 31, -0.5, f(0.1), 15, L, Laux, weights, scales, mins);
    packKScales(dst, o, o + 4, scales, mins, maxScale, maxMin);
    kRequantize(x, xo, dst, o, 31, L);
    const qh = o + 16;
    let ql = o + 48;
    for (let j = 0; j < 32; j++) dst[qh + j] = 0;
    let m1 = 1;
    let m2 = 2;
    for (let nn = 0; nn < QK_K; nn += 64) {
      for (let j = 0; j < 32; j++) {
        let l1 = L[nn + j]!;
        if (l1 > 15) {
          l1 -= 16;
          dst[qh + j] = dst[qh + j]! | m1;
        }
        let l2 = L[nn + j + 32]!;
        if (l2 > 15) {
          l2 -= 16;
          dst[qh + j] = dst[qh + j]! | m2;
        }
        dst[ql + j] = l1 | (l2 << 4);
      }
      m1 <<= 2;
      m2 <<= 2;
      ql += 32;
    }
  }
};

const q6_K: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Int8Array(QK_K);
  const scales = new Float32Array(16);
  for (let i = 0; i < n; i++, xo += QK_K, o += 210) {
    // block_q6_K: ql[128] at 0, qh[64] at 128, scales[16] (int8) at 192, d at 208
    let maxScale = 0;
    let maxAbsScale = 0;
    for (let ib = 0; ib < 16; ib++) {
      const scale = makeQxQuants(16, 32, x, xo + 16 * ib, L, 16 * ib, 1);
      scales[ib] = scale;
      const absScale = Math.abs(scale);
      if (absScale > maxAbsScale) {
        maxAbsScale = absScale;
        maxScale = scale;
      }
    }
    if (maxAbsScale < GROUP_MAX_EPS) {
      dst.fill(0, o, o + 210);
      continue;
    }
    const iscale = f(-128 / maxScale);
    putF16(dst, o + 208, f(1 / iscale));
    for (let ib = 0; ib < 16; ib++)
      dst[o + 192 + ib] = Math.min(127, nearestInt(f(iscale * scales[ib]!))) & 0xff;
    const dAll = f16ToF32Table()[dst[o + 208]! | (dst[o + 209]! << 8)]!;
    for (let j = 0; j < 16; j++) {
      const d = f(dAll * ((dst[o + 192 + j]! << 24) >> 24));
      if (d === 0) continue;
      for (let ii = 0; ii < 16; ii++) {
        const l = nearestInt(f(x[xo + 16 * j + ii]! / d));
        L[16 * j + ii] = Math.max(-32, Math.min(31, l)) + 32;
      }
    }
    let ql = o;
    let qh = o + 128;
    for (let j = 0; j < QK_K; j += 128) {
      for (let l = 0; l < 32; l++) {
        const a = L[j + l]!;
        const b = L[j + l + 32]!;
        const c = L[j + l + 64]!;
        const e = L[j + l + 96]!;
        dst[ql + l] = (a & 0xf) | ((c & 0xf) << 4);
        dst[ql + l + 32] = (b & 0xf) | ((e & 0xf) << 4);
        dst[qh + l] = ((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)) & 0xff;
      }
      ql += 64;
      qh += 32;
    }
  }
};

const q8_K: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, xo += QK_K, o += 292) {
    // block_q8_K: float d, int8 qs[256] at 4, int16 bsums[16] at 260
    let max = 0;
    let amax = 0;
    for (let j = 0; j < QK_K; j++) {
      const ax = Math.abs(x[xo + j]!);
      if (ax > amax) {
        amax = ax;
        max = x[xo + j]!;
      }
    }
    if (amax === 0) {
      // ggml leaves bsums untouched here; the output buffer starts zeroed
      dst.fill(0, o, o + 260);
      continue;
    }
    const iscale = f(-127 / max);
    for (let j = 0; j < QK_K; j++) dst[o + 4 + j] = Math.min(127, nearestInt(f(iscale * x[xo + j]!))) & 0xff;
    for (let j = 0; j < 16; j++) {
      let sum = 0;
      for (let ii = 0; ii < 16; ii++) sum += (dst[o + 4 + j * 16 + ii]! << 24) >> 24;
      dst[o + 260 + 2 * j] = sum & 0xff;
      dst[o + 261 + 2 * j] = (sum >> 8) & 0xff;
    }
    putU32(dst, o, f32Bits(f(1 / iscale)));
  }
};

/**
 * quantize_row_iq4_nl_impl without importance weights: the 4-bit non-linear levels of
 * kvalues_iq4nl, one scale per 32 values searched over ntry = 7 candidates; IQ4_XS
 * (superBlock 256) then quantises the eight scales to 6 bits under an f16 super-scale.
 */
function iq4Impl(
  superBlock: number,
  x: Float32Array,
  xo: number,
  dst: Uint8Array,
  dOff: number,
  q4Off: number,
  scalesHOff: number,
  scalesLOff: number,
  scales: Float32Array,
  weight: Float32Array,
  L: Uint8Array,
): void {
  const values = KVALUES_IQ4NL;
  const ntry = 7;
  const blockSize = 32;
  // sigma2 only weighs importance-matrix entries, which this path has none of
  dst.fill(0, q4Off, q4Off + superBlock / 2);
  putF16(dst, dOff, 0);
  let maxScale = 0;
  let amaxScale = 0;
  const nb = superBlock / blockSize;
  for (let ib = 0; ib < nb; ib++) {
    const xb = xo + ib * blockSize;
    const lb = ib * blockSize;
    for (let j = 0; j < blockSize; j++) weight[j] = f(x[xb + j]! * x[xb + j]!);
    let amax = 0;
    let max = 0;
    for (let j = 0; j < blockSize; j++) {
      const ax = Math.abs(x[xb + j]!);
      if (ax > amax) {
        amax = ax;
        max = x[xb + j]!;
      }
    }
    if (amax < GROUP_MAX_EPS) {
      scales[ib] = 0;
      continue;
    }
    let d = f(-max / values[0]!);
    let id = f(1 / d);
    let sumqx = 0;
    let sumq2 = 0;
    for (let j = 0; j < blockSize; j++) {
      const xj = x[xb + j]!;
      const l = bestIndexInt8(16, values, f(id * xj));
      L[lb + j] = l;
      const q = values[l]!;
      const w = weight[j]!;
      sumqx = f(sumqx + f(f(w * q) * xj));
      sumq2 = f(sumq2 + f(f(w * q) * q));
    }
    d = sumq2 > 0 ? f(sumqx / sumq2) : 0;
    let best = f(d * sumqx);
    for (let itry = -ntry; itry <= ntry; itry++) {
      id = f((itry + values[0]!) / max);
      sumqx = 0;
      sumq2 = 0;
      for (let j = 0; j < blockSize; j++) {
        const xj = x[xb + j]!;
        const q = values[bestIndexInt8(16, values, f(id * xj))]!;
        const w = weight[j]!;
        sumqx = f(sumqx + f(f(w * q) * xj));
        sumq2 = f(sumq2 + f(f(w * q) * q));
      }
      if (sumq2 > 0 && f(sumqx * sumqx) > f(best * sumq2)) {
        d = f(sumqx / sumq2);
        best = f(d * sumqx);
      }
    }
    scales[ib] = d;
    const absD = Math.abs(d);
    if (absD > amaxScale) {
      amaxScale = absD;
      maxScale = d;
    }
  }
  if (nb > 1) {
    dst[scalesHOff] = 0;
    dst[scalesHOff + 1] = 0;
    let scalesH = 0;
    const d = f(-maxScale / 32);
    putF16(dst, dOff, d);
    const id = d !== 0 ? f(1 / d) : 0;
    for (let ib = 0; ib < nb; ib++) {
      let l = nearestInt(f(id * scales[ib]!));
      l = Math.max(-32, Math.min(31, l));
      const dl = f(d * l);
      const idl = dl !== 0 ? f(1 / dl) : 0;
      const xb = xo + ib * blockSize;
      for (let j = 0; j < blockSize; j++)
        L[ib * blockSize + j] = bestIndexInt8(16, values, f(idl * x[xb + j]!));
      l += 32;
      const lLow = l & 0xf;
      const lHigh = l >> 4;
      if (ib % 2 === 0) dst[scalesLOff + (ib >> 1)] = lLow;
      else dst[scalesLOff + (ib >> 1)] = dst[scalesLOff + (ib >> 1)]! | (lLow << 4);
      scalesH |= lHigh << (2 * (ib % 8));
    }
    dst[scalesHOff] = scalesH & 0xff;
    dst[scalesHOff + 1] = (scalesH >>> 8) & 0xff;
  } else {
    putF16(dst, dOff, scales[0]!);
    const id = scales[0] !== 0 ? f(1 / scales[0]!) : 0;
    for (let j = 0; j < superBlock; j++) L[j] = bestIndexInt8(16, values, f(id * x[xo + j]!));
  }
  for (let i = 0; i < superBlock / 32; i++) {
    for (let j = 0; j < 16; j++) dst[q4Off + 16 * i + j] = L[32 * i + j]! | (L[32 * i + 16 + j]! << 4);
  }
}

const iq4_nl: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Uint8Array(32);
  const weight = new Float32Array(32);
  const scales = new Float32Array(1);
  for (let i = 0; i < n; i++, xo += 32, o += 18) iq4Impl(32, x, xo, dst, o, o + 2, -1, -1, scales, weight, L);
};

const iq4_xs: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Uint8Array(QK_K);
  const weight = new Float32Array(32);
  const scales = new Float32Array(8);
  for (let i = 0; i < n; i++, xo += QK_K, o += 136) {
    iq4Impl(QK_K, x, xo, dst, o, o + 8, o + 2, o + 4, scales, weight, L);
  }
};

const tq1_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, o += 54) {
    let amax = 0;
    for (let j = 0; j < QK_K; j++) {
      const a = Math.abs(x[xo + j]!);
      amax = cMax(amax, a);
    }
    const d = amax;
    const id = d !== 0 ? f(1 / d) : 0;
    // block_tq1_0: qs[48] at 0, qh[4] at 48, d at 52
    putF16(dst, o + 52, d);
    const trit = (v: number): number => lroundfToInt32(f(v * id)) + 1;
    for (let m = 0; m < 32; m++) {
      let q = 0;
      for (let nn = 0; nn < 5; nn++) q = (q * 3 + trit(x[xo + m + nn * 32]!)) & 0xff;
      dst[o + m] = Math.floor((q * 256 + 242) / 243) & 0xff;
    }
    xo += 160;
    for (let m = 0; m < 16; m++) {
      let q = 0;
      for (let nn = 0; nn < 5; nn++) q = (q * 3 + trit(x[xo + m + nn * 16]!)) & 0xff;
      dst[o + 32 + m] = Math.floor((q * 256 + 242) / 243) & 0xff;
    }
    xo += 80;
    for (let j = 0; j < 4; j++) {
      let q = 0;
      for (let m = 0; m < 4; m++) q = (q * 3 + trit(x[xo + j + m * 4]!)) & 0xff;
      q = (q * 3) & 0xff;
      dst[o + 48 + j] = Math.floor((q * 256 + 242) / 243) & 0xff;
    }
    xo += 16;
  }
};

const tq2_0: BlockQuantizer = (x, xo, n, dst, o) => {
  for (let i = 0; i < n; i++, o += 66) {
    let amax = 0;
    for (let j = 0; j < QK_K; j++) {
      const a = Math.abs(x[xo + j]!);
      amax = cMax(amax, a);
    }
    const d = amax;
    const id = d !== 0 ? f(1 / d) : 0;
    putF16(dst, o + 64, d);
    for (let j = 0; j < 64; j += 32) {
      for (let m = 0; m < 32; m++) {
        let q = 0;
        for (let nn = 0; nn < 4; nn++) {
          const xi = lroundfToInt32(f(x[xo + m + nn * 32]! * id)) + 1;
          q += (xi & 3) << (2 * nn);
        }
        dst[o + j + m] = q & 0xff;
      }
      xo += 128;
    }
  }
};

/** The reference quantiser of each supported type. */
export const BLOCK_QUANTIZERS: ReadonlyMap<GgmlType, BlockQuantizer> = new Map<GgmlType, BlockQuantizer>([
  [GgmlType.F32, f32],
  [GgmlType.F16, f16],
  [GgmlType.BF16, bf16],
  [GgmlType.Q4_0, q4_0],
  [GgmlType.Q4_1, q4_1],
  [GgmlType.Q5_0, q5_0],
  [GgmlType.Q5_1, q5_1],
  [GgmlType.Q8_0, q8_0],
  [GgmlType.Q2_K, q2_K],
  [GgmlType.Q3_K, q3_K],
  [GgmlType.Q4_K, q4_K],
  [GgmlType.Q5_K, q5_K],
  [GgmlType.Q6_K, q6_K],
  [GgmlType.Q8_K, q8_K],
  [GgmlType.IQ4_NL, iq4_nl],
  [GgmlType.IQ4_XS, iq4_xs],
  [GgmlType.TQ1_0, tq1_0],
  [GgmlType.TQ2_0, tq2_0],
  [GgmlType.MXFP4, mxfp4],
  [GgmlType.NVFP4, nvfp4],
  [GgmlType.Q1_0, q1_0],
  [GgmlType.Q2_0, q2_0],
]);

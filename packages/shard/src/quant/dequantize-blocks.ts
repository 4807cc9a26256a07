// Block dequantisers, one per ggml type, each a transcription of `dequantize_row_*` in
// ggml/src/ggml-quants.c (or the row converters in ggml/src/ggml.c) of the pinned llama.cpp
// release: same block layout, same f32 operations in the same order. Where ggml rounds an
// intermediate product to float, `fround` does here; the final store into the Float32Array is the
// last rounding.

import { GgmlType } from "../ggml-type.js";
import { fround } from "./float32.js";
import { f16ToF32BitsTable, f16ToF32Table } from "./half-bits.js";

/** Decodes `nBlocks` consecutive blocks starting at `src[srcOff]` into `out[outOff...]`. */
export type BlockDequantizer = (
  src: Uint8Array,
  srcOff: number,
  nBlocks: number,
  out: Float32Array,
  outOff: number,
) => void;

const QK_K = 256;

// kvalues_iq4nl and kvalues_mxfp4 (= kvalues_fp4) from ggml/src/ggml-common.h
export const KVALUES_IQ4NL: Int8Array = Int8Array.of(
  -127,
  -104,
  -83,
  -65,
  -49,
  -35,
  -22,
  -10,
  1,
  13,
  25,
  38,
  53,
  69,
  89,
  113,
);
export const KVALUES_MXFP4: Int8Array = Int8Array.of(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);

function f16At(src: Uint8Array, off: number): number {
  return f16ToF32Table()[src[off]! | (src[off + 1]! << 8)]!;
}

function u32View(out: Float32Array): Uint32Array {
  return new Uint32Array(out.buffer, out.byteOffset, out.length);
}

/** ggml_e8m0_to_fp32_half: 2^(e-128), with the two denormal patterns below e = 2. */
export function e8m0ToF32Half(e: number): number {
  return e < 2 ? (e === 0 ? 2 ** -128 : 2 ** -127) : 2 ** (e - 128);
}

/** ggml_ue4m3_to_fp32 (NVFP4 sub-block scale), already halved as ggml returns it. */
export function ue4m3ToF32(x: number): number {
  if (x === 0 || x === 0x7f) return 0;
  const exp = (x >>> 3) & 0xf;
  const man = x & 0x7;
  // ldexpf of a value with at most 4 significant bits: exact
  const raw = exp === 0 ? man * 2 ** -9 : (1 + man / 8) * 2 ** (exp - 7);
  return raw * 0.5;
}

const f32: BlockDequantizer = (src, off, n, out, o) => {
  // byte copy keeps NaN payloads
  const o32 = u32View(out);
  for (let i = 0; i < n; i++, off += 4) {
    o32[o + i] = (src[off]! | (src[off + 1]! << 8) | (src[off + 2]! << 16) | (src[off + 3]! << 24)) >>> 0;
  }
};

const f16: BlockDequantizer = (src, off, n, out, o) => {
  const table = f16ToF32BitsTable();
  const o32 = u32View(out);
  for (let i = 0; i < n; i++, off += 2) o32[o + i] = table[src[off]! | (src[off + 1]! << 8)]!;
};

const bf16: BlockDequantizer = (src, off, n, out, o) => {
  const o32 = u32View(out);
  for (let i = 0; i < n; i++, off += 2) o32[o + i] = ((src[off]! << 16) | (src[off + 1]! << 24)) >>> 0;
};

// block_q4_0 { ggml_half d; uint8_t qs[16]; }
const q4_0: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 18, o += 32) {
    const d = f16At(src, off);
    for (let j = 0; j < 16; j++) {
      const q = src[off + 2 + j]!;
      out[o + j] = ((q & 0x0f) - 8) * d;
      out[o + j + 16] = ((q >>> 4) - 8) * d;
    }
  }
};

// block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }
const q4_1: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 20, o += 32) {
    const d = f16At(src, off);
    const m = f16At(src, off + 2);
    for (let j = 0; j < 16; j++) {
      const q = src[off + 4 + j]!;
      out[o + j] = fround((q & 0x0f) * d) + m;
      out[o + j + 16] = fround((q >>> 4) * d) + m;
    }
  }
};

function readU32(src: Uint8Array, off: number): number {
  return (src[off]! | (src[off + 1]! << 8) | (src[off + 2]! << 16) | (src[off + 3]! << 24)) >>> 0;
}

// block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }
const q5_0: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 22, o += 32) {
    const d = f16At(src, off);
    const qh = readU32(src, off + 2);
    for (let j = 0; j < 16; j++) {
      const xh0 = ((qh >>> j) << 4) & 0x10;
      const xh1 = (qh >>> (j + 12)) & 0x10;
      const q = src[off + 6 + j]!;
      out[o + j] = (((q & 0x0f) | xh0) - 16) * d;
      out[o + j + 16] = (((q >>> 4) | xh1) - 16) * d;
    }
  }
};

// block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }
const q5_1: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 24, o += 32) {
    const d = f16At(src, off);
    const m = f16At(src, off + 2);
    const qh = readU32(src, off + 4);
    for (let j = 0; j < 16; j++) {
      const xh0 = ((qh >>> j) << 4) & 0x10;
      const xh1 = (qh >>> (j + 12)) & 0x10;
      const q = src[off + 8 + j]!;
      out[o + j] = fround(((q & 0x0f) | xh0) * d) + m;
      out[o + j + 16] = fround(((q >>> 4) | xh1) * d) + m;
    }
  }
};

// block_q8_0 { ggml_half d; int8_t qs[32]; }
const q8_0: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 34, o += 32) {
    const d = f16At(src, off);
    for (let j = 0; j < 32; j++) out[o + j] = ((src[off + 2 + j]! << 24) >> 24) * d;
  }
};

// block_mxfp4 { uint8_t e; uint8_t qs[16]; }
const mxfp4: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 17, o += 32) {
    const d = e8m0ToF32Half(src[off]!);
    for (let j = 0; j < 16; j++) {
      const q = src[off + 1 + j]!;
      out[o + j] = KVALUES_MXFP4[q & 0x0f]! * d;
      out[o + j + 16] = KVALUES_MXFP4[q >>> 4]! * d;
    }
  }
};

// block_nvfp4 { uint8_t d[4]; uint8_t qs[32]; }: 64 values in four sub-blocks of 16
const nvfp4: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 36, o += 64) {
    for (let s = 0; s < 4; s++) {
      const d = ue4m3ToF32(src[off + s]!);
      const ob = o + s * 16;
      for (let j = 0; j < 8; j++) {
        const q = src[off + 4 + s * 8 + j]!;
        out[ob + j] = KVALUES_MXFP4[q & 0x0f]! * d;
        out[ob + j + 8] = KVALUES_MXFP4[q >>> 4]! * d;
      }
    }
  }
};

// block_q1_0 { ggml_half d; uint8_t qs[16]; }: 128 signs
const q1_0: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 18, o += 128) {
    const d = f16At(src, off);
    for (let j = 0; j < 128; j++) out[o + j] = (src[off + 2 + (j >>> 3)]! >>> (j & 7)) & 1 ? d : -d;
  }
};

// block_q2_0 { ggml_half d; uint8_t qs[16]; }: 64 values in {-1, 0, 1, 2} * d
const q2_0: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 18, o += 64) {
    const d = f16At(src, off);
    for (let j = 0; j < 64; j++) out[o + j] = (((src[off + 2 + (j >>> 2)]! >>> ((j & 3) * 2)) & 3) - 1) * d;
  }
};

// block_q2_K { uint8_t scales[16]; uint8_t qs[64]; ggml_half d; ggml_half dmin; }
const q2_K: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 84) {
    const d = f16At(src, off + 80);
    const min = f16At(src, off + 82);
    let q = off + 16;
    let is = 0;
    for (let nn = 0; nn < QK_K; nn += 128) {
      let shift = 0;
      for (let j = 0; j < 4; j++) {
        let sc = src[off + is++]!;
        let dl = fround(d * (sc & 0xf));
        let ml = fround(min * (sc >>> 4));
        for (let l = 0; l < 16; l++) out[o++] = fround(dl * ((src[q + l]! >>> shift) & 3)) - ml;
        sc = src[off + is++]!;
        dl = fround(d * (sc & 0xf));
        ml = fround(min * (sc >>> 4));
        for (let l = 0; l < 16; l++) out[o++] = fround(dl * ((src[q + l + 16]! >>> shift) & 3)) - ml;
        shift += 2;
      }
      q += 32;
    }
  }
};

// block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d; }
const q3_K: BlockDequantizer = (src, off, n, out, o) => {
  const scales = new Int8Array(16);
  for (let i = 0; i < n; i++, off += 110) {
    const dAll = f16At(src, off + 108);
    // the 6-bit scales: low nibbles in bytes 0..7, top two bits packed in bytes 8..11
    const sOff = off + 96;
    for (let j = 0; j < 16; j++) {
      const low = j < 8 ? src[sOff + j]! & 0xf : src[sOff + j - 8]! >>> 4;
      const high = (src[sOff + 8 + (j % 4)]! >>> (2 * (j >>> 2))) & 3;
      scales[j] = (low | (high << 4)) - 32;
    }
    let q = off + 32;
    const hm = off;
    let m = 1;
    let is = 0;
    for (let nn = 0; nn < QK_K; nn += 128) {
      let shift = 0;
      for (let j = 0; j < 4; j++) {
        let dl = fround(dAll * scales[is++]!);
        for (let l = 0; l < 16; l++) {
          out[o++] = dl * (((src[q + l]! >>> shift) & 3) - (src[hm + l]! & m ? 0 : 4));
        }
        dl = fround(dAll * scales[is++]!);
        for (let l = 0; l < 16; l++) {
          out[o++] = dl * (((src[q + l + 16]! >>> shift) & 3) - (src[hm + l + 16]! & m ? 0 : 4));
        }
        shift += 2;
        m <<= 1;
      }
      q += 32;
    }
  }
};

/** get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes at `q`. */
export function scaleMinK4(j: number, src: Uint8Array, q: number): [number, number] {
  if (j < 4) return [src[q + j]! & 63, src[q + j + 4]! & 63];
  return [
    (src[q + j + 4]! & 0xf) | ((src[q + j - 4]! >>> 6) << 4),
    (src[q + j + 4]! >>> 4) | ((src[q + j]! >>> 6) << 4),
  ];
}

// block_q4_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }
const q4_K: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 144) {
    const d = f16At(src, off);
    const min = f16At(src, off + 2);
    let q = off + 16;
    for (let is = 0; is < 8; is += 2) {
      const [sc1, m1i] = scaleMinK4(is, src, off + 4);
      const d1 = fround(d * sc1);
      const m1 = fround(min * m1i);
      const [sc2, m2i] = scaleMinK4(is + 1, src, off + 4);
      const d2 = fround(d * sc2);
      const m2 = fround(min * m2i);
      for (let l = 0; l < 32; l++) out[o++] = fround(d1 * (src[q + l]! & 0xf)) - m1;
      for (let l = 0; l < 32; l++) out[o++] = fround(d2 * (src[q + l]! >>> 4)) - m2;
      q += 32;
    }
  }
};

// block_q5_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }
const q5_K: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 176) {
    const d = f16At(src, off);
    const min = f16At(src, off + 2);
    const qh = off + 16;
    let ql = off + 48;
    let u1 = 1;
    let u2 = 2;
    for (let is = 0; is < 8; is += 2) {
      const [sc1, m1i] = scaleMinK4(is, src, off + 4);
      const d1 = fround(d * sc1);
      const m1 = fround(min * m1i);
      const [sc2, m2i] = scaleMinK4(is + 1, src, off + 4);
      const d2 = fround(d * sc2);
      const m2 = fround(min * m2i);
      for (let l = 0; l < 32; l++) {
        out[o++] = fround(d1 * ((src[ql + l]! & 0xf) + (src[qh + l]! & u1 ? 16 : 0))) - m1;
      }
      for (let l = 0; l < 32; l++) {
        out[o++] = fround(d2 * ((src[ql + l]! >>> 4) + (src[qh + l]! & u2 ? 16 : 0))) - m2;
      }
      ql += 32;
      u1 <<= 2;
      u2 <<= 2;
    }
  }
};

// block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }
const q6_K: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 210) {
    const d = f16At(src, off + 208);
    let ql = off;
    let qh = off + 128;
    let sc = off + 192;
    for (let nn = 0; nn < QK_K; nn += 128) {
      for (let l = 0; l < 32; l++) {
        const is = l >>> 4;
        const h = src[qh + l]!;
        const q1 = ((src[ql + l]! & 0xf) | ((h & 3) << 4)) - 32;
        const q2 = ((src[ql + l + 32]! & 0xf) | (((h >>> 2) & 3) << 4)) - 32;
        const q3 = ((src[ql + l]! >>> 4) | (((h >>> 4) & 3) << 4)) - 32;
        const q4 = ((src[ql + l + 32]! >>> 4) | (((h >>> 6) & 3) << 4)) - 32;
        out[o + l] = fround(d * ((src[sc + is]! << 24) >> 24)) * q1;
        out[o + l + 32] = fround(d * ((src[sc + is + 2]! << 24) >> 24)) * q2;
        out[o + l + 64] = fround(d * ((src[sc + is + 4]! << 24) >> 24)) * q3;
        out[o + l + 96] = fround(d * ((src[sc + is + 6]! << 24) >> 24)) * q4;
      }
      o += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
};

// block_q8_K { float d; int8_t qs[256]; int16_t bsums[16]; }
const q8_K: BlockDequantizer = (src, off, n, out, o) => {
  const view = new DataView(src.buffer, src.byteOffset, src.byteLength);
  for (let i = 0; i < n; i++, off += 292, o += 256) {
    const d = view.getFloat32(off, true);
    for (let j = 0; j < 256; j++) out[o + j] = d * ((src[off + 4 + j]! << 24) >> 24);
  }
};

// block_iq4_nl { ggml_half d; uint8_t qs[16]; }
const iq4_nl: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 18, o += 32) {
    const d = f16At(src, off);
    for (let j = 0; j < 16; j++) {
      const q = src[off + 2 + j]!;
      out[o + j] = d * KVALUES_IQ4NL[q & 0xf]!;
      out[o + j + 16] = d * KVALUES_IQ4NL[q >>> 4]!;
    }
  }
};

// block_iq4_xs { ggml_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; }
const iq4_xs: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 136) {
    const d = f16At(src, off);
    const scalesH = src[off + 2]! | (src[off + 3]! << 8);
    let qs = off + 8;
    for (let ib = 0; ib < 8; ib++) {
      const ls =
        ((src[off + 4 + (ib >>> 1)]! >>> (4 * (ib % 2))) & 0xf) | (((scalesH >>> (2 * ib)) & 3) << 4);
      const dl = fround(d * (ls - 32));
      for (let j = 0; j < 16; j++) {
        const q = src[qs + j]!;
        out[o + j] = dl * KVALUES_IQ4NL[q & 0xf]!;
        out[o + j + 16] = dl * KVALUES_IQ4NL[q >>> 4]!;
      }
      o += 32;
      qs += 16;
    }
  }
};

// block_tq1_0 { uint8_t qs[48]; uint8_t qh[4]; ggml_half d; }: base-3 digits, 5 (qs) or 4 (qh) per byte
const tq1_0: BlockDequantizer = (src, off, n, out, o) => {
  const pow3 = [1, 3, 9, 27, 81, 243];
  for (let i = 0; i < n; i++, off += 54) {
    const d = f16At(src, off + 52);
    for (let j = 0; j < 32; j += 32) {
      for (let nn = 0; nn < 5; nn++) {
        for (let m = 0; m < 32; m++) {
          const q = (src[off + j + m]! * pow3[nn]!) & 0xff;
          out[o++] = (((q * 3) >>> 8) - 1) * d;
        }
      }
    }
    for (let j = 32; j < 48; j += 16) {
      for (let nn = 0; nn < 5; nn++) {
        for (let m = 0; m < 16; m++) {
          const q = (src[off + j + m]! * pow3[nn]!) & 0xff;
          out[o++] = (((q * 3) >>> 8) - 1) * d;
        }
      }
    }
    for (let nn = 0; nn < 4; nn++) {
      for (let j = 0; j < 4; j++) {
        const q = (src[off + 48 + j]! * pow3[nn]!) & 0xff;
        out[o++] = (((q * 3) >>> 8) - 1) * d;
      }
    }
  }
};

// block_tq2_0 { uint8_t qs[64]; ggml_half d; }
const tq2_0: BlockDequantizer = (src, off, n, out, o) => {
  for (let i = 0; i < n; i++, off += 66) {
    const d = f16At(src, off + 64);
    for (let j = 0; j < 64; j += 32) {
      for (let l = 0; l < 4; l++) {
        for (let m = 0; m < 32; m++) out[o++] = (((src[off + j + m]! >>> (l * 2)) & 3) - 1) * d;
      }
    }
  }
};

/** The dequantiser of each supported type. */
export const BLOCK_DEQUANTIZERS: ReadonlyMap<GgmlType, BlockDequantizer> = new Map<
  GgmlType,
  BlockDequantizer
>([
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

// The k-quants over 256-value super-blocks: q2_K, q3_K, q4_K, q5_K, q6_K, q8_K
// (`quantize_row_q*_K_ref` in ggml-quants.c).
import { scaleMinK4 } from "./dequantize-blocks.js";
import { f32Bits, nearestInt } from "./float32.js";
import { f16ToF32Table } from "./half-bits.js";
import { GROUP_MAX_EPS, makeQ3Quants, makeQkx2Quants, makeQxQuants } from "./k-quant-search.js";
import { type BlockQuantizer, putF16, putU32, QK_K } from "./quantize-common.js";

// a module-local alias: an imported binding is a getter call per use when the source runs unbundled (tsx, vitest)
const f = Math.fround;

/** Packs 2-bit levels L[0..255] as q2_K/q3_K do: byte j/4+l holds L[j+l], L[j+l+32], ... */
function pack2Bit(L: ArrayLike<number>, dst: Uint8Array, o: number): void {
  for (let j = 0; j < QK_K; j += 128) {
    for (let l = 0; l < 32; l++) {
      dst[o + j / 4 + l] = L[j + l]! | (L[j + l + 32]! << 2) | (L[j + l + 64]! << 4) | (L[j + l + 96]! << 6);
    }
  }
}

export const q2_K: BlockQuantizer = (x, xo, n, dst, o) => {
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

export const q3_K: BlockQuantizer = (x, xo, n, dst, o) => {
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

export const q4_K: BlockQuantizer = (x, xo, n, dst, o) => {
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

export const q5_K: BlockQuantizer = (x, xo, n, dst, o) => {
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

export const q6_K: BlockQuantizer = (x, xo, n, dst, o) => {
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

export const q8_K: BlockQuantizer = (x, xo, n, dst, o) => {
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

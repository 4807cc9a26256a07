// The non-linear 4-bit iq4_nl/iq4_xs (`quantize_iq4_*` with ntry 7, no importance matrix) and the
// ternary tq1_0/tq2_0.
import { KVALUES_IQ4NL } from "./dequantize-blocks.js";
import { cMax, fround as f, lroundfToInt32, nearestInt } from "./float32.js";
import { bestIndexInt8, GROUP_MAX_EPS } from "./k-quant-search.js";
import { type BlockQuantizer, putF16, QK_K } from "./quantize-common.js";

/**
 * One 32-value block's scale: the best of 2 * ntry + 1 candidates around -max / values[0], by
 * weighted least squares; its levels go to `L[lb...]`. 0 for a block below GROUP_MAX_EPS.
 */
function iq4BlockScale(x: Float32Array, xb: number, weight: Float32Array, L: Uint8Array, lb: number): number {
  const values = KVALUES_IQ4NL;
  const ntry = 7;
  const blockSize = 32;
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
  if (amax < GROUP_MAX_EPS) return 0;
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
  return d;
}

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
  const blockSize = 32;
  // sigma2 only weighs importance-matrix entries, which this path has none of
  dst.fill(0, q4Off, q4Off + superBlock / 2);
  putF16(dst, dOff, 0);
  let maxScale = 0;
  let amaxScale = 0;
  const nb = superBlock / blockSize;
  for (let ib = 0; ib < nb; ib++) {
    // A flat block's 0 never raises amaxScale, so it needs no special case here.
    const d = iq4BlockScale(x, xo + ib * blockSize, weight, L, ib * blockSize);
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

export const iq4_nl: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Uint8Array(32);
  const weight = new Float32Array(32);
  const scales = new Float32Array(1);
  for (let i = 0; i < n; i++, xo += 32, o += 18) iq4Impl(32, x, xo, dst, o, o + 2, -1, -1, scales, weight, L);
};

export const iq4_xs: BlockQuantizer = (x, xo, n, dst, o) => {
  const L = new Uint8Array(QK_K);
  const weight = new Float32Array(32);
  const scales = new Float32Array(8);
  for (let i = 0; i < n; i++, xo += QK_K, o += 136) {
    iq4Impl(QK_K, x, xo, dst, o, o + 8, o + 2, o + 4, scales, weight, L);
  }
};

export const tq1_0: BlockQuantizer = (x, xo, n, dst, o) => {
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

export const tq2_0: BlockQuantizer = (x, xo, n, dst, o) => {
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

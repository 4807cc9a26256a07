// Random but valid quantised blocks, written without a quantiser: for shape-true models, whose
// billions of weights only need to be some weights of the right spread (the equivalence tests
// compare llama.cpp with itself), ggml's Q4_K reference quantiser (a per-sub-block scale search,
// ~10-20 M values/s on one core) was 85% of the synthesis time. Here each block is random bits
// from the tensor's seeded stream with its scale fields set so the values it decodes to have mean
// 0 and the requested standard deviation: hundreds of M values/s, deterministic from the seed.
import { f16BitsToF32, f32ToF16Bits, InvalidArgumentError } from "@moeswarm/core";
import { GgmlType, ggmlTypeTraits } from "../ggml-type.js";
import type { Sfc32 } from "./prng.js";

/** Types with a direct writer; others go through the quantiser. */
export const DIRECT_BLOCK_TYPES: readonly GgmlType[] = [GgmlType.Q4_K, GgmlType.Q6_K, GgmlType.Q8_0];

/** True when `type` has a direct writer and f16 can hold the scale a spread of `std` needs. */
export function hasDirectBlocks(type: GgmlType, std: number): boolean {
  return DIRECT_BLOCK_TYPES.includes(type) && scalesFor(type, std) !== undefined;
}

// Per-block (sub-block) scales s are drawn in [lo, 2 lo - 1], their spread varying the blocks as
// in real weights; lo is the largest of 16, 8, 4, 2, 1 that keeps the f16 super-block scale d a
// normal f16 number (>= 2^-14), so small spreads keep d's full precision.
const F16_MIN_NORMAL = 2 ** -14;

interface Scales {
  /** f16 bits of d. */
  d: number;
  /** The smallest sub-block scale (a power of two); s = lo + (random & (lo - 1)). */
  lo: number;
}

/** The rms of the quant offsets (q - zero) the scales multiply, per type. */
const UNIT_RMS: Partial<Record<GgmlType, number>> = {
  [GgmlType.Q4_K]: Math.sqrt(255 / 12),
  [GgmlType.Q6_K]: Math.sqrt(4095 / 12 + 0.25),
  // -127..127, with one of ±127 twice as likely (in place of -128)
  [GgmlType.Q8_0]: Math.sqrt(((2 * 127 * 128 * 255) / 6 + 127 * 127) / 256),
};

function scalesFor(type: GgmlType, std: number): Scales | undefined {
  const unitRms = UNIT_RMS[type];
  if (unitRms === undefined || !(std > 0)) return undefined;
  // Q8_0 has no sub-block scales
  for (const lo of type === GgmlType.Q8_0 ? [1] : [16, 8, 4, 2, 1]) {
    const rms = Math.sqrt(((3 * lo - 1) / 2) ** 2 + (lo * lo - 1) / 12);
    const d = f16BitsToF32(f32ToF16Bits(std / (unitRms * rms)));
    if (d >= F16_MIN_NORMAL && d < 65504) return { d: f32ToF16Bits(d), lo };
  }
  return undefined;
}

function pickScales(type: GgmlType, std: number): Scales {
  const scales = scalesFor(type, std);
  if (scales) return scales;
  throw new InvalidArgumentError(
    `a spread of ${std} cannot be written as direct ${ggmlTypeTraits(type).name} blocks; use weights: "quantised"`,
  );
}

/**
 * `nValues` values of `type` (a multiple of its block size) as random valid blocks of mean 0 and
 * standard deviation `std`, drawn from `rng`.
 *
 * - Q4_K: value = d*sc*q - dmin*m with q uniform in 0..15; every sub-block of a block gets the same
 *   sc = m = s, and dmin = 7.5 d, so value = s*d*(q - 7.5): symmetric, sd = 4.61 s d.
 * - Q6_K: value = d * scale * (q - 32), q uniform in 0..63, scale = ±s (a random sign per
 *   sub-block keeps the mean at 0 despite q - 32's -0.5).
 * - Q8_0: value = d * q with q uniform in -127..127.
 */
export function directBlocks(type: GgmlType, nValues: number, std: number, rng: Sfc32): Uint8Array {
  const { blockSize, typeSize } = ggmlTypeTraits(type);
  if (!DIRECT_BLOCK_TYPES.includes(type) || nValues % blockSize !== 0) {
    throw new InvalidArgumentError(
      `${nValues} values of ${ggmlTypeTraits(type).name} cannot be written as direct blocks`,
    );
  }
  const nBlocks = nValues / blockSize;
  const nbytes = nBlocks * typeSize;
  // One random 32-bit word per 4 bytes, then each block's scale fields overwritten.
  const words = new Uint32Array(Math.ceil(nbytes / 4));
  rng.fillU32(words);
  const out = new Uint8Array(words.buffer, 0, nbytes);
  if (type === GgmlType.Q4_K) writeQ4K(out, nBlocks, std);
  else if (type === GgmlType.Q6_K) writeQ6K(out, nBlocks, std);
  else writeQ8_0(out, nBlocks, std);
  return out;
}

// block_q4_K: d (f16), dmin (f16), scales[12] (8 six-bit scales and 8 six-bit mins,
// get_scale_min_k4's packing), qs[128].
function writeQ4K(out: Uint8Array, nBlocks: number, std: number): void {
  const { d, lo } = pickScales(GgmlType.Q4_K, std);
  const dmin = f32ToF16Bits(7.5 * f16BitsToF32(d));
  for (let b = 0; b < nBlocks; b++) {
    const o = b * 144;
    // the scale from the block's own random bits (the first quant byte)
    const s = lo + (out[o + 16]! & (lo - 1));
    out[o] = d & 0xff;
    out[o + 1] = d >>> 8;
    out[o + 2] = dmin & 0xff;
    out[o + 3] = dmin >>> 8;
    // sub-blocks 0-3: sc and m in the low 6 bits of bytes 0-3 and 4-7; sub-blocks 4-7: their low
    // 4 bits in bytes 8-11, their top 2 bits (s >> 4) in the top bits of bytes 0-7.
    const lowHigh = s | ((s >> 4) << 6);
    const nibbles = (s & 15) | ((s & 15) << 4);
    for (let j = 0; j < 8; j++) out[o + 4 + j] = lowHigh;
    for (let j = 8; j < 12; j++) out[o + 4 + j] = nibbles;
  }
}

// block_q6_K: ql[128], qh[64], scales[16] (int8), d (f16).
function writeQ6K(out: Uint8Array, nBlocks: number, std: number): void {
  const { d, lo } = pickScales(GgmlType.Q6_K, std);
  for (let b = 0; b < nBlocks; b++) {
    const o = b * 210;
    for (let j = 0; j < 16; j++) {
      const r = out[o + 192 + j]!;
      const s = lo + (r & (lo - 1));
      out[o + 192 + j] = r & 128 ? 256 - s : s;
    }
    out[o + 208] = d & 0xff;
    out[o + 209] = d >>> 8;
  }
}

// block_q8_0: d (f16), qs[32] (int8); -128 becomes 127 or -127 (by position) so q is symmetric.
function writeQ8_0(out: Uint8Array, nBlocks: number, std: number): void {
  const { d } = pickScales(GgmlType.Q8_0, std);
  for (let b = 0; b < nBlocks; b++) {
    const o = b * 34;
    out[o] = d & 0xff;
    out[o + 1] = d >>> 8;
    for (let j = 2; j < 34; j++) if (out[o + j] === 128) out[o + j] = j & 1 ? 127 : 129;
  }
}

// The 4-bit float formats with a shared block scale: mxfp4 (e8m0 scale) and nvfp4 (ue4m3 scales).
import { e8m0ToF32Half, KVALUES_MXFP4, ue4m3ToF32 } from "./dequantize-blocks.js";
import { fround as f, f32Bits, log2f, truncToInt32, truncToUint8 } from "./float32.js";
import type { BlockQuantizer } from "./quantize-common.js";

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

export const mxfp4: BlockQuantizer = (x, xo, n, dst, o) => {
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

export const nvfp4: BlockQuantizer = (x, xo, n, dst, o) => {
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

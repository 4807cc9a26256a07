// What every block quantiser shares: its signature, the super-block size and the little-endian stores.
import { f32ToF16Bits } from "@moeswarm/core";
import { fround as f } from "./float32.js";

/** Encodes `nBlocks` blocks from `x[xOff...]` into `dst[dOff...]` (`dst` starts zeroed). */
export type BlockQuantizer = (
  x: Float32Array,
  xOff: number,
  nBlocks: number,
  dst: Uint8Array,
  dOff: number,
) => void;

export const QK_K = 256;
export const FLT_MAX = f(3.4028234663852886e38);

export function putF16(dst: Uint8Array, off: number, value: number): void {
  const h = f32ToF16Bits(value);
  dst[off] = h & 0xff;
  dst[off + 1] = h >>> 8;
}

export function putU32(dst: Uint8Array, off: number, v: number): void {
  dst[off] = v & 0xff;
  dst[off + 1] = (v >>> 8) & 0xff;
  dst[off + 2] = (v >>> 16) & 0xff;
  dst[off + 3] = (v >>> 24) & 0xff;
}

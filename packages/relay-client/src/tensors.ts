import { decodeBf16, decodeF16, encodeBf16, encodeF16, InvalidArgumentError } from "@moeswarm/core";
import type { WireDtype } from "./wire.js";

/** Activations as a dispatch frame carries them: f32 as is, f16/bf16 as raw 16-bit patterns. */
export function activationsToWire(
  x: Float32Array | Uint16Array,
  dtype: WireDtype,
): Float32Array | Uint16Array {
  if (dtype === "f32") {
    if (!(x instanceof Float32Array)) {
      throw new InvalidArgumentError("dtype f32 needs x as a Float32Array");
    }
    return x;
  }
  if (x instanceof Uint16Array) return x;
  return dtype === "f16" ? encodeF16(x) : encodeBf16(x);
}

/** Activations as f32, whatever their wire dtype. */
export function activationsToF32(x: Float32Array | Uint16Array, dtype: WireDtype): Float32Array {
  if (dtype === "f32" || x instanceof Float32Array) return x as Float32Array;
  return dtype === "f16" ? decodeF16(x) : decodeBf16(x);
}

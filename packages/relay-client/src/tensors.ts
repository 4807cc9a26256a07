import {
  decodeBf16,
  decodeF16,
  encodeBf16,
  encodeF16,
  InvalidArgumentError,
  isQuantizedActivationDtype,
  NativeError,
  type QuantizedActivationDtype,
} from "@moeswarm/core";
import type { WireDtype } from "./wire.js";

/**
 * Activations as a dispatch frame carries them: f32 as is, f16/bf16 as raw 16-bit patterns,
 * q8_0/q8_K as the block bytes the caller converted them to (this package has no quantiser).
 */
export function activationsToWire(
  x: Float32Array | Uint16Array | Uint8Array,
  dtype: WireDtype | QuantizedActivationDtype,
): Float32Array | Uint16Array | Uint8Array {
  if (isQuantizedActivationDtype(dtype)) {
    if (!(x instanceof Uint8Array))
      throw new InvalidArgumentError(`dtype ${dtype} needs x as its blocks (a Uint8Array)`);
    return x;
  }
  if (x instanceof Uint8Array) throw new InvalidArgumentError(`dtype ${dtype} cannot take x as bytes`);
  if (dtype === "f32") {
    if (!(x instanceof Float32Array)) {
      throw new InvalidArgumentError("dtype f32 needs x as a Float32Array");
    }
    return x;
  }
  if (x instanceof Uint16Array) return x;
  return dtype === "f16" ? encodeF16(x) : encodeBf16(x);
}

/**
 * Activations as f32, whatever their wire dtype. q8_0/q8_K rows are refused (NativeError
 * MOESWARM_NATIVE_WIRE_DTYPE): only a compute with ggml's kernels may take them as they are, and a
 * compute that needs f32 from them would not give the bits the sender expects.
 */
export function activationsToF32(
  x: Float32Array | Uint16Array | Uint8Array,
  dtype: WireDtype | QuantizedActivationDtype,
): Float32Array {
  if (isQuantizedActivationDtype(dtype) || x instanceof Uint8Array) {
    throw new NativeError("MOESWARM_NATIVE_WIRE_DTYPE", `this worker takes f32 activations, not ${dtype}`);
  }
  if (dtype === "f32" || x instanceof Float32Array) return x as Float32Array;
  return dtype === "f16" ? decodeF16(x) : decodeBf16(x);
}

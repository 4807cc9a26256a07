import {
  type ActivationQuantizer,
  InvalidArgumentError,
  isQuantizedActivationDtype,
  type QuantizedActivationDtype,
  quantizedActivationBytes,
} from "@moeswarm/core";
import { ggmlTypeName, readGguf } from "@moeswarm/shard";
import { type NativeAddon, nativeError, requireNative } from "./native-binding.js";

// The sender's side of q8 activations on the wire (dispatch's quantizingTransport): which layers of
// a model may send their activations as q8_0 / q8_K, and the conversion itself, with this addon's
// ggml-cpu from_float. The dispatcher runs beside the backbone: on its CPU that from_float gives
// the bytes the backbone's own mul_mat_id would (x86: q8_0's AVX path, q8_K's reference code, in
// every ggml-cpu variant the pinned llama.cpp builds), which the backbone's equivalence tests hold.

const INPUT_TENSOR = /^blk\.(\d+)\.ffn_(gate|up|gate_up)_exps\.weight$/;

/**
 * Whether this machine's sender may convert activations to `dtype` and be sure to give the bytes
 * the backbone's own ggml-cpu would. q8_0: yes on x86-64 (the AVX kernel, in every ggml-cpu
 * variant the pinned llama.cpp builds) and aarch64 (NEON intrinsics, which no compiler fuses).
 * q8_K is ggml's plain C reference on both, and its `iscale*x + 12582912.f` is fused into one fma
 * or not depending on the compiler and its flags: the aarch64 build here fuses it and rounds 1 in
 * ~1000 blocks differently from x86-64 (test/quantize-ties.test.ts), so a backbone built by
 * another compiler may too. x86-64 was checked against node-llama-cpp's ggml-cpu (the backbone's
 * equivalence-wire test); elsewhere q8_K layers travel in f32.
 */
export function senderTakes(dtype: QuantizedActivationDtype, arch: string = process.arch): boolean {
  if (dtype === "q8_0") return arch === "x64" || arch === "arm64";
  return arch === "x64";
}

/** Layer -> the types of the expert tensors that read the activations (gate, up or gate_up). */
async function inputTypes(
  modelPath: string,
  signal?: AbortSignal,
): Promise<{ arch: string; embd: number; types: Map<number, string[]> }> {
  const header = await readGguf(modelPath, signal ? { signal } : {});
  const archValue = header.metadata.get("general.architecture")?.value;
  const arch = typeof archValue === "string" ? archValue : "";
  const types = new Map<number, string[]>();
  let embd = 0;
  for (const t of header.tensors) {
    const m = INPUT_TENSOR.exec(t.name);
    if (!m) continue;
    const layer = Number(m[1]);
    const list = types.get(layer) ?? [];
    list.push(ggmlTypeName(t.type));
    types.set(layer, list);
    embd = Number(t.shape[0]);
  }
  return { arch, embd, types };
}

/**
 * The activation quantizer of a model (its GGUF: the backbone's own): a layer travels as q8_0 /
 * q8_K when every tensor that reads its activations converts them to that same type in ggml's CPU
 * backend, the architecture does not weight the input (llama4), and n_embd is whole blocks.
 * Needs the native addon (MOESWARM_NATIVE_LOAD otherwise).
 */
export async function loadActivationQuantizer(
  modelPath: string,
  options: { signal?: AbortSignal } = {},
): Promise<ActivationQuantizer> {
  const addon = await requireNative(options.signal ? { signal: options.signal } : {});
  if (typeof addon.quantizeActivations !== "function" || typeof addon.wireActivationType !== "function") {
    throw new InvalidArgumentError("this build of the native addon cannot quantize activations (rebuild it)");
  }
  const { arch, embd, types } = await inputTypes(modelPath, options.signal);
  const byLayer = new Map<number, QuantizedActivationDtype>();
  if (arch !== "llama4") {
    for (const [layer, list] of types) {
      const wire = new Set(list.map((t) => addon.wireActivationType?.(t) ?? null));
      const only = wire.size === 1 ? [...wire][0] : null;
      if (
        isQuantizedActivationDtype(only) &&
        quantizedActivationBytes(only, 1, embd) > 0 &&
        senderTakes(only)
      )
        byLayer.set(layer, only);
    }
  }
  return addonQuantizer(addon, byLayer);
}

function addonQuantizer(
  addon: NativeAddon,
  byLayer: ReadonlyMap<number, QuantizedActivationDtype>,
): ActivationQuantizer {
  return {
    wireDtype: (layer) => byLayer.get(layer),
    quantize(dtype, x, embd) {
      try {
        return (addon.quantizeActivations as NonNullable<NativeAddon["quantizeActivations"]>)(dtype, x, embd);
      } catch (cause) {
        throw nativeError(cause);
      }
    },
    roundTrips(dtype, rows, embd) {
      try {
        return (addon.activationsRoundTrip as NonNullable<NativeAddon["activationsRoundTrip"]>)(
          dtype,
          rows,
          embd,
        );
      } catch (cause) {
        throw nativeError(cause);
      }
    },
  };
}

import { WIRE_ACTIVATION_DTYPES, type WireActivationDtype } from "@moeswarm/core";
import type { ExpertComputeInfo } from "@moeswarm/worker-native";

/** The register frame's `backend` is at most this many bytes (core's frame limits). */
const MAX_CLASS_BYTES = 64;

/**
 * The compute class a worker registers (the hub puts it in the placement as `computeClass`).
 * Backbones compare two owners' answers bit for bit only within one class, and within the
 * calibrated tolerance across classes: the same ggml kernels on the same ISA sum in the same
 * order, while another backend, device or architecture (x86 vs aarch64 kernels, a GPU) does not.
 * So the class names all three, e.g. `llama-cpu/x64`, `native/cpu/x64`, `worker/vulkan0/x64`.
 */
export function computeClassOf(
  backend: string,
  info: Pick<ExpertComputeInfo, "device">,
  arch: string = process.arch,
): string {
  const device = info.device?.toLowerCase();
  const parts = device === undefined || device === backend ? [backend, arch] : [backend, device, arch];
  return parts.join("/").slice(0, MAX_CLASS_BYTES);
}

/** What every compute takes: f32, and f16 / bf16, which the relay client widens to f32 first. */
const PLAIN_DTYPES: readonly WireActivationDtype[] = ["f32", "f16", "bf16"];

/**
 * The activation dtypes a worker advertises for its compute (its hello's `caps.dtypes`): q8_0 and
 * q8_K only where ggml's CPU kernels compute (the native addon or an executable on the CPU,
 * llama-cpu), which take rows already in their vec_dot_type; a GPU (its kernels quantise
 * differently and refuse them) and the TypeScript compute take the plain dtypes alone. Undefined
 * when a native compute does not say its device: the worker then says nothing, and a backbone
 * tries q8 once and learns from the answer, as with an older worker.
 */
export function wireDtypesOf(
  info: Pick<ExpertComputeInfo, "backend" | "device">,
): WireActivationDtype[] | undefined {
  if (info.backend === "ts") return [...PLAIN_DTYPES];
  const device = info.device?.toLowerCase();
  if (device === undefined) return undefined;
  const cpu = device === "cpu" || device === "llama-cpu";
  return WIRE_ACTIVATION_DTYPES.filter((d) => cpu || PLAIN_DTYPES.includes(d));
}

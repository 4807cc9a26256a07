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

import { gpuBackend } from "./gpu-backend.js";
import {
  GPU_PACKAGE_VERSION,
  type GpuBuild,
  type GpuDevice,
  type GpuStatus,
  gpuPackage,
} from "./gpu-build.js";
import type { SpawnLlamaExpertWorkerOptions } from "./llama-cpu.js";
import type { WorkerProcessCompute } from "./worker-process.js";

/**
 * The "vulkan" backend: `moeswarm-expert-worker-llama` (our compute core built against a shared
 * ggml) run on node-llama-cpp's published Vulkan build of the same llama.cpp commit
 * (`@node-llama-cpp/linux-x64-vulkan`: libggml-base.so, libggml-vulkan.so and the CPU variants).
 * Why not a Vulkan build of our own: the pinned ggml-vulkan does not compile against the Vulkan
 * headers Debian 12 ships (1.3.239 lacks `vk::LayerSettingEXT`) and needs the SPIR-V toolchain at
 * build time, while node-llama-cpp's build is the very library llama.cpp users already run, built
 * once upstream and loadable here with `ggml_backend_load`: one ggml per process, no compile.
 */
const VULKAN_BUILD: GpuBuild = {
  gpu: "vulkan",
  devicePrefix: "Vulkan",
  library: "libggml-vulkan.so",
  envDir: "MOESWARM_GGML_VULKAN_DIR",
  runtime: [{ lib: "libvulkan.so.1", from: "the Vulkan loader, Debian/Ubuntu's libvulkan1 package" }],
  noDeviceHint: "install the GPU's Vulkan driver (Mesa's mesa-vulkan-drivers for AMD and Intel)",
};

export const VULKAN_PACKAGE = gpuPackage(VULKAN_BUILD);
export const VULKAN_PACKAGE_VERSION = GPU_PACKAGE_VERSION;

/**
 * ggml weight types the Vulkan path is checked to compute against the f64 oracle (on lavapipe in
 * CI, see test/vulkan.test.ts); a slice of another type is refused by the hub's claim, not by a
 * wrong answer.
 */
export const VULKAN_TYPES: readonly string[] = Object.freeze([
  "f32",
  "f16",
  "bf16",
  "q8_0",
  "q4_0",
  "q4_K",
  "q6_K",
]);

export interface VulkanOptions {
  /** The package's `bins/linux-x64-vulkan` directory (default: found from the installed package). */
  binsDir?: string;
  /**
   * Let ggml-vulkan use a CPU-type Vulkan device (Mesa's lavapipe "llvmpipe"), which it hides
   * unless `GGML_VK_VISIBLE_DEVICES` names it: for tests and machines without a GPU. Default false.
   */
  allowCpuDevice?: boolean;
}

/**
 * Where the Vulkan build's libraries are: `options.binsDir`, else `MOESWARM_GGML_VULKAN_DIR`, else
 * the installed `@node-llama-cpp/linux-x64-vulkan` (resolved from this package, then the working
 * directory). Throws NativeError MOESWARM_NATIVE_GPU_PACKAGE_MISSING saying how to install it.
 */
export function vulkanBinsDir(options: Pick<VulkanOptions, "binsDir"> = {}): string {
  return vulkan.binsDir(options);
}

/** A Vulkan device as ggml-vulkan sees it ("Vulkan0", "AMD Radeon RX 7900 XTX (RADV NAVI31)"). */
export type VulkanDevice = GpuDevice;

export type VulkanStatus = GpuStatus;

const vulkan = gpuBackend<VulkanOptions>({
  build: VULKAN_BUILD,
  types: VULKAN_TYPES,
  own: ["allowCpuDevice"],
  // the probe and the worker see lavapipe only when asked to (and the user did not choose devices)
  env: (options): Record<string, string> =>
    options.allowCpuDevice && process.env.GGML_VK_VISIBLE_DEVICES === undefined
      ? { GGML_VK_VISIBLE_DEVICES: "0" }
      : {},
});

/**
 * The Vulkan devices this machine offers ggml, their memory and what a worker offers of it for
 * weights (`vramOfferBytes`: less the compute buffer reserved for `maxBatchRows` rows and a margin): NativeError MOESWARM_NATIVE_LOAD
 * when no device is visible (a GPU-less machine, or lavapipe without `allowCpuDevice`),
 * MOESWARM_NATIVE_GPU_PACKAGE_MISSING without the build, MOESWARM_NATIVE_GPU_DRIVER without the
 * Vulkan loader.
 */
export function probeVulkan(
  options: VulkanOptions & { maxBatchRows?: number; signal?: AbortSignal } = {},
): Promise<VulkanStatus> {
  return vulkan.probe(options);
}

export interface SpawnVulkanExpertWorkerOptions
  extends Omit<SpawnLlamaExpertWorkerOptions, "binsDir" | "reference">,
    VulkanOptions {}

/**
 * Starts `moeswarm-expert-worker-llama` on a slice with node-llama-cpp's Vulkan ggml: the experts
 * compute on `options.device` (default "Vulkan0"). `info.device` is the device the worker
 * registered, `info.vramBytes` the memory the probe found, `info.types` {@link VULKAN_TYPES}.
 */
export function spawnVulkanExpertWorker(
  slicePath: string,
  options: SpawnVulkanExpertWorkerOptions = {},
): Promise<WorkerProcessCompute> {
  return vulkan.spawn(slicePath, options);
}

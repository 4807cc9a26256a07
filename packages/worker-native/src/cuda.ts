import { gpuBackend } from "./gpu-backend.js";
import { GPU_PACKAGE_VERSION, type GpuBuild, type GpuStatus, gpuPackage } from "./gpu-build.js";
import type { SpawnLlamaExpertWorkerOptions } from "./llama-cpu.js";
import type { WorkerProcessCompute } from "./worker-process.js";

/**
 * The "cuda" backend: `moeswarm-expert-worker-llama` (our compute core built against a shared ggml)
 * on node-llama-cpp's published CUDA build of the same llama.cpp commit
 * (`@node-llama-cpp/linux-x64-cuda`: libggml-base.so, libggml-cuda.so built with CUDA 13), exactly
 * as "vulkan" runs on its Vulkan build. Not a dependency of this package: it is 143 MB packed
 * (libggml-cuda.so alone is 159 MB unpacked) and useless without an NVIDIA GPU, so a GPU owner
 * installs it next to the worker (an optional peer, as node-llama-cpp itself is).
 *
 * What the build needs from the machine (its DT_NEEDED entries): the NVIDIA driver's libcuda.so.1
 * (a driver recent enough for CUDA 13), and CUDA 13's runtime and cuBLAS (libcudart.so.13,
 * libcublas.so.13). The probe names whichever is missing (NativeError MOESWARM_NATIVE_GPU_DRIVER).
 */
export const CUDA_BUILD: GpuBuild = {
  gpu: "cuda",
  devicePrefix: "CUDA",
  library: "libggml-cuda.so",
  envDir: "MOESWARM_GGML_CUDA_DIR",
  runtime: [
    { lib: "libcuda.so.1", from: "the NVIDIA driver, version 580 or newer for CUDA 13" },
    { lib: "libcudart.so.13", from: "the CUDA 13 runtime, NVIDIA's cuda-cudart-13-0 package" },
    { lib: "libcublas.so.13", from: "cuBLAS 13, NVIDIA's libcublas-13-0 package" },
  ],
  noDeviceHint:
    "check that nvidia-smi lists the GPU (driver loaded, device not hidden by CUDA_VISIBLE_DEVICES)",
};

export const CUDA_PACKAGE = gpuPackage(CUDA_BUILD);
export const CUDA_PACKAGE_VERSION = GPU_PACKAGE_VERSION;

/**
 * ggml weight types the CUDA path serves: the types `scripts/gpu-check.py` checks against the f64
 * oracle on a GPU machine (the same set as Vulkan's; ggml-cuda's MUL_MAT_ID covers them all).
 */
export const CUDA_TYPES: readonly string[] = Object.freeze([
  "f32",
  "f16",
  "bf16",
  "q8_0",
  "q4_0",
  "q4_K",
  "q6_K",
]);

const cuda = gpuBackend<CudaOptions>({ build: CUDA_BUILD, types: CUDA_TYPES });

export interface CudaOptions {
  /** The package's `bins/linux-x64-cuda` directory (default: found from the installed package). */
  binsDir?: string;
}

/**
 * Where the CUDA build's libraries are: `options.binsDir`, else `MOESWARM_GGML_CUDA_DIR`, else the
 * installed `@node-llama-cpp/linux-x64-cuda`. NativeError MOESWARM_NATIVE_GPU_PACKAGE_MISSING
 * saying which package to install.
 */
export function cudaBinsDir(options: CudaOptions = {}): string {
  return cuda.binsDir(options);
}

export type CudaStatus = GpuStatus;

/**
 * The CUDA devices this machine offers ggml, their memory and what a worker offers of it for weights
 * (`vramOfferBytes`: less the compute buffer reserved for `maxBatchRows` rows and a margin). NativeError
 * MOESWARM_NATIVE_GPU_PACKAGE_MISSING (no build), MOESWARM_NATIVE_GPU_DRIVER (the driver or CUDA's
 * runtime libraries are missing: each named with what provides it), MOESWARM_NATIVE_LOAD (it
 * loads but sees no device).
 */
export function probeCuda(
  options: CudaOptions & { maxBatchRows?: number; signal?: AbortSignal } = {},
): Promise<CudaStatus> {
  return cuda.probe(options);
}

export interface SpawnCudaExpertWorkerOptions
  extends Omit<SpawnLlamaExpertWorkerOptions, "binsDir" | "reference">,
    CudaOptions {}

/**
 * Starts `moeswarm-expert-worker-llama` on a slice with node-llama-cpp's CUDA ggml: the experts
 * compute on `options.device` (default "CUDA0"). `info.device` is the device the worker
 * registered, `info.vramBytes` the memory the probe found, `info.types` {@link CUDA_TYPES}.
 */
export function spawnCudaExpertWorker(
  slicePath: string,
  options: SpawnCudaExpertWorkerOptions = {},
): Promise<WorkerProcessCompute> {
  return cuda.spawn(slicePath, options);
}

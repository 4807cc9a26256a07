import { InvalidArgumentError, NativeError, throwIfAborted } from "@moeswarm/core";
import { spawnCudaExpertWorker } from "./cuda.js";
import {
  type Activation,
  BACKEND_CHOICES,
  type BackendChoice,
  type ExpertCompute,
  isBackendChoice,
} from "./expert-compute.js";
import { llamaCpuAddonPath, loadLlamaCpuCompute, spawnLlamaExpertWorker } from "./llama-cpu.js";
import { probeNative } from "./native-binding.js";
import { NativeExpertCompute } from "./native-compute.js";
import { TsExpertCompute } from "./ts-compute.js";
import { spawnVulkanExpertWorker } from "./vulkan.js";
import { expertWorkerPath } from "./worker-binary.js";
import { staticWorkerFallback } from "./worker-fallback.js";
import { spawnExpertWorker } from "./worker-process.js";

export interface LoadExpertComputeOptions {
  /**
   * "native": the N-API addon, or NativeError MOESWARM_NATIVE_LOAD saying why it cannot load;
   * "ts": the TypeScript path; "auto" (default): native when it loads, else the static
   * executable where this platform has one (Android, musl: `info.backend` "worker"), else
   * TypeScript (`info.backend` says which; `nativeStatus()` says why native was not used);
   * "vulkan": see `spawnVulkanExpertWorker`; "cuda": see `spawnCudaExpertWorker`;
   * "llama-cpu": the compute core built against node-llama-cpp's ggml, computing with the CPU
   * backend library that llama.cpp itself uses here: bit-identical to llama.cpp's MUL_MAT_ID on this
   * machine (`info.device` "llama-cpu"). In this process when its addon is built (`info.backend`
   * "native"), else `moeswarm-expert-worker-llama` in a child process (`info.backend` "worker");
   * `llamaProcess: true` asks for the child process;
   * "worker": the standalone `moeswarm-expert-worker` executable (`expertWorkerPath()`) in a child
   * process, as `spawnExpertWorker` starts it.
   */
  backend?: BackendChoice;
  /** "llama-cpu": compute in a child process even when the in-process addon is built. */
  llamaProcess?: boolean;
  /** "llama-cpu": node-llama-cpp's bins directory (default: found from the installed package). */
  binsDir?: string;
  /** Compute threads of the native path (default: all CPUs). */
  threads?: number;
  /** Override the activation chosen from `general.architecture`. */
  act?: Activation | "auto";
  /** Native path: keep llama.cpp's default CPU_REPACK weight layout (default true). */
  repack?: boolean;
  /** Native path: ggml device, "cpu" (default), "gpu" or a device name (GPU builds only). */
  device?: string;
  /**
   * Child-process paths ("vulkan", "cuda", "worker", "llama-cpu" in a process): most (token, expert)
   * rows per compute graph, more computed in chunks (default: 512 on a GPU, where the compute buffer
   * is reserved for them at load and never grows; no limit on the CPU).
   */
  maxBatchRows?: number;
  /** TypeScript path: bytes of dequantised weights kept between runs (default 256 MiB). */
  cacheBytes?: number;
  signal?: AbortSignal;
}

/** Loads a slice GGUF for computing its routed experts, natively when possible. */
export async function loadExpertCompute(
  slicePath: string,
  options: LoadExpertComputeOptions = {},
): Promise<ExpertCompute> {
  const backend = options.backend ?? "auto";
  if (!isBackendChoice(backend)) {
    throw new InvalidArgumentError(
      `backend must be ${BACKEND_CHOICES.map((b) => `"${b}"`).join(", ")}, got ${String(backend)}`,
    );
  }
  if (typeof slicePath !== "string" || slicePath.length === 0) {
    throw new InvalidArgumentError("slicePath must be a non-empty string");
  }
  throwIfAborted(options.signal);
  const { signal, threads, act, repack, cacheBytes, device, binsDir, maxBatchRows } = options;
  const rows = maxBatchRows !== undefined ? { maxBatchRows } : {};
  if (backend === "llama-cpu") {
    if (!options.llamaProcess && llamaCpuAddonPath() !== undefined) {
      return loadLlamaCpuCompute(slicePath, {
        ...(threads !== undefined ? { threads } : {}),
        ...(act !== undefined ? { act } : {}),
        ...(repack !== undefined ? { repack } : {}),
        ...(binsDir !== undefined ? { binsDir } : {}),
        ...(signal ? { signal } : {}),
      });
    }
    return spawnLlamaExpertWorker(slicePath, {
      ...rows,
      ...(threads !== undefined ? { threads } : {}),
      ...(act !== undefined ? { act } : {}),
      ...(repack !== undefined ? { repack } : {}),
      ...(binsDir !== undefined ? { binsDir } : {}),
      ...(signal ? { signal } : {}),
    });
  }
  if (backend === "vulkan") {
    return spawnVulkanExpertWorker(slicePath, {
      ...rows,
      ...(threads !== undefined ? { threads } : {}),
      ...(act !== undefined ? { act } : {}),
      ...(device !== undefined ? { device } : {}),
      ...(signal ? { signal } : {}),
    });
  }
  if (backend === "cuda") {
    return spawnCudaExpertWorker(slicePath, {
      ...rows,
      ...(threads !== undefined ? { threads } : {}),
      ...(act !== undefined ? { act } : {}),
      ...(device !== undefined ? { device } : {}),
      ...(signal ? { signal } : {}),
    });
  }
  if (backend === "worker" || (backend === "auto" && (await staticWorkerFallback(signal)))) {
    return spawnExpertWorker(expertWorkerPath(), slicePath, {
      ...rows,
      ...(threads !== undefined ? { threads } : {}),
      ...(act !== undefined ? { act } : {}),
      ...(repack !== undefined ? { repack } : {}),
      ...(device !== undefined ? { device } : {}),
      ...(signal ? { signal } : {}),
    });
  }
  if (backend !== "ts") {
    const status = await probeNative(signal ? { signal } : {});
    if (status.available) {
      return NativeExpertCompute.load(slicePath, {
        ...(threads !== undefined ? { threads } : {}),
        ...(act !== undefined ? { act } : {}),
        ...(repack !== undefined ? { repack } : {}),
        ...(device !== undefined ? { device } : {}),
        ...(signal ? { signal } : {}),
      });
    }
    if (backend === "native") {
      throw new NativeError("MOESWARM_NATIVE_LOAD", status.message ?? "the native addon is not available", {
        details: { candidates: status.candidates },
      });
    }
  }
  return TsExpertCompute.load(slicePath, {
    ...(act !== undefined ? { act } : {}),
    ...(cacheBytes !== undefined ? { cacheBytes } : {}),
    ...(signal ? { signal } : {}),
  });
}

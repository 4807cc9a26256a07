import {
  type GpuBuild,
  type GpuStatus,
  gpuBinsDir,
  probeGpuBuild,
  spawnGpuExpertWorker,
} from "./gpu-build.js";
import type { SpawnLlamaExpertWorkerOptions } from "./llama-cpu.js";
import type { WorkerProcessCompute } from "./worker-process.js";

// The GPU backends ("cuda", "vulkan") differ in their build, the types they serve and, for Vulkan,
// an option of its own that becomes environment (lavapipe's visibility); the rest of their entry
// points (where the build is, the probe, the worker) is this one factory's, so that a third GPU
// build is a table entry and not a third copy.

/** What every GPU backend's options have: where its build's libraries are. */
export interface GpuBackendOptions {
  binsDir?: string;
}

/** A GPU backend's probe options: its own, plus the rows the compute buffer is reserved for. */
export type GpuProbeOptions<O extends GpuBackendOptions> = O & {
  maxBatchRows?: number;
  signal?: AbortSignal;
};

/** A GPU backend's worker options: llama-cpu's (less what the build decides) and its own. */
export type GpuSpawnOptions<O extends GpuBackendOptions> = Omit<
  SpawnLlamaExpertWorkerOptions,
  "binsDir" | "reference"
> &
  O;

/** One GPU backend's entry points, as cuda.ts and vulkan.ts export them under their own names. */
export interface GpuBackend<O extends GpuBackendOptions> {
  binsDir(options?: Pick<O, "binsDir">): string;
  probe(options?: GpuProbeOptions<O>): Promise<GpuStatus>;
  /** Probes the build (the worker's `maxBatchRows` and signal), then starts the worker on it. */
  spawn(slicePath: string, options?: GpuSpawnOptions<O>): Promise<WorkerProcessCompute>;
}

export interface GpuBackendSpec<O extends GpuBackendOptions> {
  build: GpuBuild;
  /** The ggml weight types the backend is checked to serve (the worker's `info.types`). */
  types: readonly string[];
  /** The backend's options beyond `binsDir`: kept out of the worker's options, given to `env`. */
  own?: readonly Exclude<keyof O & string, "binsDir">[];
  /** Environment the probe and the worker process get from the backend's own options. */
  env?: (options: O) => Record<string, string>;
}

export function gpuBackend<O extends GpuBackendOptions>(spec: GpuBackendSpec<O>): GpuBackend<O> {
  const { build, types } = spec;
  const probe = (options = {} as GpuProbeOptions<O>): Promise<GpuStatus> =>
    probeGpuBuild(build, {
      ...(options.binsDir !== undefined ? { binsDir: options.binsDir } : {}),
      ...(options.maxBatchRows !== undefined ? { maxBatchRows: options.maxBatchRows } : {}),
      ...(spec.env ? { env: spec.env(options) } : {}),
      ...(options.signal ? { signal: options.signal } : {}),
    });
  return {
    binsDir: (options = {}) => gpuBinsDir(build, options.binsDir),
    probe,
    async spawn(slicePath, options = {} as GpuSpawnOptions<O>) {
      const { binsDir, ...rest } = options;
      const own: Record<string, unknown> = {};
      const worker: Record<string, unknown> = { ...rest };
      for (const key of spec.own ?? []) {
        if (options[key] !== undefined) own[key] = options[key];
        delete worker[key];
      }
      const spawnOptions = worker as Omit<SpawnLlamaExpertWorkerOptions, "binsDir" | "reference">;
      const status = await probe({
        ...(own as O),
        ...(binsDir !== undefined ? { binsDir } : {}),
        ...(spawnOptions.maxBatchRows !== undefined ? { maxBatchRows: spawnOptions.maxBatchRows } : {}),
        ...(spawnOptions.signal ? { signal: spawnOptions.signal } : {}),
      });
      return spawnGpuExpertWorker(
        build,
        status,
        types,
        slicePath,
        spec.env ? { ...spawnOptions, env: { ...spec.env(own as O), ...spawnOptions.env } } : spawnOptions,
      );
    },
  };
}

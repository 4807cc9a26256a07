import { execFile } from "node:child_process";
import { existsSync, readdirSync, realpathSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { abortReason, NativeError, throwIfAborted } from "@moeswarm/core";
import {
  libraryPathWith,
  llamaCppBinsDir,
  type SpawnLlamaExpertWorkerOptions,
  spawnLlamaExpertWorker,
} from "./llama-cpu.js";
import { packageRoot } from "./native-binding.js";
import type { WorkerProcessCompute } from "./worker-process.js";

// What the GPU backends ("vulkan", "cuda") share: node-llama-cpp publishes each GPU build of the
// pinned llama.cpp commit as a package (`@node-llama-cpp/linux-x64-<gpu>`, bins/linux-x64-<gpu>:
// libggml-base.so, libggml-<gpu>.so, the CPU variants and its own addon). The participant finds
// the package, asks its addon (in a child process, so a broken driver cannot take this one down)
// which devices and how much memory it sees, and runs moeswarm-expert-worker-llama on it.

/** One of node-llama-cpp's GPU builds. */
export interface GpuBuild {
  /** "vulkan" | "cuda": the package suffix, the bins directory suffix and the addon's getGpuType(). */
  gpu: string;
  /** The ggml device name prefix ("Vulkan", "CUDA"): device i is `${prefix}${i}`. */
  devicePrefix: string;
  /** The backend library in the bins directory ("libggml-vulkan.so"). */
  library: string;
  /** Environment variable that names the bins directory instead. */
  envDir: string;
  /** Shared-library dependencies the build cannot load without, each with what provides it. */
  runtime: readonly { lib: string; from: string }[];
  /** What to do when no device is visible. */
  noDeviceHint: string;
}

export const GPU_PACKAGE_VERSION = "3.21.1";

export function gpuPackage(build: Pick<GpuBuild, "gpu">): string {
  return `@node-llama-cpp/linux-x64-${build.gpu}`;
}

function packageDir(entry: string, sub: string): string | undefined {
  let dir = dirname(entry);
  for (let i = 0; i < 6; i++) {
    if (existsSync(join(dir, "bins", sub))) return dir;
    const up = dirname(dir);
    if (up === dir) break;
    dir = up;
  }
  return undefined;
}

/**
 * Where a GPU build's libraries are: `explicit`, else the build's environment variable, else the
 * installed package (resolved from this package, then the working directory). NativeError
 * MOESWARM_NATIVE_GPU_PACKAGE_MISSING saying which npm package to install.
 */
export function gpuBinsDir(build: GpuBuild, explicit?: string): string {
  const pkg = gpuPackage(build);
  const sub = `linux-x64-${build.gpu}`;
  const tried: string[] = [];
  const ok = (dir: string) =>
    existsSync(join(dir, build.library)) && existsSync(join(dir, "libggml-base.so"));
  const dirOption = explicit ?? process.env[build.envDir];
  if (dirOption) {
    if (ok(dirOption)) return resolve(dirOption);
    tried.push(`${dirOption} (no ${build.library} and libggml-base.so)`);
  } else if (process.platform === "linux" && process.arch === "x64") {
    for (const from of [join(packageRoot(), "package.json"), join(process.cwd(), "package.json")]) {
      try {
        const main = createRequire(from).resolve(pkg);
        const dir = packageDir(realpathSync(main), sub);
        if (dir && ok(join(dir, "bins", sub))) return join(dir, "bins", sub);
        tried.push(`${dirname(main)} (no bins/${sub})`);
      } catch (cause) {
        tried.push(`${pkg} from ${dirname(from)}: ${(cause as Error).message.split("\n")[0]}`);
      }
    }
  } else {
    tried.push(
      `the ${build.gpu} build is published for linux-x64, this is ${process.platform}-${process.arch}`,
    );
  }
  throw new NativeError(
    "MOESWARM_NATIVE_GPU_PACKAGE_MISSING",
    `node-llama-cpp's ${build.gpu} build was not found:\n  ${tried.join("\n  ")}\n` +
      `possible solutions: npm install ${pkg}@${GPU_PACKAGE_VERSION} next to the worker, or set ${build.envDir} to its bins/${sub} directory`,
    { details: { tried, package: `${pkg}@${GPU_PACKAGE_VERSION}` } },
  );
}

/** A GPU device as ggml sees it. */
export interface GpuDevice {
  /** The ggml device name the worker's `--device` takes ("Vulkan0", "CUDA0"...). */
  name: string;
  /** The driver's description ("NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"). */
  description: string;
}

export interface GpuStatus {
  binsDir: string;
  devices: GpuDevice[];
  /** Device-local memory over the visible devices, bytes (ggml's own count). */
  vramBytes: number;
  /**
   * What a worker offers for expert weights (its registration's `vramBytes`): `vramBytes` less
   * `computeReserveBytes` and `marginBytes`, at least 0.
   */
  vramOfferBytes: number;
  /** The compute buffer a worker reserves at load, bounded for any supported expert shape ({@link gpuComputeReserveBytes}). */
  computeReserveBytes: number;
  /** What the driver, ggml's own device buffers and fragmentation take besides ({@link gpuVramMargin}). */
  marginBytes: number;
}

/**
 * Most (token, expert) rows per compute graph on a GPU (the worker's `--max-batch-rows`; more are
 * computed in chunks): the compute buffer is reserved for this many at load and never grows.
 * 512 is llama.cpp's default micro-batch: a prefill chunk of a dense model's size in one graph.
 */
export const GPU_MAX_BATCH_ROWS = 512;

/** The largest expert shape the VRAM headroom is sized for (Mixtral 8x22B's n_ff is 16384). */
export const GPU_RESERVE_SHAPE = Object.freeze({ nEmbd: 8192, nFf: 16384 });

const MiB = 1024 * 1024;

/**
 * An upper bound of the compute buffer a worker reserves for `maxBatchRows` rows of an expert FFN of
 * this shape (pure, for the offer and its tests): per row, the f32 tensors alive at once in the
 * graph (the input and output rows, gate, up and their product, a bias or scale result: at most
 * 3 n_embd + 5 n_ff floats), plus 1 MiB for alignment and the ids. The Vulkan test checks it against
 * the buffer the worker really reserves.
 */
export function gpuComputeReserveBytes(
  maxBatchRows: number = GPU_MAX_BATCH_ROWS,
  shape: { nEmbd: number; nFf: number } = GPU_RESERVE_SHAPE,
): number {
  return maxBatchRows * 4 * (3 * shape.nEmbd + 5 * shape.nFf) + MiB;
}

/**
 * The margin kept free besides the compute buffer: 512 MiB or 1/32 of the device, whichever is
 * more. It covers the driver's context (a CUDA context takes ~300-500 MiB of the device), ggml's
 * own per-device buffers that grow with the batch (ggml-vulkan's converted activations and
 * dequantised weights for types without a direct matmul shader) and allocation granularity.
 */
export function gpuVramMargin(totalBytes: number): number {
  return Math.max(512 * MiB, Math.floor(totalBytes / 32));
}

/** What a device of `totalBytes` offers for weights: total less compute reserve and margin, at least 0. */
export function gpuVramOffer(
  totalBytes: number,
  maxBatchRows: number = GPU_MAX_BATCH_ROWS,
): Pick<GpuStatus, "vramOfferBytes" | "computeReserveBytes" | "marginBytes"> {
  const computeReserveBytes = gpuComputeReserveBytes(maxBatchRows);
  const marginBytes = gpuVramMargin(totalBytes);
  return {
    vramOfferBytes: Math.max(0, totalBytes - computeReserveBytes - marginBytes),
    computeReserveBytes,
    marginBytes,
  };
}

// First each runtime library on its own (process.dlopen of a library that is not an addon loads
// it and then fails with "did not self-register": found; "cannot open shared object file":
// missing), so a missing driver is named rather than reported as "no device"; then the addon.
const PROBE_SCRIPT = `
const [dir, libs] = [process.argv[1], JSON.parse(process.argv[2])];
const missing = [];
for (const lib of libs) {
  try { process.dlopen({ exports: {} }, lib); } catch (e) {
    if (/cannot open shared object file|No such file/.test(String(e.message))) missing.push({ lib, message: String(e.message) });
  }
}
if (missing.length > 0) {
  process.stdout.write("\\nmoeswarm-gpu " + JSON.stringify({ missing }) + "\\n");
  process.exit(0);
}
const a = require(dir + "/llama-addon.node");
a.loadBackends(dir);
Promise.resolve(a.init()).then(() => {
  const info = a.getGpuDeviceInfo();
  const vram = a.getGpuVramInfo();
  process.stdout.write("\\nmoeswarm-gpu " + JSON.stringify({ type: a.getGpuType(), names: info.deviceNames, total: vram.total }) + "\\n");
});
`;

/** What the probe's child process answered. */
export interface GpuProbeAnswer {
  type?: unknown;
  names?: unknown;
  total?: unknown;
  missing?: { lib: string; message: string }[];
}

/**
 * The error for runtime libraries the build could not load (pure, for tests): NativeError
 * MOESWARM_NATIVE_GPU_DRIVER naming each library and what provides it.
 */
export function gpuDriverError(
  build: GpuBuild,
  missing: readonly { lib: string }[],
  binsDir: string,
): NativeError {
  const lines = missing.map(({ lib }) => {
    const from = build.runtime.find((r) => r.lib === lib)?.from ?? "its package";
    return `${lib} (${from})`;
  });
  return new NativeError(
    "MOESWARM_NATIVE_GPU_DRIVER",
    `the ${build.gpu} build cannot load: missing ${lines.join(", ")}\n` +
      `possible solutions: install ${missing.map(({ lib }) => build.runtime.find((r) => r.lib === lib)?.from ?? lib).join("; and ")}; ` +
      "or use --backend auto (CPU)",
    { details: { binsDir, missing: missing.map((m) => m.lib) } },
  );
}

/**
 * The devices a GPU build sees here, and their memory. NativeError MOESWARM_NATIVE_GPU_PACKAGE_MISSING
 * (no package), MOESWARM_NATIVE_GPU_DRIVER (a runtime library is missing: the driver, CUDA's
 * runtime) or MOESWARM_NATIVE_LOAD (it loads but finds no device).
 */
export async function probeGpuBuild(
  build: GpuBuild,
  options: {
    binsDir?: string;
    env?: Record<string, string>;
    maxBatchRows?: number;
    signal?: AbortSignal;
  } = {},
): Promise<GpuStatus> {
  throwIfAborted(options.signal);
  const binsDir = gpuBinsDir(build, options.binsDir);
  return new Promise((resolvePromise, reject) => {
    execFile(
      process.execPath,
      ["-e", PROBE_SCRIPT, binsDir, JSON.stringify(build.runtime.map((r) => r.lib))],
      {
        timeout: 60_000,
        env: { ...process.env, ...options.env, LD_LIBRARY_PATH: binsDir },
        ...(options.signal ? { signal: options.signal } : {}),
      },
      (error, stdout, stderr) => {
        if (options.signal?.aborted) return reject(abortReason(options.signal));
        const line = String(stdout)
          .split("\n")
          .find((l) => l.startsWith("moeswarm-gpu "));
        let parsed: GpuProbeAnswer = {};
        try {
          if (line) parsed = JSON.parse(line.slice("moeswarm-gpu ".length));
        } catch {
          // reported below as no device
        }
        if (parsed.missing && parsed.missing.length > 0) {
          reject(gpuDriverError(build, parsed.missing, binsDir));
          return;
        }
        const names = Array.isArray(parsed.names) ? parsed.names.map(String) : [];
        if (error || parsed.type !== build.gpu || names.length === 0) {
          const why = error ? error.message.split("\n")[0] : `ggml-${build.gpu} found no usable device`;
          const err = String(stderr).trim();
          reject(
            new NativeError(
              "MOESWARM_NATIVE_LOAD",
              `no ${build.devicePrefix} device: ${why}${err ? `\n${err.slice(-800)}` : ""}\n` +
                `possible solutions: ${build.noDeviceHint}, or use --backend auto`,
              { details: { binsDir } },
            ),
          );
          return;
        }
        const vramBytes = typeof parsed.total === "number" ? parsed.total : 0;
        resolvePromise({
          binsDir,
          devices: names.map((description, i) => ({ name: `${build.devicePrefix}${i}`, description })),
          vramBytes,
          ...gpuVramOffer(vramBytes, options.maxBatchRows),
        });
      },
    );
  });
}

/**
 * What goes after the GPU build's directory on the worker's library path. node-llama-cpp's GPU
 * packages name their ggml `libggml.<gpu>.v0.4.0.so`, while the executable (linked against the CPU
 * package) needs `libggml.v0.4.0.so`: a GPU package without it gets node-llama-cpp's CPU package
 * directory next (the same commit's library; llamaCppBinsDir's error says what to install when it
 * is missing). The executable carries no run path of the build machine, so this is how it is found.
 */
export function gpuLibraryPath(binsDir: string, env?: Record<string, string>): string | undefined {
  const hasGgml = readdirSync(binsDir).some((f) => /^libggml\.v[\d.]+\.so$/.test(f));
  if (hasGgml) return env?.LD_LIBRARY_PATH ?? process.env.LD_LIBRARY_PATH;
  return libraryPathWith(llamaCppBinsDir(), env);
}

function withLibraryPath(env: Record<string, string> | undefined, path: string | undefined) {
  return path === undefined ? { ...env } : { ...env, LD_LIBRARY_PATH: path };
}

/**
 * Starts `moeswarm-expert-worker-llama` on a slice with a probed GPU build: the experts compute on
 * `options.device` (default `${build.devicePrefix}0`), with the compute buffer reserved at load for
 * `options.maxBatchRows` (default {@link GPU_MAX_BATCH_ROWS}) rows; `info.vramBytes` is the memory
 * the probe found, `info.types` the ggml types the build serves. What differs per GPU (the probe's
 * options, the environment) is the caller's.
 */
export async function spawnGpuExpertWorker(
  build: GpuBuild,
  status: GpuStatus,
  types: readonly string[],
  slicePath: string,
  options: Omit<SpawnLlamaExpertWorkerOptions, "binsDir" | "reference">,
): Promise<WorkerProcessCompute> {
  const compute = await spawnLlamaExpertWorker(slicePath, {
    ...options,
    env: withLibraryPath(options.env, gpuLibraryPath(status.binsDir, options.env)),
    device: options.device ?? `${build.devicePrefix}0`,
    maxBatchRows: options.maxBatchRows ?? GPU_MAX_BATCH_ROWS,
    binsDir: status.binsDir,
  });
  Object.assign(compute.info, { vramBytes: status.vramBytes, types });
  return compute;
}

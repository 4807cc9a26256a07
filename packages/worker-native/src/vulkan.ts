import { execFile } from "node:child_process";
import { existsSync, realpathSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { abortReason, NativeError, throwIfAborted } from "@moeswarm/core";
import { type SpawnLlamaExpertWorkerOptions, spawnLlamaExpertWorker } from "./llama-cpu.js";
import { packageRoot } from "./native-binding.js";
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
export const VULKAN_PACKAGE = "@node-llama-cpp/linux-x64-vulkan";
export const VULKAN_PACKAGE_VERSION = "3.21.1";
const ENV_DIR = "MOESWARM_GGML_VULKAN_DIR";

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

function packageDir(entry: string): string | undefined {
  let dir = dirname(entry);
  for (let i = 0; i < 6; i++) {
    if (existsSync(join(dir, "bins", "linux-x64-vulkan"))) return dir;
    const up = dirname(dir);
    if (up === dir) break;
    dir = up;
  }
  return undefined;
}

/**
 * Where the Vulkan build's libraries are: `options.dir`, else `MOESWARM_GGML_VULKAN_DIR`, else the
 * installed `@node-llama-cpp/linux-x64-vulkan` (resolved from this package, then the working
 * directory). Throws NativeError MOESWARM_NATIVE_LOAD saying how to install it.
 */
export function vulkanBinsDir(options: Pick<VulkanOptions, "binsDir"> = {}): string {
  const tried: string[] = [];
  const ok = (dir: string) =>
    existsSync(join(dir, "libggml-vulkan.so")) && existsSync(join(dir, "libggml-base.so"));
  const explicit = options.binsDir ?? process.env[ENV_DIR];
  if (explicit) {
    if (ok(explicit)) return resolve(explicit);
    tried.push(`${explicit} (no libggml-vulkan.so and libggml-base.so)`);
  } else if (process.platform === "linux" && process.arch === "x64") {
    for (const from of [join(packageRoot(), "package.json"), join(process.cwd(), "package.json")]) {
      try {
        const main = createRequire(from).resolve(VULKAN_PACKAGE);
        const dir = packageDir(realpathSync(main));
        if (dir && ok(join(dir, "bins", "linux-x64-vulkan"))) return join(dir, "bins", "linux-x64-vulkan");
        tried.push(`${dirname(main)} (no bins/linux-x64-vulkan)`);
      } catch (cause) {
        tried.push(`${VULKAN_PACKAGE} from ${dirname(from)}: ${(cause as Error).message.split("\n")[0]}`);
      }
    }
  } else {
    tried.push(`the Vulkan build is published for linux-x64, this is ${process.platform}-${process.arch}`);
  }
  throw new NativeError(
    "MOESWARM_NATIVE_LOAD",
    `node-llama-cpp's Vulkan build was not found:\n  ${tried.join("\n  ")}\n` +
      `possible solutions: npm install ${VULKAN_PACKAGE}@${VULKAN_PACKAGE_VERSION} next to the worker, or set ${ENV_DIR} to its bins/linux-x64-vulkan directory`,
    { details: { tried } },
  );
}

/** A Vulkan device as ggml-vulkan sees it. */
export interface VulkanDevice {
  /** The ggml device name the worker's `--device` takes ("Vulkan0"...). */
  name: string;
  /** The driver's description ("AMD Radeon RX 7900 XTX (RADV NAVI31)", "llvmpipe (LLVM 15.0.6, 256 bits)"). */
  description: string;
}

export interface VulkanStatus {
  binsDir: string;
  devices: VulkanDevice[];
  /** Device-local memory over the visible devices, bytes (ggml-vulkan's own count). */
  vramBytes: number;
}

// node-llama-cpp's addon of the same package reads the devices and their memory through the very
// ggml-vulkan the worker loads; in a child process, so a broken driver cannot take this one down.
const PROBE_SCRIPT = `
const dir = process.argv[1];
const a = require(dir + "/llama-addon.node");
a.loadBackends(dir);
Promise.resolve(a.init()).then(() => {
  const info = a.getGpuDeviceInfo();
  const vram = a.getGpuVramInfo();
  process.stdout.write("\\nmoeswarm-vulkan " + JSON.stringify({ type: a.getGpuType(), names: info.deviceNames, total: vram.total }) + "\\n");
});
`;

function visibleEnv(options: VulkanOptions): Record<string, string> {
  return options.allowCpuDevice && process.env.GGML_VK_VISIBLE_DEVICES === undefined
    ? { GGML_VK_VISIBLE_DEVICES: "0" }
    : {};
}

/**
 * The Vulkan devices this machine offers ggml, and their memory: NativeError MOESWARM_NATIVE_LOAD
 * when the build is missing or no device is visible (a GPU-less machine, or lavapipe without
 * `allowCpuDevice`).
 */
export function probeVulkan(options: VulkanOptions & { signal?: AbortSignal } = {}): Promise<VulkanStatus> {
  throwIfAborted(options.signal);
  const binsDir = vulkanBinsDir(options);
  return new Promise((resolvePromise, reject) => {
    execFile(
      process.execPath,
      ["-e", PROBE_SCRIPT, binsDir],
      {
        timeout: 60_000,
        env: { ...process.env, ...visibleEnv(options), LD_LIBRARY_PATH: binsDir },
        ...(options.signal ? { signal: options.signal } : {}),
      },
      (error, stdout, stderr) => {
        if (options.signal?.aborted) return reject(abortReason(options.signal));
        const line = String(stdout)
          .split("\n")
          .find((l) => l.startsWith("moeswarm-vulkan "));
        let parsed: { type?: unknown; names?: unknown; total?: unknown } = {};
        try {
          if (line) parsed = JSON.parse(line.slice("moeswarm-vulkan ".length));
        } catch {
          // reported below as no device
        }
        const names = Array.isArray(parsed.names) ? parsed.names.map(String) : [];
        if (error || parsed.type !== "vulkan" || names.length === 0) {
          const why = error ? error.message.split("\n")[0] : "ggml-vulkan found no usable device";
          reject(
            new NativeError(
              "MOESWARM_NATIVE_LOAD",
              `no Vulkan device: ${why}${String(stderr).trim() ? `\n${String(stderr).trim().slice(-800)}` : ""}\n` +
                "possible solutions: install the GPU's Vulkan driver (Mesa's mesa-vulkan-drivers for AMD and Intel), " +
                "or use --backend auto",
              { details: { binsDir } },
            ),
          );
          return;
        }
        resolvePromise({
          binsDir,
          devices: names.map((description, i) => ({ name: `Vulkan${i}`, description })),
          vramBytes: typeof parsed.total === "number" ? parsed.total : 0,
        });
      },
    );
  });
}

export interface SpawnVulkanExpertWorkerOptions
  extends Omit<SpawnLlamaExpertWorkerOptions, "binsDir" | "reference">,
    VulkanOptions {}

/**
 * Starts `moeswarm-expert-worker-llama` on a slice with node-llama-cpp's Vulkan ggml: the experts
 * compute on `options.device` (default "Vulkan0"). `info.device` is the device the worker
 * registered, `info.vramBytes` the memory the probe found, `info.types` {@link VULKAN_TYPES}.
 */
export async function spawnVulkanExpertWorker(
  slicePath: string,
  options: SpawnVulkanExpertWorkerOptions = {},
): Promise<WorkerProcessCompute> {
  const { binsDir: dirOption, allowCpuDevice, ...rest } = options;
  const status = await probeVulkan({
    ...(dirOption !== undefined ? { binsDir: dirOption } : {}),
    ...(allowCpuDevice !== undefined ? { allowCpuDevice } : {}),
    ...(rest.signal ? { signal: rest.signal } : {}),
  });
  const compute = await spawnLlamaExpertWorker(slicePath, {
    ...rest,
    device: rest.device ?? "Vulkan0",
    binsDir: status.binsDir,
    env: { ...visibleEnv({ allowCpuDevice: allowCpuDevice ?? false }), ...rest.env },
  });
  Object.assign(compute.info, { vramBytes: status.vramBytes, types: VULKAN_TYPES });
  return compute;
}

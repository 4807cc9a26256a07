import { existsSync, readdirSync, readFileSync, realpathSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { NativeError, throwIfAborted } from "@moeswarm/core";
import { type NativeAddon, nativeError, packageRoot } from "./native-binding.js";
import { NativeExpertCompute, type NativeLoadOptions } from "./native-compute.js";
import { prebuiltCandidates, prebuiltPath } from "./prebuilt.js";
import {
  type SpawnExpertWorkerOptions,
  spawnExpertWorker,
  type WorkerProcessCompute,
} from "./worker-process.js";

/**
 * The "llama-cpu" backend: the compute core built against node-llama-cpp's shared ggml
 * (`moeswarm-expert-worker-llama`), so that its CPU kernels are the `libggml-cpu-<variant>.so`
 * llama.cpp itself loads on this machine (zen4, skylakex, haswell...). Its outputs are then
 * bit-identical to llama.cpp's own MUL_MAT_ID, which the static x86-64-v3 build's need not be
 * (other SIMD widths sum in another order).
 */
export interface LlamaCppBinsOptions {
  /** The directory holding libggml-base.so, libggml*.so and libggml-cpu-*.so; wins over everything. */
  dir?: string;
}

const ENV_DIR = "MOESWARM_GGML_BACKEND_DIR";

/**
 * The node-llama-cpp release whose libggml-base ABI the llama-cpu binaries and the backbone plugin
 * are linked against: the optional peer dependency of this package and of @moeswarm/backbone.
 */
export const NODE_LLAMA_CPP_VERSION = "3.21.1";

/** The directory of the package `name` that `entry` (a resolved file of it) belongs to. */
function packageDirOf(entry: string, name: string): string | undefined {
  let dir = dirname(entry);
  for (let i = 0; i < 8; i++) {
    const pkg = join(dir, "package.json");
    if (existsSync(pkg)) {
      try {
        if ((JSON.parse(readFileSync(pkg, "utf8")) as { name?: unknown }).name === name) return dir;
      } catch {
        // not a package.json we can read: keep walking up
      }
    }
    const up = dirname(dir);
    if (up === dir) break;
    dir = up;
  }
  return undefined;
}

/**
 * Where node-llama-cpp's prebuilt binaries for this host are: `options.dir`, else the environment's
 * `MOESWARM_GGML_BACKEND_DIR`, else resolved from the installed `node-llama-cpp` package (from this
 * package, then from the working directory). Throws NativeError MOESWARM_NATIVE_LOAD when none.
 */
export function llamaCppBinsDir(options: LlamaCppBinsOptions = {}): string {
  const tried: string[] = [];
  // what is missing, when it is node-llama-cpp or its platform package (the peer to install)
  let missing: string | undefined;
  const ok = (dir: string) => existsSync(join(dir, "libggml-base.so"));
  const explicit = options.dir ?? process.env[ENV_DIR];
  if (explicit) {
    if (ok(explicit)) return resolve(explicit);
    // asked for by name: no silent fallback to another copy of the libraries
    tried.push(`${explicit} (no libggml-base.so)`);
  } else if (process.platform === "linux" && (process.arch === "x64" || process.arch === "arm64")) {
    const plat = `linux-${process.arch}`;
    for (const from of [join(packageRoot(), "package.json"), join(process.cwd(), "package.json")]) {
      let nlc: string | undefined;
      try {
        nlc = packageDirOf(createRequire(from).resolve("node-llama-cpp"), "node-llama-cpp");
      } catch {
        missing ??= `node-llama-cpp@${NODE_LLAMA_CPP_VERSION}`;
        tried.push(`node-llama-cpp from ${dirname(from)}: not installed`);
        continue;
      }
      try {
        if (!nlc) continue;
        const binPkg = packageDirOf(
          createRequire(join(realpathSync(nlc), "package.json")).resolve(`@node-llama-cpp/${plat}`),
          `@node-llama-cpp/${plat}`,
        );
        if (!binPkg) continue;
        const dir = join(binPkg, "bins", plat);
        if (ok(dir)) return dir;
        tried.push(`${dir} (no libggml-base.so)`);
      } catch (cause) {
        missing = `@node-llama-cpp/${plat}@${NODE_LLAMA_CPP_VERSION}`;
        tried.push(`node-llama-cpp from ${dirname(from)}: ${(cause as Error).message.split("\n")[0]}`);
      }
    }
  } else {
    tried.push(
      `node-llama-cpp's CPU binaries are looked up on linux-x64 and linux-arm64, not ${process.platform}-${process.arch}`,
    );
  }
  if (missing) {
    // node-llama-cpp is an optional peer: only the llama-cpu backend and the backbone need it
    throw new NativeError(
      "MOESWARM_NATIVE_PEER_MISSING",
      `node-llama-cpp's prebuilt ggml libraries were not found:\n  ${tried.join("\n  ")}\n` +
        `possible solution: npm install ${missing} (an optional peer dependency of @moeswarm/worker-native and @moeswarm/backbone), or set ${ENV_DIR} to its bins/<platform> directory`,
      { details: { tried, install: missing } },
    );
  }
  throw new NativeError(
    "MOESWARM_NATIVE_LOAD",
    `node-llama-cpp's prebuilt ggml libraries were not found:\n  ${tried.join("\n  ")}\n` +
      `possible solutions: npm install node-llama-cpp@${NODE_LLAMA_CPP_VERSION}, or set ${ENV_DIR} to its bins/<platform> directory`,
    { details: { tried } },
  );
}

/** Path of `moeswarm-expert-worker-llama` (linux-x64; built by this package's build script). */
export function llamaExpertWorkerPath(): string {
  if (process.platform !== "linux" || process.arch !== "x64") {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `moeswarm-expert-worker-llama is built for linux-x64, this is ${process.platform}-${process.arch}`,
    );
  }
  return prebuiltPath("linux-x64", "moeswarm-expert-worker-llama");
}

export interface SpawnLlamaExpertWorkerOptions extends SpawnExpertWorkerOptions {
  /** node-llama-cpp's bins directory (default: {@link llamaCppBinsDir}). */
  binsDir?: string;
  /**
   * Answer with one monolithic MUL_MAT_ID graph over the whole tensors, as llama.cpp's
   * `build_moe_ffn` builds it: the reference a sharded run must equal (every slot filled).
   */
  reference?: boolean;
}

/** `dir` first on a library path, then what `env` (else this process) already has. */
export function libraryPathWith(dir: string, env?: Record<string, string>): string {
  const inherited = env?.LD_LIBRARY_PATH ?? process.env.LD_LIBRARY_PATH;
  return inherited ? `${dir}:${inherited}` : dir;
}

/**
 * Starts `moeswarm-expert-worker-llama` on a slice (or a full model file), with node-llama-cpp's
 * libraries on its library path; the process speaks the wire protocol on stdio like
 * {@link spawnExpertWorker}'s, and registers with backend "llama-cpu".
 */
export async function spawnLlamaExpertWorker(
  slicePath: string,
  options: SpawnLlamaExpertWorkerOptions = {},
): Promise<WorkerProcessCompute> {
  const { binsDir, reference, ...rest } = options;
  const dir = llamaCppBinsDir(binsDir !== undefined ? { dir: binsDir } : {});
  return spawnExpertWorker(llamaExpertWorkerPath(), slicePath, {
    ...rest,
    extraArgs: [...(rest.extraArgs ?? []), ...(reference ? ["--reference"] : [])],
    env: {
      ...rest.env,
      LD_LIBRARY_PATH: libraryPathWith(dir, rest.env),
      [ENV_DIR]: dir,
    },
  });
}

const LLAMA_ADDON = "llama-cpu/moeswarm_expert_llama.node";

/** Path of the in-process llama-cpu addon (linux-x64; built by this package's build script), or undefined. */
export function llamaCpuAddonPath(): string | undefined {
  if (process.platform !== "linux" || process.arch !== "x64") return undefined;
  return prebuiltCandidates("linux-x64", LLAMA_ADDON).find((p) => existsSync(p));
}

// dlopen flags (glibc's values; Node's os.constants.dlopen lacks RTLD_NODELETE)
const RTLD_NOW = 0x2;
const RTLD_GLOBAL = 0x100;
const RTLD_NODELETE = 0x1000;

const loadedAddons = new Map<string, NativeAddon>();

/**
 * Loads the llama-cpu addon into this process. node-llama-cpp's libggml-base.so and libggml.so go
 * in first, RTLD_GLOBAL, so that the addon's DT_NEEDED entries are satisfied by those very files
 * (a loaded soname is reused wherever the addon lives), and RTLD_NODELETE, because
 * `process.dlopen` closes a library that is not an addon, and a libggml-base unloaded after its
 * static initialisers ran leaves std::terminate pointing into unmapped code. A process that already
 * holds node-llama-cpp's ggml (a backbone) shares it: one ggml per process.
 */
/** @internal */
export function requireLlamaCpuAddon(binsDir: string): NativeAddon {
  const path = llamaCpuAddonPath();
  if (!path) {
    prebuiltPath("linux-x64", LLAMA_ADDON); // throws, naming the platform package to install
    throw new NativeError("MOESWARM_NATIVE_LOAD", `${LLAMA_ADDON} was not found`);
  }
  const cached = loadedAddons.get(path);
  if (cached) return cached;
  const libs = [
    "libggml-base.so",
    ...readdirSync(binsDir).filter((f) => /^libggml(\.v[\d.]+)?\.so$/.test(f)),
  ];
  for (const lib of libs) {
    try {
      process.dlopen({ exports: {} }, join(binsDir, lib), RTLD_NOW | RTLD_GLOBAL | RTLD_NODELETE);
    } catch (error) {
      // "did not self-register" is expected (it is no addon); anything else is a load failure
      if (!/did not self-register/.test((error as Error).message)) throw nativeError(error);
    }
  }
  let addon: NativeAddon;
  try {
    addon = createRequire(import.meta.url)(path) as NativeAddon;
  } catch (error) {
    throw nativeError(error);
  }
  loadedAddons.set(path, addon);
  return addon;
}

export interface LoadLlamaCpuOptions extends NativeLoadOptions {
  /** node-llama-cpp's bins directory (default: {@link llamaCppBinsDir}). */
  binsDir?: string;
}

/**
 * The llama-cpu compute in this process: the same core and kernels as `moeswarm-expert-worker-llama`
 * (bit-identical to llama.cpp's MUL_MAT_ID here), without the stdio hop per request. `info.backend`
 * is "native", `info.device` "llama-cpu".
 */
export async function loadLlamaCpuCompute(
  slicePath: string,
  options: LoadLlamaCpuOptions = {},
): Promise<NativeExpertCompute> {
  throwIfAborted(options.signal);
  const { binsDir, device: _device, ...rest } = options;
  const dir = llamaCppBinsDir(binsDir !== undefined ? { dir: binsDir } : {});
  return NativeExpertCompute.loadWith(requireLlamaCpuAddon(dir), slicePath, rest, "llama-cpu");
}

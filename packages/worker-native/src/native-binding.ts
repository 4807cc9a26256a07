import { execFile } from "node:child_process";
import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { join, resolve } from "node:path";
import { abortable, NativeError, throwIfAborted } from "@moeswarm/core";
import { errorFromCode } from "./error-from-code.js";
import { hostTarget, installHint, packageRoot, platformPackageDir } from "./prebuilt.js";

export { packageRoot };

// One loader for the N-API addon, as sharp and node-llama-cpp do it: candidates in order (a local
// build, then the prebuild that node-gyp-build finds), each probed in a child process before it is
// loaded here, so that a broken or wrong-CPU binary costs a clear message, never the host process.

/** What the addon exports (native/addon/addon.cpp). */
export interface NativeAddon {
  loadSlice(
    path: string,
    options: { threads?: number; repack?: boolean; act?: string; device?: string },
  ): Promise<{ handle: NativeSliceHandle }>;
  quantize(type: string, values: Float32Array, nPerRow: number): Uint8Array;
  dequantize(type: string, bytes: Uint8Array, n: number): Float32Array;
  /**
   * Rows of `nPerRow` f32 values to "q8_0" / "q8_K" with ggml-cpu's from_float (what the CPU
   * mul_mat_id applies to f32 activations). Absent from addons built before it.
   */
  quantizeActivations?(type: string, x: Float32Array, nPerRow: number): Uint8Array;
  /** The activation type ("q8_0" / "q8_K") a weight type's rows may travel in, else null. */
  wireActivationType?(weightType: string): string | null;
  /** Whether every row of q8_0 / q8_K `rows` comes back byte for byte from to_float then from_float. */
  activationsRoundTrip?(type: string, rows: Uint8Array, nPerRow: number): boolean;
  readonly cpuFeatures: string;
  /** ggml devices of the build, comma-separated ("CPU", "CPU,CUDA0"). */
  readonly devices: string;
  readonly abiVersion: number;
}

export interface NativeLayerInfo {
  layer: number;
  nFf: number;
  merged: boolean;
  gate: string | null;
  up: string;
  down: string;
  repacked: boolean;
  extras: number;
  swigluLimit: number;
  /** The type this layer's activations may come in (q8_0 / q8_K), null: f32 only. */
  wire?: string | null;
}

export interface NativeSliceInfo {
  layers: number[];
  experts: number[];
  tensors: NativeLayerInfo[];
  nEmbd: number;
  act: string;
  arch: string;
  threads: number;
  weightBytes: number;
  cpu: string;
  device: string;
}

export interface NativeSliceHandle {
  run(
    layer: number,
    x: Float32Array | Uint8Array,
    ids: Int32Array,
    k: number,
    weights: Float32Array | null,
    mode: 0 | 1,
    reference: boolean,
    xType?: string,
  ): Promise<Float32Array>;
  /**
   * `run` on the calling thread, reading the arrays in place and returning the output it wrote:
   * `out` when given (exactly the output's length, sharing no memory with an input; otherwise
   * MOESWARM_NATIVE_OUTPUT or MOESWARM_INVALID_ARGUMENT), else a new array. Absent from addons
   * built before it; addons built before `out` ignore it and return a new array.
   */
  runSync?(
    layer: number,
    x: Float32Array | Uint8Array,
    ids: Int32Array,
    k: number,
    weights: Float32Array | null,
    mode: 0 | 1,
    reference: boolean,
    xType?: string,
    out?: Float32Array,
  ): Float32Array;
  info(): NativeSliceInfo;
  setThreads(threads: number): void;
  abort(): void;
  close(): Promise<void>;
}

export interface NativeCandidate {
  kind: "MOESWARM_NATIVE_ADDON" | "local build" | "platform package" | "prebuild";
  path: string;
  ok: boolean;
  /** Why the candidate was not used. */
  reason?: string;
}

/** Outcome of looking for the addon: which binary is in use, or why none is. */
export interface NativeStatus {
  available: boolean;
  /** The binary in use. */
  path?: string;
  /** CPU features the binary was compiled with. */
  cpu?: string;
  candidates: NativeCandidate[];
  /** The multi-line explanation when `available` is false. */
  message?: string;
}

const ABI_VERSION = 1;
const PROBE_TIMEOUT_MS = 30_000;
const ADDON_NAME = "moeswarm_expert.node";

const require = createRequire(import.meta.url);

const PROBE_SCRIPT = `
const b = require(process.argv[1]);
if (typeof b.loadSlice !== "function" || b.abiVersion !== ${ABI_VERSION}) throw new Error("unexpected exports (abi " + b.abiVersion + ")");
const v = new Float32Array(64).map((_, i) => Math.sin(i));
const d = b.dequantize("q8_0", b.quantize("q8_0", v, 32), 64);
for (let i = 0; i < 64; i++) if (!(Math.abs(d[i] - v[i]) < 0.02)) throw new Error("q8_0 round trip is wrong at " + i);
process.stdout.write("moeswarm-probe-ok " + b.cpuFeatures);
`;

function candidatePaths(root: string): Array<Pick<NativeCandidate, "kind" | "path">> {
  const out: Array<Pick<NativeCandidate, "kind" | "path">> = [];
  // an explicit build (a GPU one from scripts/build-gpu.sh, say) comes first
  const override = process.env.MOESWARM_NATIVE_ADDON;
  if (override) out.push({ kind: "MOESWARM_NATIVE_ADDON", path: resolve(override) });
  out.push({
    kind: "local build",
    // where build-native.mjs's CMake build writes it (build/<variant>/bin/), before staging
    path: join(root, "build", `${process.platform}-${process.arch}`, "bin", ADDON_NAME),
  });
  // the platform package installed beside this one (android-arm64 has none: Termux's Node is
  // bionic and cannot load a glibc addon; the static executable serves it)
  const target = hostTarget();
  const platformDir = target && target !== "android-arm64" ? platformPackageDir(target) : undefined;
  if (platformDir) out.push({ kind: "platform package", path: join(platformDir, "node.napi.glibc.node") });
  try {
    const ngb = require("node-gyp-build") as { path(dir: string): string };
    out.push({ kind: "prebuild", path: ngb.path(root) });
  } catch {
    out.push({
      kind: "prebuild",
      path: join(root, "prebuilds", `${process.platform}-${process.arch}`, "node.napi.glibc.node"),
    });
  }
  return out;
}

// not cancellable on purpose: an aborted caller stops waiting, the probe still completes and its
// result is kept for the next caller. Exported for tests.
export function probe(path: string): Promise<{ ok: boolean; cpu?: string; reason?: string }> {
  return new Promise((resolvePromise) => {
    const child = execFile(
      process.execPath,
      ["-e", PROBE_SCRIPT, path],
      { timeout: PROBE_TIMEOUT_MS, windowsHide: true },
      (error, stdout, stderr) => {
        const out = String(stdout);
        if (!error && out.startsWith("moeswarm-probe-ok")) {
          resolvePromise({ ok: true, cpu: out.slice("moeswarm-probe-ok ".length).trim() });
          return;
        }
        const sig = (error as { signal?: string } | null)?.signal ?? child.signalCode;
        const last = String(stderr).trim().split("\n").filter(Boolean).slice(-3).join(" / ");
        let reason: string;
        if (sig === "SIGILL") {
          reason =
            "the probe process died of SIGILL: this CPU lacks an instruction the binary uses (linux-x64 prebuilds need x86-64-v3: AVX2, FMA, F16C)";
        } else if (sig) {
          reason = `the probe process was killed by ${sig}${last ? `: ${last}` : ""}`;
        } else {
          reason = `the probe failed: ${last || (error as Error | null)?.message || "no output"}`;
        }
        resolvePromise({ ok: false, reason });
      },
    );
  });
}

let status: NativeStatus | undefined;
let addon: NativeAddon | undefined;
let pending: Promise<NativeStatus> | undefined;

/** The multi-line explanation of a failed load (exported for tests). */
export function failureMessage(candidates: NativeCandidate[]): string {
  const lines = [
    "@moeswarm/worker-native: the native expert compute (N-API addon) is not available.",
    "  candidates tried:",
    ...candidates.map((c) => `    - ${c.kind} ${c.path}: ${c.reason ?? "ok"}`),
    "  possible solutions:",
  ];
  const target = hostTarget();
  if (target === "linux-x64" || target === "linux-arm64") {
    lines.push(`    - install this platform's prebuilt binaries: ${installHint(target)}`);
  } else {
    lines.push(
      `    - there is no prebuilt addon for ${process.platform}-${process.arch}: build it from a clone of the moeswarm repository (needs cmake and g++)`,
    );
  }
  lines.push(
    '    - use the TypeScript path: loadExpertCompute(slicePath, { backend: "ts" }) (or "auto")',
    "    - or run the standalone executable: spawnExpertWorker(expertWorkerPath(), slicePath)",
  );
  return lines.join("\n");
}

/**
 * Finds, probes (in a child process) and loads the addon, once per process; later calls return
 * the same status. Never throws for a missing or broken binary: the status says why.
 */
export function probeNative(options: { signal?: AbortSignal } = {}): Promise<NativeStatus> {
  throwIfAborted(options.signal);
  if (status) return Promise.resolve(status);
  pending ??= (async () => {
    const candidates: NativeCandidate[] = [];
    for (const c of candidatePaths(packageRoot())) {
      if (!existsSync(c.path)) {
        candidates.push({ ...c, ok: false, reason: "not found" });
        continue;
      }
      const r = await probe(c.path);
      if (!r.ok) {
        candidates.push({ ...c, ok: false, reason: r.reason ?? "failed" });
        continue;
      }
      try {
        addon = require(c.path) as NativeAddon;
      } catch (cause) {
        candidates.push({ ...c, ok: false, reason: `loading failed: ${(cause as Error).message}` });
        continue;
      }
      candidates.push({ ...c, ok: true });
      status = { available: true, path: c.path, candidates, ...(r.cpu ? { cpu: r.cpu } : {}) };
      return status;
    }
    status = { available: false, candidates, message: failureMessage(candidates) };
    return status;
  })().finally(() => {
    pending = undefined;
  });
  const p = pending;
  const signal = options.signal;
  if (!signal) return p;
  return abortable(p, signal);
}

/** The result of the last probe, undefined before any native load was attempted. */
export function nativeStatus(): NativeStatus | undefined {
  return status;
}

/** The loaded addon, or NativeError MOESWARM_NATIVE_LOAD with the explanation. */
export async function requireNative(options: { signal?: AbortSignal } = {}): Promise<NativeAddon> {
  const s = await probeNative(options);
  if (!s.available || !addon) {
    throw new NativeError("MOESWARM_NATIVE_LOAD", s.message ?? "the native addon is not available", {
      details: { candidates: s.candidates },
    });
  }
  return addon;
}

/** The addon's rejections carry `code`; this turns them into moeswarm's typed errors. */
export function nativeError(cause: unknown): Error {
  if (cause instanceof Error && typeof (cause as { code?: unknown }).code === "string") {
    return errorFromCode((cause as unknown as { code: string }).code, cause.message);
  }
  return cause instanceof Error ? cause : new NativeError("MOESWARM_NATIVE_COMPUTE", String(cause));
}

/**
 * Quantises f32 values to a ggml type with ggml itself (`ggml_quantize_chunk`): rows of
 * `nPerRow` values. Needs the native addon.
 */
export async function ggmlQuantize(type: string, values: Float32Array, nPerRow: number): Promise<Uint8Array> {
  const b = await requireNative();
  try {
    return b.quantize(type, values, nPerRow);
  } catch (cause) {
    throw nativeError(cause);
  }
}

/** Dequantises `n` values of a ggml type with ggml's own `to_float`. Needs the native addon. */
export async function ggmlDequantize(type: string, bytes: Uint8Array, n: number): Promise<Float32Array> {
  const b = await requireNative();
  try {
    return b.dequantize(type, bytes, n);
  } catch (cause) {
    throw nativeError(cause);
  }
}

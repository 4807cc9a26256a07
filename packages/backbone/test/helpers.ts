// Shared fixtures of the backbone tests: synthetic models (cached across runs), slices cut from
// them, llama-cpu worker processes behind an in-process transport, and the skip logic.
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { PassThrough } from "node:stream";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import {
  ensureSyntheticModel,
  findExpertTensors,
  readGguf,
  type SyntheticArch,
  type SyntheticPreset,
  sliceExperts,
} from "@moeswarm/shard";
import {
  llamaCppBinsDir,
  llamaExpertWorkerPath,
  spawnLlamaExpertWorker,
  type WorkerProcessCompute,
} from "@moeswarm/worker-native";
import { expertComputeHandler } from "../src/index.js";
import { logitsHarnessPath, pluginPath } from "../src/native-paths.js";

/** Synthetic models are cached across runs (generation is deterministic; `small` takes a second). */
export const MODEL_CACHE = process.env.MOESWARM_CACHE_DIR ?? join(tmpdir(), "moeswarm-backbone-test-models");

/** Why the native tests cannot run here, or undefined. CI must be able to run them. */
export function nativeMissing(): string | undefined {
  let missing: string | undefined;
  try {
    pluginPath();
    logitsHarnessPath();
    llamaCppBinsDir();
    llamaExpertWorkerPath();
  } catch (error) {
    missing = (error as Error).message;
  }
  if (missing) {
    if (process.env.CI && process.platform === "linux" && process.arch === "x64") {
      throw new Error(`CI must build the backbone's and worker-native's native parts: ${missing}`);
    }
    console.warn(`skipping the native backbone tests: ${missing}`);
  }
  return missing;
}

export async function syntheticModel(
  preset: SyntheticPreset,
  arch: SyntheticArch = "qwen3moe",
): Promise<string> {
  return (await ensureSyntheticModel(preset, { cacheDir: MODEL_CACHE, arch })).path;
}

export interface TempDir {
  readonly dir: string;
  remove(): void;
}

export function tempDir(prefix = "moeswarm-backbone-"): TempDir {
  // short: Unix socket paths must stay under 108 bytes
  const dir = mkdtempSync(join(tmpdir(), prefix));
  return { dir, remove: () => rmSync(dir, { recursive: true, force: true }) };
}

export interface ModelInfo {
  layers: number[];
  nExpert: number;
  nExpertUsed: number;
}

export async function modelInfo(path: string): Promise<ModelInfo> {
  const layout = findExpertTensors(await readGguf(path));
  return {
    layers: layout.layers.map((l) => l.layer),
    nExpert: layout.layers[0]!.nExpert,
    nExpertUsed: layout.expertUsedCount ?? 0,
  };
}

export interface WorkerSpec {
  id: string;
  experts: number[];
}

/** Experts 0..n-1 cut into `parts` contiguous ranges. */
export function split(n: number, parts: number): number[][] {
  const out: number[][] = [];
  for (let p = 0; p < parts; p++) {
    const a = Math.floor((p * n) / parts);
    const b = Math.floor(((p + 1) * n) / parts);
    out.push([...Array(b - a).keys()].map((i) => a + i));
  }
  return out;
}

export interface Swarm extends AsyncDisposable {
  placement: Placement;
  transport: InProcessTransport;
  workers: Map<string, WorkerProcessCompute>;
  close(): Promise<void>;
}

/**
 * llama-cpu worker processes, each on its own slice of `modelPath` (all MoE layers), registered in
 * a placement under `model` and reached through an in-process transport.
 */
export async function startSwarm(
  modelPath: string,
  specs: readonly WorkerSpec[],
  dir: string,
  model: string,
): Promise<Swarm> {
  const info = await modelInfo(modelPath);
  const placement = new Placement({ model });
  const transport = new InProcessTransport();
  const workers = new Map<string, WorkerProcessCompute>();
  const close = async () => {
    await Promise.all([...workers.values()].map((w) => w.close().catch(() => {})));
  };
  try {
    for (const spec of specs) {
      const path = join(dir, `${spec.id}.gguf`);
      const slice = await sliceExperts(modelPath, { layers: info.layers, experts: spec.experts });
      await slice.write(path);
      await slice.close();
      const worker = await spawnLlamaExpertWorker(path, { threads: 1 });
      workers.set(spec.id, worker);
      transport.set(spec.id, expertComputeHandler(worker));
      placement.register({ id: spec.id, model, layers: info.layers, experts: spec.experts });
    }
  } catch (error) {
    await close();
    throw error;
  }
  return { placement, transport, workers, close, [Symbol.asyncDispose]: close };
}

/** Byte-for-byte equality of two buffers, with the first differing offset. */
export function firstByteDiff(a: Uint8Array, b: Uint8Array): number {
  const n = Math.min(a.byteLength, b.byteLength);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.byteLength === b.byteLength ? -1 : n;
}

export interface LoopbackCerts {
  ca: string;
  cert: string;
  key: string;
}

/** A throwaway CA and a leaf for localhost / 127.0.0.1 it signs, made with the openssl CLI. */
export function loopbackCerts(): LoopbackCerts {
  const dir = mkdtempSync(join(tmpdir(), "mswb-tls-"));
  const run = (args: string[]) => execFileSync("openssl", args, { cwd: dir, stdio: "pipe" });
  try {
    const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    run(["req", "-x509", ...ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=mswb CA"]);
    run(["req", ...ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=localhost"]);
    writeFileSync(
      join(dir, "leaf.ext"),
      "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    run([
      "x509",
      "-req",
      "-in",
      "leaf.csr",
      "-CA",
      "ca.crt",
      "-CAkey",
      "ca.key",
      "-CAcreateserial",
      "-out",
      "leaf.crt",
      "-days",
      "1",
      "-extfile",
      "leaf.ext",
    ]);
    const read = (f: string) => readFileSync(join(dir, f), "utf8");
    return { ca: read("ca.crt"), cert: read("leaf.crt"), key: read("leaf.key") };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

/** A writable stream that keeps its text; `line(re)` waits for a line that matches. */
export function captureStream() {
  const stream = new PassThrough();
  let text = "";
  const waiters: (() => void)[] = [];
  stream.on("data", (d: Buffer) => {
    text += d.toString();
    for (const w of waiters.splice(0)) w();
  });
  return {
    stream,
    text: () => text,
    async line(match: RegExp): Promise<string> {
      for (;;) {
        const hit = text.split("\n").find((l) => match.test(l));
        if (hit) return hit;
        await new Promise<void>((r) => waiters.push(r));
      }
    },
  };
}

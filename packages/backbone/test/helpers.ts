import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  decodeFrame,
  dispatchFrame,
  type ExpertHandler,
  encodeLengthPrefixed,
  type Frame,
  FrameReader,
  sumSlots,
} from "@moeswarm/core";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import {
  createHub,
  createLoopbackCertificates,
  type Hub,
  type LoopbackCertificates,
  mintToken,
} from "@moeswarm/hub";
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import {
  ensureSyntheticModel,
  findExpertTensors,
  readGguf,
  type SyntheticArch,
  type SyntheticPreset,
  sliceExperts,
} from "@moeswarm/shard";
import {
  type ExpertCompute,
  llamaCppBinsDir,
  llamaExpertWorkerPath,
  spawnLlamaExpertWorker,
  type WorkerProcessCompute,
} from "@moeswarm/worker-native";
import { expect } from "vitest";
import {
  type BackboneBridge,
  type BackboneBridgeOptions,
  expertComputeHandler,
  type LogitsHarnessOptions,
  type LogitsHarnessResult,
  runLogitsHarness,
  serveBackboneBridge,
} from "../src/index.js";
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

/** A synthetic model's path and its expert layout. */
export async function syntheticModelInfo(
  preset: SyntheticPreset,
  arch: SyntheticArch = "qwen3moe",
): Promise<{ path: string; info: ModelInfo }> {
  const path = await syntheticModel(preset, arch);
  return { path, info: await modelInfo(path) };
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
  // restart: false for a test whose killed worker must stay gone (restarts are on by default)
  spawn: { startTimeoutMs?: number; restart?: false } = {},
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
      const worker = await spawnLlamaExpertWorker(path, { threads: 1, ...spawn });
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

/** startSwarm with the experts cut into `parts` contiguous ranges, workers `${prefix}0`, `${prefix}1`... */
export function startSplitSwarm(
  modelPath: string,
  info: ModelInfo,
  parts: number,
  dir: string,
  model: string,
  prefix = "w",
  spawn: { startTimeoutMs?: number } = {},
): Promise<Swarm> {
  const specs = split(info.nExpert, parts).map((experts, i) => ({ id: `${prefix}${i}`, experts }));
  return startSwarm(modelPath, specs, dir, model, spawn);
}

/**
 * A hub serving one model to test workers: fake workers register without claiming, one copy per
 * expert, stats not routed through the relay (the hub's trust defaults are tested in @moeswarm/hub).
 */
export function testHub(secret: string, modelId: string, modelPath: string, tls?: LoopbackCerts): Hub {
  return createHub({
    secret,
    models: [{ id: modelId, path: modelPath }],
    ...(tls ? { tls } : {}),
    requireLeases: false,
    replicas: 1,
    trustReports: true,
  });
}

/**
 * The swarm's workers `w0`, `w1`... (as startSplitSwarm names them) on a hub's relay, each
 * registered for its experts on every MoE layer; closes the ones it connected if one fails.
 */
export async function relaySwarmWorkers(
  relayUrl: string,
  options: { secret: string; swarm: Swarm; model: string; layers: number[]; parts: number[][] },
): Promise<RelayConnection[]> {
  const connections: RelayConnection[] = [];
  try {
    for (const [i, experts] of options.parts.entries()) {
      const id = `w${i}`;
      const c = await connectComputeToRelay(relayUrl, {
        id,
        secret: options.secret,
        compute: options.swarm.workers.get(id)!,
        ttlS: 600,
      });
      connections.push(c);
      c.register({ model: options.model, layers: options.layers, experts });
    }
  } catch (error) {
    await Promise.all(connections.map((c) => c.close().catch(() => {})));
    throw error;
  }
  return connections;
}

/** A loopback hub (testHub's settings) with llama-cpu workers on its relay: startRelaySwarm. */
export interface RelaySwarm extends AsyncDisposable {
  readonly hub: Hub;
  readonly url: string;
  readonly relayUrl: string;
  /** The throwaway CA and leaf the hub serves (`tls: true`); undefined: plain http and ws. */
  readonly certs: LoopbackCerts | undefined;
  readonly model: string;
  readonly modelPath: string;
  readonly info: ModelInfo;
  /** llama-cpu processes by slice name, and relay connections by peer id (closed with the swarm). */
  readonly processes: Map<string, WorkerProcessCompute>;
  readonly connections: Map<string, RelayConnection>;
  /** A llama-cpu process on `experts` of every MoE layer (the slice written under `dir`). */
  spawn(name: string, experts: readonly number[]): Promise<WorkerProcessCompute>;
  /** A worker: spawn, then a relay connection as `id` whose dispatches run there, registering the slice. */
  join(id: string, experts: readonly number[]): Promise<RelayConnection>;
  /** A connection the test made itself (its backbone, a worker of its own), closed with the swarm. */
  track(id: string, connection: RelayConnection): RelayConnection;
  close(): Promise<void>;
}

/**
 * The relay set-up of the relay tests: a hub serving `modelPath` as `model` (fake workers register
 * without claiming, one copy per expert, reports trusted: testHub), optionally over TLS with a
 * loopback CA, and llama-cpu worker processes joining its relay.
 */
export async function startRelaySwarm(options: {
  secret: string;
  model: string;
  modelPath: string;
  dir: string;
  tls?: boolean;
}): Promise<RelaySwarm> {
  const { secret, model, modelPath, dir } = options;
  const [info, certs] = await Promise.all([
    modelInfo(modelPath),
    options.tls ? loopbackCerts() : Promise.resolve(undefined),
  ]);
  const hub = testHub(secret, model, modelPath, certs);
  const processes = new Map<string, WorkerProcessCompute>();
  const connections = new Map<string, RelayConnection>();
  const close = async () => {
    await Promise.all([...connections.values()].map((c) => c.close().catch(() => {})));
    await Promise.all([...processes.values()].map((w) => w.close().catch(() => {})));
    await hub.close();
  };
  let listener: { url: string; relayUrl: string };
  try {
    listener = await hub.listen(0);
  } catch (error) {
    await hub.close();
    throw error;
  }
  const spawn = async (name: string, experts: readonly number[]) => {
    const path = join(dir, `${name}.gguf`);
    await using slice = await sliceExperts(modelPath, { layers: info.layers, experts: [...experts] });
    await slice.write(path);
    const compute = await spawnLlamaExpertWorker(path, { threads: 1 });
    processes.set(name, compute);
    return compute;
  };
  const track = (id: string, connection: RelayConnection) => {
    connections.set(id, connection);
    return connection;
  };
  return {
    hub,
    url: listener.url,
    relayUrl: listener.relayUrl,
    certs,
    model,
    modelPath,
    info,
    processes,
    connections,
    spawn,
    track,
    async join(id, experts) {
      const compute = await spawn(id, experts);
      const c = track(
        id,
        await connectComputeToRelay(listener.relayUrl, {
          id,
          secret,
          compute,
          ...(certs ? { ca: certs.ca } : {}),
        }),
      );
      c.register({ model, layers: info.layers, experts: [...experts], backend: "llama-cpu" });
      return c;
    },
    close,
    [Symbol.asyncDispose]: close,
  };
}

/** Byte-for-byte equality of two buffers, with the first differing offset. */
export function firstByteDiff(a: Uint8Array, b: Uint8Array): number {
  const n = Math.min(a.byteLength, b.byteLength);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.byteLength === b.byteLength ? -1 : n;
}

/** A throwaway CA and a loopback leaf it signs (the hub's own helper, openssl CLI). */
export function loopbackCerts(): Promise<LoopbackCertificates> {
  return createLoopbackCertificates({ hosts: ["localhost", "127.0.0.1"], days: 1 });
}

export type LoopbackCerts = LoopbackCertificates;

/**
 * A worker on a relay: a connection with the worker role (a token minted with `secret`) whose
 * dispatches run on `compute`, as the worker runtime serves them. Register its slice on it.
 */
export function connectComputeToRelay(
  relayUrl: string,
  options: { id: string; secret: string; compute: ExpertCompute; ca?: string; ttlS?: number },
): Promise<RelayConnection> {
  const { id, secret, compute } = options;
  return connectRelay(relayUrl, {
    role: "worker",
    id,
    token: mintToken({ role: "worker", id, ttlS: options.ttlS ?? 3600 }, secret),
    ...(options.ca !== undefined ? { ca: options.ca } : {}),
    reconnect: false,
    onDispatch: async (d) => ({
      y: await compute.run(
        {
          layer: d.layer,
          x: d.activations(),
          ids: d.ids,
          k: d.k,
          ...(d.w ? { w: d.w } : {}),
          mode: d.mode,
        },
        { signal: d.signal },
      ),
    }),
  });
}

/** Expert e's output for a row x: fround(x * (e + 1) + e); `scale` makes a liar. */
export function toyWorker(calls: { n: number }, scale = 1): ExpertHandler {
  return (req) => {
    calls.n++;
    const { n, k, embd } = req;
    const y = new Float32Array(n * k * embd);
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < k; j++) {
        const e = req.ids[i * k + j]!;
        if (e < 0) continue;
        for (let c = 0; c < embd; c++) {
          const v = Math.fround(Math.fround(req.x[i * embd + c]! * (e + 1)) + e);
          y[(i * k + j) * embd + c] = Math.fround(v * scale);
        }
      }
    }
    if (req.mode === "sum")
      return { mode: "sum", n, k, embd, y: sumSlots(y, req.w!, req.ids, { n, k, embd }) };
    return { mode: "each", n, k, embd, y };
  };
}

/** One request to a bridge over a fresh connection to its socket; the answer frame. */
export function askBridge(address: string, frame: Frame): Promise<Frame> {
  return new Promise((resolve, reject) => {
    const socket = connect(address.slice("unix:".length));
    const reader = new FrameReader();
    socket.on("data", (chunk: Buffer) => {
      const [p] = reader.push(chunk);
      if (p) {
        resolve(decodeFrame(p, { copy: true }));
        socket.destroy();
      }
    });
    socket.on("error", reject);
    socket.write(encodeLengthPrefixed(frame));
  });
}

const TOY_X = Float32Array.from({ length: 3 * 4 }, (_, i) => Math.sin(i));
const TOY_IDS = Int32Array.from([0, 1, 1, 2, 2, 0]);
const TOY_W = Float32Array.from([0.5, 0.25, 0.75, 0.125, 0.375, 0.625]);

/** A "sum" dispatch of 3 tokens x top-2 of model "unit" (embd 4) over experts 0..2, for toyWorker. */
export function toyFrame(id: number) {
  return dispatchFrame({
    id,
    model: "unit",
    layer: 0,
    n: 3,
    embd: 4,
    dtype: "f32",
    x: TOY_X,
    k: 2,
    ids: TOY_IDS,
    w: TOY_W,
    mode: "sum",
  });
}

/** What an equivalence test decodes: a model, its prompt, how many tokens, where logits go. */
export interface DecodeSpec {
  readonly model: string;
  readonly prompt: string;
  readonly nPredict: number;
  readonly dir: string;
}

/**
 * llama.cpp's greedy run (one thread) of `d`, its logits written to `<dir>/<name>.bin` and read
 * back (empty when the run wrote none); `extra` adds the case's harness options (plugin, env...).
 */
export async function decodeLogits(
  d: DecodeSpec,
  name: string,
  extra: Partial<LogitsHarnessOptions> = {},
): Promise<{ run: LogitsHarnessResult; logits: Buffer }> {
  const logitsPath = join(d.dir, `${name}.bin`);
  const run = await runLogitsHarness({
    modelPath: d.model,
    prompt: d.prompt,
    nPredict: d.nPredict,
    threads: 1,
    logitsPath,
    ...extra,
  });
  return { run, logits: existsSync(logitsPath) ? readFileSync(logitsPath) : Buffer.alloc(0) };
}

/** A bridge on `socket` that dispatches to `swarm` (its placement and transport), with `extra` options. */
export function swarmBridge(
  swarm: Pick<Swarm, "placement" | "transport">,
  socket: BackboneBridgeOptions["socket"],
  extra: Partial<BackboneBridgeOptions> = {},
): Promise<BackboneBridge> {
  return serveBackboneBridge({ socket, placement: swarm.placement, transport: swarm.transport, ...extra });
}

/**
 * A swarm run against plain llama.cpp's: identical greedy tokens, bit-identical logits, one plugin
 * split per remote layer and ubatch (the prompt is one ubatch, then one per token), every expert
 * tensor handed over and dropped, and every split answered by the bridge without a fallback.
 */
export function expectEquivalent(o: {
  run: LogitsHarnessResult;
  logits: Buffer;
  plainTokens: readonly number[];
  plainLogits: Buffer;
  nPredict: number;
  layers: readonly number[];
  expertTensors: number;
  bridge: BackboneBridge;
  /** The bridge's request count before the run. */
  requestsBefore: number;
}): void {
  const { run, nPredict, layers } = o;
  expect(run.ok, run.stderr).toBe(true);
  expect(run.tokens).toHaveLength(nPredict);
  expect(run.tokens).toEqual(o.plainTokens);
  expect(o.logits.byteLength).toBe((nPredict + 1) * run.nVocab * 4);
  expect(firstByteDiff(o.logits, o.plainLogits)).toBe(-1);
  const ubatches = nPredict + 1;
  const plugin = run.plugin!;
  expect(plugin.failures).toBe(0);
  expect(plugin.splits).toBe(ubatches * layers.length);
  for (const layer of layers) expect(plugin.layers[String(layer)]!.count).toBe(ubatches);
  expect(plugin.weightsDroppedTensors).toBe(layers.length * o.expertTensors);
  expect(o.bridge.metrics().requests - o.requestsBefore).toBe(plugin.splits);
  expect(o.bridge.metrics().fallbacks).toBe(0);
}

// The native data plane's plugin side under test: llama-logits (node-llama-cpp's libllama) with
// libggml-moeswarm.so, a stand-in bridge on a Unix socket (the plugin socket's frames: dispatch ->
// result, native-hello -> native-table, native-receipts recorded) and a stand-in worker on a
// node:tls listener (docs/protocol.md 10.9: hello -> hello, dispatch -> result), both answering
// with the same llama-cpu compute, so the two paths give the same bits when the plugin is right.
import { execFile, execFileSync, spawn } from "node:child_process";
import { X509Certificate } from "node:crypto";
import { existsSync, readFileSync } from "node:fs";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createServer as createTlsServer, type TLSSocket } from "node:tls";
import {
  compactSlots,
  type DispatchFrame,
  decodeFrame,
  type EncodableFrame,
  encodeFrame,
} from "@moeswarm/core";
import { ensureSyntheticModel, findExpertTensors, readGguf, sliceExperts } from "@moeswarm/shard";
import { decode, encode } from "@msgpack/msgpack";
import type { ExpertCompute } from "../src/index.js";
import { llamaCppBinsDir, loadExpertCompute, prebuiltPath } from "../src/index.js";

/** Why the plugin cannot be run here, or undefined. */
export function pluginMissing(): string | undefined {
  if (process.platform !== "linux" || process.arch !== "x64") return "the plugin is built for linux-x64 only";
  try {
    for (const f of ["libggml-moeswarm.so", "llama-logits"]) prebuiltPath("linux-x64", f);
    llamaCppBinsDir();
  } catch (e) {
    return `the plugin or node-llama-cpp's binaries are missing (${(e as Error).message.split("\n")[0]})`;
  }
  // llama-logits links no OpenSSL: the plugin's TLS opens libssl.so.3 (common/moeswarm-tls.h)
  try {
    if (!/libssl\.so\.3\b/.test(execFileSync("ldconfig", ["-p"], { encoding: "utf8" }))) {
      return "no libssl.so.3 on this machine (the plugin's native plane needs OpenSSL 3: apt-get install libssl3)";
    }
  } catch (e) {
    return `cannot list the shared libraries (ldconfig -p: ${(e as Error).message.split("\n")[0]})`;
  }
  return undefined;
}

/** A length-prefixed frame stream (protocol section 7) over a socket: payloads to `onFrame`. */
function frameReader(socket: Socket, onFrame: (payload: Uint8Array) => void): void {
  let buf: Buffer = Buffer.alloc(0);
  socket.on("data", (d: Buffer) => {
    buf = buf.length ? Buffer.concat([buf, d]) : d;
    while (buf.length >= 4) {
      const n = buf.readUInt32LE(0);
      if (buf.length < 4 + n) break;
      onFrame(new Uint8Array(buf.subarray(4, 4 + n)));
      buf = buf.subarray(4 + n);
    }
  });
}

function prefixed(payload: Uint8Array): Buffer {
  const out = Buffer.alloc(4 + payload.byteLength);
  out.writeUInt32LE(payload.byteLength, 0);
  out.set(payload, 4);
  return out;
}

const sendFrame = (socket: Socket, frame: EncodableFrame) => socket.write(prefixed(encodeFrame(frame)));

/**
 * The answer to a dispatch, from the one compute both stand-ins share: mode sum, or mode each (the
 * filled slots' rows only when the dispatch asks for `compact`, as the native listener answers).
 */
async function answer(compute: ExpertCompute, d: DispatchFrame, y?: (y: Float32Array) => void) {
  const each = d.mode === "each";
  const full = await compute.run({
    layer: d.layer,
    x: d.x as Float32Array,
    k: d.k,
    ids: d.ids,
    w: d.w,
    mode: each ? "each" : "sum",
  });
  const compact = each && d.compact === true;
  const out = compact ? compactSlots(full, d.ids, d.embd) : full;
  y?.(out);
  return {
    t: "result",
    v: 1,
    id: d.id,
    mode: d.mode,
    n: d.n,
    k: d.k,
    embd: d.embd,
    y: out,
    ms: 0.25,
    ...(compact ? { compact: true } : {}),
  } as const;
}

export interface TableEntry {
  layer: number;
  worker: string;
  addr: string;
  fp: string;
  ticket: string;
  exp: number;
  /** The half-open range of expert ids this entry's worker serves for the layer (phase 2). */
  experts?: [number, number];
  /** A replica of the entry's range (phase 3): failover and hedge target. */
  alt?: { worker: string; addr: string; fp: string; ticket: string; exp: number };
}

export interface NativeTable {
  backbone: string;
  deadlineMs: number;
  /** A primary silent this long races its alt (phase 3). */
  hedgeMs?: number;
  /** Or adaptively: silent for max(hedgeMinMs, hedgeFactor x its p50). */
  hedgeFactor?: number;
  hedgeMinMs?: number;
  layers: TableEntry[];
}

export interface Receipts {
  seq: number;
  counts: { worker: string; layer: number; splits: number; tokens: number; expertTokens: number }[];
  /** Layers split over several workers: splits and tokens once per split. */
  layers?: { layer: number; splits: number; tokens: number }[];
  failures: { worker: string; code: string; msg: string; failover?: boolean }[];
  hedges?: number;
  hedgeWins?: number;
  /** The router's choices in the native splits: per layer, each expert's filled slots. */
  routing?: { layer: number; experts: number[]; counts: number[] }[];
}

export interface StandInBridge extends AsyncDisposable {
  readonly address: string;
  /** Dispatches the bridge answered, in order. */
  readonly dispatches: { layer: number; n: number }[];
  readonly hellos: { pid: number }[];
  readonly receipts: Receipts[];
  /** Pushed to every connection that said native-hello, now and on each later hello (null: none). */
  setTable(table: NativeTable | null): void;
}

/**
 * delayMs: each answer waits this long first (a floor under the decode's length). legacy: a bridge
 * older than the native plane, which answers native-hello as any unknown frame type: a
 * connection-level error (no id) MOESWARM_PROTOCOL_UNKNOWN_TYPE, the connection left open.
 */
export async function startBridge(
  path: string,
  compute: ExpertCompute,
  options: { delayMs?: number; legacy?: boolean } = {},
): Promise<StandInBridge> {
  const delayMs = options.delayMs ?? 0;
  const dispatches: { layer: number; n: number }[] = [];
  const hellos: { pid: number }[] = [];
  const receipts: Receipts[] = [];
  const native = new Set<Socket>();
  let table: NativeTable | null = null;
  let seq = 0;
  const push = (s: Socket) => {
    if (table) s.write(prefixed(encode({ v: 1, t: "native-table", seq: ++seq, ...table })));
  };
  // one answer at a time per connection, in order, as the plugin waits for each
  const server: Server = createServer((socket) => {
    let chain = Promise.resolve();
    frameReader(socket, (payload) => {
      const m = decode(payload) as { t: string } & Record<string, unknown>;
      if (m.t === "native-hello") {
        hellos.push({ pid: m.pid as number });
        if (options.legacy) {
          // as late as possible: while the first split waits for its answer
          const msg = "unknown frame type native-hello";
          setTimeout(
            () => sendFrame(socket, { t: "error", v: 1, code: "MOESWARM_PROTOCOL_UNKNOWN_TYPE", msg }),
            50,
          );
          return;
        }
        native.add(socket);
        push(socket);
        return;
      }
      if (m.t === "native-receipts") {
        receipts.push(m as unknown as Receipts);
        return;
      }
      const d = decodeFrame(payload) as DispatchFrame;
      dispatches.push({ layer: d.layer, n: d.n });
      chain = chain.then(async () => {
        if (delayMs > 0) await new Promise((resolve) => setTimeout(resolve, delayMs));
        sendFrame(socket, await answer(compute, d));
      });
    });
    socket.on("close", () => native.delete(socket));
    socket.on("error", () => {});
  });
  await new Promise<void>((resolve) => server.listen(path, resolve));
  return {
    address: `unix:${path}`,
    dispatches,
    hellos,
    receipts,
    setTable(t) {
      table = t;
      if (t) for (const s of native) push(s);
    },
    async [Symbol.asyncDispose]() {
      for (const s of native) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

/** How the stand-in worker behaves. */
export type WorkerMode = "ok" | "refuse-hello" | "error-frame" | "invalid" | "nan" | "silent";

export interface StandInWorker extends AsyncDisposable {
  readonly addr: string;
  readonly fingerprint: string;
  /** TCP connections accepted (dials, whether their TLS and hello succeeded or not). */
  connections: number;
  /** Links (TLS up) that have closed since: by the plugin, or by the stand-in on a bad or refused hello. */
  closed: number;
  /** Hellos seen: their id and token. */
  readonly hellos: { id: string; token: string }[];
  /** Per layer: dispatches answered with a result, and their filled slots (ids != -1). */
  readonly served: Map<number, { splits: number; tokens: number; expertTokens: number }>;
  mode: WorkerMode;
  /** Set: `mode` applies to this dispatch only (1-based, counted over the worker's dispatches); "ok" to the rest. */
  failOn?: number;
  /** Every dispatch received, in order: its layer, mode, compact flag and ids. */
  readonly dispatches: { layer: number; mode: string; compact: boolean; n: number; ids: number[] }[];
  /** Called with the number of results answered so far, including this one, before it is written. */
  onAnswer?: (n: number) => void;
  /** Each answer waits this long first (a stalled worker; answers stay in order on a connection). */
  delayMs: number;
  /** Set: only this dispatch (1-based) waits delayMs. */
  delayOn?: number;
}

export async function startWorker(
  cert: { cert: string; key: string },
  compute: ExpertCompute,
  mode: WorkerMode,
): Promise<StandInWorker> {
  const served = new Map<number, { splits: number; tokens: number; expertTokens: number }>();
  const sockets = new Set<TLSSocket>();
  const w = {
    addr: "",
    fingerprint: new X509Certificate(cert.cert).fingerprint256,
    connections: 0,
    closed: 0,
    hellos: [] as { id: string; token: string }[],
    served,
    mode,
    failOn: undefined as number | undefined,
    dispatches: [] as StandInWorker["dispatches"],
    onAnswer: undefined as ((n: number) => void) | undefined,
    delayMs: 0,
    delayOn: undefined as number | undefined,
  };
  let answered = 0;
  const server = createTlsServer({ cert: cert.cert, key: cert.key, minVersion: "TLSv1.2" }, (socket) => {
    sockets.add(socket);
    socket.on("close", () => {
      sockets.delete(socket);
      w.closed++;
    });
    socket.on("error", () => {});
    let hello = false;
    let chain = Promise.resolve();
    frameReader(socket, (payload) => {
      const f = decodeFrame(payload);
      if (!hello) {
        if (f.t !== "hello") return void socket.destroy();
        w.hellos.push({ id: f.id, token: f.token });
        if (w.mode === "refuse-hello") {
          sendFrame(socket, {
            t: "error",
            v: 1,
            code: "MOESWARM_AUTH_TICKET_INVALID",
            msg: "not this ticket",
          });
          return void socket.end();
        }
        hello = true;
        sendFrame(socket, {
          t: "hello",
          v: 1,
          role: "backbone",
          id: f.id,
          token: "",
          caps: { maxFrame: 1 << 26 },
        });
        return;
      }
      if (f.t !== "dispatch") return;
      w.dispatches.push({
        layer: f.layer,
        mode: f.mode,
        compact: f.compact === true,
        n: f.n,
        ids: [...f.ids],
      });
      const mode = w.failOn === undefined || w.failOn === w.dispatches.length ? w.mode : "ok";
      if (mode === "silent") return;
      if (mode === "error-frame") {
        sendFrame(socket, { t: "error", v: 1, id: f.id, code: "MOESWARM_WORKER_DRAINING", msg: "draining" });
        return;
      }
      if (mode === "invalid") {
        // what a worker says to a frame it cannot serve: a replica would say the same
        sendFrame(socket, {
          t: "error",
          v: 1,
          id: f.id,
          code: "MOESWARM_INVALID_ARGUMENT",
          msg: "not served",
        });
        return;
      }
      const nth = w.dispatches.length;
      chain = chain.then(async () => {
        if (w.delayMs > 0 && (w.delayOn === undefined || w.delayOn === nth)) {
          await new Promise((resolve) => setTimeout(resolve, w.delayMs));
        }
        const r = await answer(compute, f, (y) => {
          if (mode === "nan") y[y.length - 1] = Number.NaN;
        });
        if (mode === "ok") {
          const s = served.get(f.layer) ?? { splits: 0, tokens: 0, expertTokens: 0 };
          s.splits++;
          s.tokens += f.n;
          s.expertTokens += f.ids.reduce((a, id) => a + (id !== -1 ? 1 : 0), 0);
          served.set(f.layer, s);
          w.onAnswer?.(++answered);
        }
        sendFrame(socket, r);
      });
    });
  });
  server.on("connection", () => {
    w.connections++;
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as { port: number }).port;
  w.addr = `127.0.0.1:${port}`;
  return Object.assign(w, {
    async [Symbol.asyncDispose]() {
      for (const s of sockets) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  });
}

/** A throwaway self-signed P-256 certificate (the openssl CLI, as relay-client's selfSignedCertificate). */
export async function selfSigned(): Promise<{ cert: string; key: string }> {
  const dir = await mkdtemp(join(tmpdir(), "mswn-cert-"));
  try {
    const key = join(dir, "key.pem");
    const cert = join(dir, "cert.pem");
    await new Promise<void>((resolve, reject) =>
      execFile(
        "openssl",
        ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"].concat([
          "-keyout",
          key,
          "-out",
          cert,
          "-days",
          "1",
          "-subj",
          "/CN=moeswarm-worker",
        ]),
        (e) => (e ? reject(e) : resolve()),
      ),
    );
    return { cert: await readFile(cert, "utf8"), key: await readFile(key, "utf8") };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

export interface PluginRun {
  ok: boolean;
  tokens: number[];
  logits: Buffer;
  stderr: string;
  plugin: {
    splits: number;
    failures: number;
    native: {
      splits: number;
      fallbacks: number;
      failovers: number;
      hedges: number;
      hedgeWins: number;
      roundTripP50Us: number;
      overheadP50Us: number;
      receipts: number;
      receiptsDeferred: number;
      failures: Record<string, number>;
    };
  } | null;
}

/** llama-logits greedy decoding, plain (no bridge) or with the plugin on `bridge`. */
export async function runLogits(opts: {
  model: string;
  dir: string;
  name: string;
  nPredict: number;
  bridge?: string;
  env?: Record<string, string>;
}): Promise<PluginRun> {
  const bins = llamaCppBinsDir();
  const logitsPath = join(opts.dir, `${opts.name}.bin`);
  const args = ["--model", opts.model, "--quiet", "--bins", bins, "--prompt", "The swarm computes"];
  args.push("--n-predict", String(opts.nPredict), "--logits", logitsPath, "--threads", "1");
  const env: Record<string, string | undefined> = { ...process.env, LD_LIBRARY_PATH: bins };
  for (const k of Object.keys(env)) if (k.startsWith("MOESWARM_") || k === "GGML_BACKEND_PATH") delete env[k];
  if (opts.bridge) {
    Object.assign(env, {
      GGML_BACKEND_PATH: prebuiltPath("linux-x64", "libggml-moeswarm.so"),
      MOESWARM_BRIDGE: opts.bridge,
      MOESWARM_LAYERS: "all",
      MOESWARM_MODEL: "native-test",
      MOESWARM_TIMEOUT_MS: "30000",
    });
  }
  Object.assign(env, opts.env);
  const child = spawn(prebuiltPath("linux-x64", "llama-logits"), args, {
    env,
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stdout = "";
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (d: string) => {
    stdout += d;
  });
  child.stderr.setEncoding("utf8").on("data", (d: string) => {
    stderr = (stderr + d).slice(-32_768);
  });
  const code = await new Promise<number | null>((resolve) => child.once("close", resolve));
  const line = stdout.trim().split("\n").pop() ?? "";
  let parsed: Omit<PluginRun, "logits" | "stderr">;
  try {
    parsed = JSON.parse(line);
  } catch {
    throw new Error(`llama-logits exited with ${code} without its JSON line:\n${stderr.slice(-4000)}`);
  }
  const logits = existsSync(logitsPath) ? readFileSync(logitsPath) : Buffer.alloc(0);
  return { ...parsed, ok: parsed.ok && code === 0, logits, stderr };
}

// the backbone tests' model cache: the same synthetic model, made once per machine
const MODEL_CACHE = process.env.MOESWARM_CACHE_DIR ?? join(tmpdir(), "moeswarm-backbone-test-models");

/** The first byte where a and b differ, or -1. */
export function firstByteDiff(a: Uint8Array, b: Uint8Array): number {
  const n = Math.min(a.byteLength, b.byteLength);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.byteLength === b.byteLength ? -1 : n;
}

/** What the native plugin tests share: the model, every expert's compute, two identities, the plain run. */
export interface WholeSliceSetUp {
  model: string;
  layers: number[];
  nExpert: number;
  /** Every expert of every layer, on llama-cpu: the CPU backend llama.cpp itself computes with, so
   * every answer has plain llama.cpp's bits. */
  compute: ExpertCompute;
  certs: [{ cert: string; key: string }, { cert: string; key: string }];
  /** Plain llama.cpp's run of nPredict tokens, which every swarm run must equal. */
  plain: PluginRun;
}

export async function setUpWholeSlice(dir: string, nPredict: number): Promise<WholeSliceSetUp> {
  const model = (await ensureSyntheticModel("small", { cacheDir: MODEL_CACHE })).path;
  const layout = findExpertTensors(await readGguf(model));
  const layers = layout.layers.map((l) => l.layer);
  const nExpert = layout.layers[0]!.nExpert;
  const slicePath = join(dir, "all.gguf");
  const slice = await sliceExperts(model, { layers, experts: [...Array(nExpert).keys()] });
  await slice.write(slicePath);
  await slice.close();
  const compute = await loadExpertCompute(slicePath, { backend: "llama-cpu", threads: 1 });
  const certs = (await Promise.all([selfSigned(), selfSigned()])) as WholeSliceSetUp["certs"];
  const plain = await runLogits({ model, dir, name: "plain", nPredict });
  return { model, layers, nExpert, compute, certs, plain };
}

// `roundtrip`: one remote layer's round trip through each path the product has, next to the
// floors of such paths measured in the same run. Product paths (@moeswarm/relay-client in this
// process as the backbone, an echo worker in its own process that computes nothing, so the whole
// round trip is overhead): "relay" (through a hub's relay in a third process: createHub, as
// moeswarm-hub runs it, with its metrics, market and placement observers) and "direct" (a
// WebSocket to the worker). Floors: a C echo over a Unix socket and loopback TCP (compiled with cc
// into .cache when cc exists), a Node TCP echo, a Node WebSocket echo (the direct floor) and a
// blind Node WebSocket relay that forwards bytes unread (the relay floor); and the relay over TLS,
// as the hub serves it, against the blind relay over TLS (stock ws clients). The frames are the
// product's own dispatch frames (f32, n_embd 3072, k 8, mode "sum") at 1, 8 and 64 tokens. With the
// native addon and moeswarm-native-ping built, also "native": the plugin's TLS client -> the
// worker's native listener computing a real slice (roundtrip-native.ts), timed above its compute.
// Last, a soak: 3 x 2000 more relay round trips at 64 tokens, the backbone's, the relay's and the
// worker's CPU per round trip in each window (a storm of full garbage collections shows as a
// climb; core frame-heap.ts). The goals' ratios (each product path over its floor, the direct
// link over TLS included) come from interleaved passes: their median, each pass's in a row. A
// "codec chain" over TLS (the blind relay and its ends doing only the protocol's encoding,
// validation and decoding; roundtrip-peer.ts) splits the relay's ratio into what that work costs
// and what the product's own plumbing adds.
import { type ChildProcess, spawnSync } from "node:child_process";
import { generateKeyPairSync, randomBytes, X509Certificate } from "node:crypto";
import { existsSync, mkdirSync, statSync } from "node:fs";
import { connect, type Socket } from "node:net";
import { fileURLToPath } from "node:url";
import {
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  isMoeswarmError,
  PROTOCOL_VERSION,
  sleep,
} from "@moeswarm/core";
import { mintToken } from "@moeswarm/hub";
import {
  connectRelay,
  DirectTransport,
  type DispatchRequest,
  dialWebSocket,
  directKeyJson,
  type RelayConnection,
  RelayTransport,
  selfSignedCertificate,
  signDirectTicket,
} from "@moeswarm/relay-client";
import type { Benchmark, Row } from "../harness.js";
import { cpuTime, spawnPeer as forkPeer, stopChildren } from "./children.js";
import { perfUnavailable, recordProcesses, splitLine } from "./perf-split.js";
import { type Pinner, pinner } from "./pinning.js";
import { goalLines } from "./roundtrip-goals.js";
import { type EchoSample, type NativeMeasure, type NativePath, startNativePath } from "./roundtrip-native.js";
import { dialFloor, encodedSender } from "./ws-floor.js";

const EMBD = 3072;
const K = 8;
const MODEL = "bench-moe";
const MAX = 64 * 1024 * 1024;
// MOESWARM_BENCH_ROUNDTRIP_TOKENS="8" measures one size only (investigating one frame size)
const TOKENS = tokenCounts(process.env.MOESWARM_BENCH_ROUNDTRIP_TOKENS);
const SAMPLE_MS = Number(process.env.MOESWARM_BENCH_ROUNDTRIP_MS ?? 1500);
const MAX_SAMPLES = 2000;
// interleaved passes per goal pair: a goal's ratio is their median, and each pass's is shown
const PASSES = Math.max(1, Math.floor(Number(process.env.MOESWARM_BENCH_ROUNDTRIP_PASSES ?? 3)) || 1);

const here = (name: string) => fileURLToPath(new URL(name, import.meta.url));
const spawnPeer = (file: string, args: { mode: string; [more: string]: unknown }) =>
  forkPeer(here(file), args);
const CACHE = fileURLToPath(new URL("../../../.cache/bench/", import.meta.url));

interface Spread {
  p10: number;
  p50: number;
  p90: number;
}

function tokenCounts(value: string | undefined): number[] {
  if (value === undefined || value.trim() === "") return [1, 8, 64];
  const counts = value.split(",").map((s) => Number(s.trim()));
  if (counts.some((n) => !Number.isInteger(n) || n < 1 || n > 4096)) {
    throw new Error(`MOESWARM_BENCH_ROUNDTRIP_TOKENS must list token counts in 1..4096, got ${value}`);
  }
  return counts;
}

function spreadOf(us: number[]): Spread {
  us.sort((a, b) => a - b);
  const at = (p: number) => us[Math.min(us.length - 1, Math.floor((p / 100) * us.length))]!;
  return { p10: at(10), p50: at(50), p90: at(90) };
}

async function timeOne(fn: () => Promise<unknown>, into: number[]): Promise<void> {
  const t0 = process.hrtime.bigint();
  await fn();
  into.push(Number(process.hrtime.bigint() - t0) / 1000);
}

/**
 * Paths timed in turn, one round trip each, for SAMPLE_MS (a product path and its floor, or a
 * product path and two floors): on a shared machine, load that comes and goes falls on all of
 * them alike, which separate blocks of samples (`spread`) do not promise. The p50 of each.
 */
async function interleaved(paths: ReadonlyArray<() => Promise<unknown>>): Promise<number[]> {
  for (let i = 0; i < 30; i++) for (const trip of paths) await trip();
  const us = paths.map((): number[] => []);
  const end = performance.now() + SAMPLE_MS;
  while ((us[0]!.length < 50 || performance.now() < end) && us[0]!.length < MAX_SAMPLES) {
    for (let j = 0; j < paths.length; j++) await timeOne(paths[j]!, us[j]!);
  }
  return us.map((samples) => spreadOf(samples).p50);
}

/**
 * `interleaved` PASSES times over; `ratios` names the ratios wanted, as [name, numerator path,
 * denominator path]: each pass's, and their median. One pass can land on a stretch where the
 * machine's other tenants take a core; the median of several does not hang on one.
 */
async function interleavedPasses(
  paths: ReadonlyArray<() => Promise<unknown>>,
  ratios: ReadonlyArray<readonly [string, number, number]>,
): Promise<Array<{ name: string; passes: number[]; median: number }>> {
  const p50s: number[][] = [];
  for (let i = 0; i < PASSES; i++) p50s.push(await interleaved(paths));
  return ratios.map(([name, over, under]) => {
    const passes = p50s.map((p) => p[over]! / p[under]!);
    const sorted = [...passes].sort((x, y) => x - y);
    return { name, passes, median: sorted[sorted.length >> 1]! };
  });
}

const CPU_TRIPS = 200;
/** The soak: relay round trips at 64 tokens, in windows, after everything else. */
const SOAK_WINDOWS = 3;
const SOAK_TRIPS = 2000;

/**
 * CPU microseconds one round trip of `fn` costs in this process (the backbone) and in each of
 * `children` (the path's other processes), in that order: the work a path does, which load on a
 * shared machine inflates far less than it inflates the time a round trip waits.
 */
async function cpuPerTrip(
  children: readonly ChildProcess[],
  fn: () => Promise<unknown>,
  trips = CPU_TRIPS,
): Promise<number[]> {
  const each = async () => {
    const us = [ownCpuTime()];
    for (const child of children) us.push(await cpuTime(child));
    return us;
  };
  const before = await each();
  for (let i = 0; i < trips; i++) await fn();
  return (await each()).map((us, i) => (us - before[i]!) / trips);
}

const sum = (values: readonly number[]) => values.reduce((a, b) => a + b, 0);

/** This process's CPU time so far (user + system, microseconds). */
function ownCpuTime(): number {
  const { user, system } = process.cpuUsage();
  return user + system;
}

/**
 * The relay path at 64 tokens for SOAK_WINDOWS x SOAK_TRIPS round trips: the backbone's (this
 * process), the relay's and the worker's CPU per round trip in each window. A process whose heap
 * is not sized for large frames (core frame-heap.ts) climbs to 2-4x its first window's within a
 * few thousand of them. One window's worth of round trips runs first, untimed: a run without
 * 64-token rounds before the soak would otherwise time their warm-up in its first window (1.3-2x
 * the later ones' CPU): V8 optimizing the large-frame code (it optimizes a function called once
 * per message only after some thousands of calls: its tier-up budget counts the bytecode it ran;
 * the relay's first 1000 such trips saw 53 optimizations and 49 deoptimizations, its third 3) and
 * the C heap growing to hold the frames.
 */
async function soak(
  rows: Row[],
  ratios: Record<string, number>,
  processes: readonly [relay: ChildProcess, worker: ChildProcess],
  trip: () => Promise<unknown>,
): Promise<void> {
  for (let i = 0; i < SOAK_TRIPS; i++) await trip();
  const windows: number[][] = [];
  for (let w = 0; w < SOAK_WINDOWS; w++) {
    windows.push(await cpuPerTrip(processes, trip, SOAK_TRIPS));
    const path = `soak: CPU per round trip, backbone / relay / worker, trips ${(w + 1) * SOAK_TRIPS}-${(w + 2) * SOAK_TRIPS}`;
    rows.push({ path, tokens: 64, "CPU us": windows[w]!.map((us) => us.toFixed(0)).join(" / ") });
  }
  const [first, last] = [windows[0]!, windows[windows.length - 1]!];
  ["backbone", "relay", "worker"].forEach((who, i) => {
    ratios[`soak: ${who} CPU per round trip, last/first window, 64 tok`] = last[i]! / first[i]!;
  });
}

/** Microsecond p10/p50/p90 of one-at-a-time round trips of `fn`, for SAMPLE_MS after a warm-up. */
async function spread(fn: () => Promise<unknown>): Promise<Spread> {
  for (let i = 0; i < 30; i++) await fn();
  const us: number[] = [];
  const end = performance.now() + SAMPLE_MS;
  while ((us.length < 50 || performance.now() < end) && us.length < MAX_SAMPLES) await timeOne(fn, us);
  return spreadOf(us);
}

function request(n: number): DispatchRequest {
  const x = new Float32Array(n * EMBD).map((_, i) => Math.sin(i));
  const ids = new Int32Array(n * K).map((_, i) => i % 8);
  const w = new Float32Array(n * K).fill(1 / K);
  return { model: MODEL, layer: 0, n, embd: EMBD, x, k: K, ids, w, mode: "sum" };
}

/** The dispatch frame's bytes as the backbone sends them (what the floors carry). */
function frameBytes(req: DispatchRequest): Uint8Array {
  return encodeFrame(dispatchFrame({ id: 1, to: "echo", dtype: "f32", ...req } as never));
}

/** The C echo, compiled into .cache/bench when cc exists; undefined otherwise. */
function cEcho(): string | undefined {
  const src = here("roundtrip-echo.c");
  const bin = `${CACHE}roundtrip-echo`;
  if (existsSync(bin) && statSync(bin).mtimeMs >= statSync(src).mtimeMs) return bin;
  if (spawnSync("cc", ["--version"]).status !== 0) return undefined;
  mkdirSync(CACHE, { recursive: true });
  const built = spawnSync("cc", ["-O2", "-o", bin, src], { stdio: "inherit" });
  return built.status === 0 ? bin : undefined;
}

function cFloor(bin: string, kind: "unix" | "tcp", bytes: number): Spread {
  const out = spawnSync(bin, [kind, String(bytes), String(bytes), "2000"], { encoding: "utf8" });
  const [p10, p50, p90] = out.stdout.trim().split(/\s+/).map(Number);
  if (out.status !== 0 || p50 === undefined || !Number.isFinite(p50))
    throw new Error(`C echo failed: ${out.stderr}`);
  return { p10: p10!, p50, p90: p90! };
}

/** One length-prefixed round trip at a time over a Node TCP socket. */
async function tcpClient(port: number): Promise<{ trip(bytes: Uint8Array): Promise<void>; close(): void }> {
  const socket: Socket = connect(port, "127.0.0.1");
  await new Promise<void>((resolve, reject) => {
    socket.once("connect", () => resolve());
    socket.once("error", reject);
  });
  socket.setNoDelay(true);
  let want = 0;
  let got = 0;
  let done: (() => void) | undefined;
  socket.on("data", (chunk: Buffer) => {
    got += chunk.byteLength;
    if (got >= want && done) done();
  });
  return {
    trip(bytes) {
      const head = Buffer.alloc(4);
      head.writeUInt32LE(bytes.byteLength, 0);
      want = 4 + bytes.byteLength;
      got = 0;
      return new Promise<void>((resolve) => {
        done = resolve;
        socket.write(head);
        socket.write(bytes);
      });
    },
    close: () => socket.destroy(),
  };
}

async function wsClient(url: string): Promise<{ trip(bytes: Uint8Array): Promise<void>; close(): void }> {
  const ws = await dialFloor(url);
  let done: (() => void) | undefined;
  ws.on("message", () => done?.());
  return {
    trip: (bytes) =>
      new Promise<void>((resolve) => {
        done = resolve;
        ws.send(bytes);
      }),
    close: () => ws.close(),
  };
}

/**
 * The codec chain's backbone over TLS (roundtrip-peer.ts `codec`): each trip encodes the dispatch
 * into reused memory, sends it with a zero mask and decodes the result, as relay-client does.
 */
async function codecClient(
  url: string,
): Promise<{ trip(req: DispatchRequest): Promise<void>; close(): void }> {
  const ws = await dialFloor(url, true);
  const send = encodedSender(ws);
  let done: (() => void) | undefined;
  ws.on("message", (data: Buffer) => {
    decodeFrame(data, { maxFrameBytes: MAX });
    done?.();
  });
  return {
    trip: (req) =>
      new Promise<void>((resolve) => {
        done = resolve;
        // a literal frame, as relay-client builds it: the encoder validates it once (a builder
        // would validate it a second time, work the product's client does not do)
        send({ t: "dispatch", v: PROTOCOL_VERSION, id: 1, to: "echo", dtype: "f32", ...req } as never);
      }),
    close: () => ws.close(),
  };
}

interface TlsRelayPaths {
  /** The product: relay-client -> the hub's relay over TLS -> the echo worker. */
  relay: RelayConnection;
  /** The floor: stock ws clients through the blind relay over TLS. */
  blind: { trip(bytes: Uint8Array): Promise<void>; close(): void };
  /** The codec chain over TLS: the blind relay and its worker doing the protocol's codec work. */
  codec: { trip(req: DispatchRequest): Promise<void>; close(): void };
  /** Each chain's relay and worker processes (its backbone is this process). */
  processes: Record<"relay" | "blind" | "codec", [relay: ChildProcess, worker: ChildProcess]>;
  children: ChildProcess[];
}

/**
 * The relay as it is deployed (wss, the hub's certificate) and its floor over TLS too. The
 * relay's certificate is `tls`, self-signed: the product's clients pin it, the floor's trust it.
 */
async function startTlsRelayPaths(
  secret: string,
  tls: { cert: string; key: string },
  backbone: { role: "backbone"; id: string; maxFrameBytes: number; token: string },
  workerToken: string,
): Promise<TlsRelayPaths> {
  const pin = new X509Certificate(tls.cert).fingerprint256;
  const relayPeer = await spawnPeer("relay-peer.ts", { mode: "hub", secret, tls });
  const children = [relayPeer.child];
  const worker = await spawnPeer("relay-peer.ts", {
    mode: "worker",
    relayUrl: relayPeer.info.url,
    token: workerToken,
    model: MODEL,
    pin,
  });
  children.push(worker.child);
  const relay = await connectRelay(relayPeer.info.url!, {
    ...backbone,
    dial: (url, o) => dialWebSocket(url, { ...o, pin }),
  });
  await untilRegistered(relay);
  const blindRelay = await spawnPeer("roundtrip-peer.ts", { mode: "blind-relay", ...tls });
  children.push(blindRelay.child);
  const url = `wss://127.0.0.1:${blindRelay.info.port}`;
  const blindWorker = await spawnPeer("roundtrip-peer.ts", { mode: "blind-worker", url: `${url}/worker` });
  children.push(blindWorker.child);
  const codecRelay = await spawnPeer("roundtrip-peer.ts", { mode: "blind-relay", codec: true, ...tls });
  children.push(codecRelay.child);
  const codecUrl = `wss://127.0.0.1:${codecRelay.info.port}`;
  const codecWorker = await spawnPeer("roundtrip-peer.ts", {
    mode: "blind-worker",
    codec: true,
    url: `${codecUrl}/worker`,
  });
  children.push(codecWorker.child);
  const blind = await wsClient(`${url}/backbone`);
  return {
    relay,
    blind,
    codec: await codecClient(`${codecUrl}/backbone`),
    processes: {
      relay: [relayPeer.child, worker.child],
      blind: [blindRelay.child, blindWorker.child],
      codec: [codecRelay.child, codecWorker.child],
    },
    children,
  };
}

/**
 * The TLS relay's interleaved group (the product, its codec chain, its blind floor) again with
 * each chain's relay on CPU 1 and its ends on CPU 0; every process is unpinned after.
 */
async function pinnedTlsRelay(
  pins: Pinner,
  paths: TlsRelayPaths,
  [group, wanted]: [Array<() => Promise<unknown>>, Array<[string, number, number]>],
  n: number,
  ratios: Record<string, number>,
): Promise<Row[]> {
  const chains = [paths.processes.relay, paths.processes.codec, paths.processes.blind];
  const pids = [process.pid, ...chains.flat().map((child) => child.pid!)];
  try {
    pins.pin(process.pid, 0);
    for (const [relay, worker] of chains) {
      pins.pin(relay.pid!, 1);
      pins.pin(worker.pid!, 0);
    }
    const rows: Row[] = [];
    for (const { name, passes, median } of await interleavedPasses(group, wanted)) {
      ratios[`${name}, pinned, ${n} tok`] = median;
      rows.push({
        path: `pinned ${name}: ${PASSES} passes`,
        tokens: n,
        "overhead/floor": median,
        passes: passes.map((r) => r.toFixed(2)).join(" "),
      });
    }
    return rows;
  } finally {
    for (const pid of pids) pins.unpin(pid);
  }
}

/**
 * The TLS relay's interleaved group once more, while perf samples each chain's relay and worker:
 * a row per process with its CPU per round trip by where it ran (perf-split.ts).
 */
async function perfRows(
  paths: TlsRelayPaths,
  req: DispatchRequest,
  bytes: Uint8Array,
  n: number,
): Promise<Row[]> {
  const chains: Array<[string, () => Promise<unknown>, readonly ChildProcess[]]> = [
    ["relay (TLS)", () => paths.relay.request("echo", req), paths.processes.relay],
    ["codec chain (TLS)", () => paths.codec.trip(req), paths.processes.codec],
    ["blind relay (TLS)", () => paths.blind.trip(bytes), paths.processes.blind],
  ];
  // each chain's relay and worker, named, with the chain whose trips they served
  const sampled = chains.flatMap(([chain, , [relay, worker]], i) => [
    [`${chain}: relay`, relay!, i] as const,
    [`${chain}: worker`, worker!, i] as const,
  ]);
  const counts = chains.map(() => 0);
  const recording = await recordProcesses(Object.fromEntries(sampled.map(([name, child]) => [name, child])));
  await interleaved(
    chains.map(([, trip], i) => async () => {
      await trip();
      counts[i]!++;
    }),
  );
  const splits = await recording.stop(Object.fromEntries(sampled.map(([name, , i]) => [name, counts[i]!])));
  return Object.entries(splits).map(([name, split]) => ({
    path: `perf: ${name} process, CPU us per round trip`,
    tokens: n,
    "CPU us": splitLine(split),
  }));
}

/** Waits until the relay knows the echo worker (it registers after it connects). */
async function untilRegistered(relay: RelayConnection): Promise<void> {
  for (let i = 0; ; i++) {
    try {
      await relay.request("echo", request(1));
      return;
    } catch (error) {
      if (i > 200 || !isMoeswarmError(error, "MOESWARM_TRANSPORT_UNKNOWN_PEER")) throw error;
      await sleep(10);
    }
  }
}

const fmt = (s: Spread) => `${s.p10.toFixed(0)}-${s.p90.toFixed(0)}`;

/** The goal for the native data plane: at most 0.1 ms above compute. */
const NATIVE_GOAL_US = 100;

/**
 * The native path's rows and ratios at n tokens: its floors (the same TLS client against a TLS
 * echo in C, answering at once and held for the worker's compute) and the path, whose overhead
 * (round trip - the worker's compute) is set against the held echo (the like-for-like floor: the
 * same frames, the same TLS, the same sleep on the client's side) and against the 0.1 ms goal.
 * `cTcp`: the C echo's TCP floor, when measured.
 */
function nativeRows(
  n: number,
  kb: number,
  m: NativeMeasure,
  cTcp: Spread | undefined,
  ratios: Record<string, number>,
): Row[] {
  const s = m.native;
  ratios[`native above compute/0.1 ms goal, ${n} tok`] = s.aboveComputeP50 / NATIVE_GOAL_US;
  ratios[`native above compute/TLS echo held floor, ${n} tok`] = s.aboveComputeP50 / m.held.p50;
  if (cTcp) ratios[`TLS echo floor/C echo TCP floor, ${n} tok`] = m.echo.p50 / cTcp.p50;
  const floor = (path: string, e: EchoSample): Row => ({
    path,
    tokens: n,
    "frame KB": kb,
    "p50 us": e.p50,
    "p10-p90 us": fmt(e),
    "overhead us": e.p50,
    "overhead/floor": "",
  });
  return [
    floor("floor: TLS echo in C (the native path's TLS at both ends)", m.echo),
    floor("floor: TLS echo in C held for the compute (less the hold)", m.held),
    {
      path: "product: native (plugin's TLS client -> worker's native listener)",
      tokens: n,
      "frame KB": kb,
      "p50 us": s.p50,
      "p10-p90 us": fmt(s),
      "compute us": s.computeP50,
      // this worker computes: what is above its own `ms` is the path's overhead
      "overhead us": s.aboveComputeP50,
      "overhead/floor": s.aboveComputeP50 / m.held.p50,
    },
  ];
}

export const roundtrip: Benchmark = {
  name: "roundtrip",
  description: `one remote layer's round trip (n_embd ${EMBD}, k ${K}, mode sum) through the relay and direct, next to C/Node/blind-relay floors`,
  async run() {
    const secret = randomBytes(32).toString("hex");
    const children: ChildProcess[] = [];
    const closers: Array<() => unknown> = [];
    try {
      const token = (role: "worker" | "backbone", id: string) => mintToken({ role, id, ttlS: 3600 }, secret);
      const relayPeer = await spawnPeer("relay-peer.ts", { mode: "hub", secret });
      children.push(relayPeer.child);
      // the product's direct path: a TLS endpoint, a pinned certificate, a ticket the "hub" signed
      const tls = await selfSignedCertificate();
      const hubKeys = generateKeyPairSync("ed25519");
      const worker = await spawnPeer("relay-peer.ts", {
        mode: "worker",
        relayUrl: relayPeer.info.url,
        token: token("worker", "echo"),
        model: MODEL,
        direct: { ...tls, hubKey: directKeyJson(hubKeys.publicKey) },
      });
      children.push(worker.child);
      const options = {
        role: "backbone" as const,
        id: "bench",
        maxFrameBytes: MAX,
        token: token("backbone", "bench"),
      };
      const viaRelay: RelayConnection = await connectRelay(relayPeer.info.url!, options);
      const direct: RelayConnection = await connectRelay(worker.info.directUrl!, options);
      const product = new DirectTransport({
        fallback: new RelayTransport(viaRelay),
        id: "bench",
        maxFrameBytes: MAX,
        ticket: async (wk) => {
          const now = Date.now();
          return signDirectTicket(
            { sub: "bench", wk, iat: now, exp: now + 600_000 },
            hubKeys.privateKey,
            hubKeys.publicKey,
          );
        },
      });
      closers.push(
        () => viaRelay.close(),
        () => direct.close(),
        () => product.close(),
      );
      product.update(
        new Map([["echo", { endpoints: [worker.info.tlsUrl!], fingerprint: worker.info.fingerprint! }]]),
      );
      if (!(await product.linked("echo"))) throw new Error("the product's direct link did not come up");
      await untilRegistered(viaRelay);
      const tlsRelay = await startTlsRelayPaths(secret, tls, options, token("worker", "echo"));
      children.push(...tlsRelay.children);
      closers.push(
        () => tlsRelay.relay.close(),
        () => tlsRelay.blind.close(),
        () => tlsRelay.codec.close(),
      );
      const nodeEcho = await spawnPeer("roundtrip-peer.ts", { mode: "node-echo" });
      const wsEcho = await spawnPeer("roundtrip-peer.ts", { mode: "ws-echo" });
      const wssEcho = await spawnPeer("roundtrip-peer.ts", { mode: "wss-echo", ...tls });
      children.push(wssEcho.child);
      const blind = await spawnPeer("roundtrip-peer.ts", { mode: "blind-relay" });
      children.push(nodeEcho.child, wsEcho.child, blind.child);
      const blindWorker = await spawnPeer("roundtrip-peer.ts", {
        mode: "blind-worker",
        url: `ws://127.0.0.1:${blind.info.port}/worker`,
      });
      children.push(blindWorker.child);
      const tcp = await tcpClient(Number(nodeEcho.info.port));
      const wsDirect = await wsClient(`ws://127.0.0.1:${wsEcho.info.port}/`);
      const wssDirect = await wsClient(`wss://127.0.0.1:${wssEcho.info.port}/`);
      closers.push(wssDirect.close);
      const wsBlind = await wsClient(`ws://127.0.0.1:${blind.info.port}/backbone`);
      closers.push(tcp.close, wsDirect.close, wsBlind.close);
      const c = cEcho();
      const native: NativePath | string = await startNativePath({ embd: EMBD, k: K, model: MODEL, tls });
      if (typeof native !== "string") closers.push(() => native.close());

      const rows: Row[] = [];
      const ratios: Record<string, number> = {};
      const pins = pinner();
      const perfOff =
        process.env.MOESWARM_BENCH_PERF === "1" ? perfUnavailable() : "MOESWARM_BENCH_PERF=1 adds them";
      for (const n of TOKENS) {
        const req = request(n);
        const bytes = frameBytes(req);
        const paths: Array<[string, Spread]> = [];
        if (c) {
          paths.push(["floor: C echo, Unix socket", cFloor(c, "unix", bytes.byteLength)]);
          paths.push(["floor: C echo, TCP", cFloor(c, "tcp", bytes.byteLength)]);
        }
        paths.push(["floor: Node echo, TCP", await spread(() => tcp.trip(bytes))]);
        const wsFloor = await spread(() => wsDirect.trip(bytes));
        paths.push(["floor: Node WebSocket echo (direct floor)", wsFloor]);
        const blindFloor = await spread(() => wsBlind.trip(bytes));
        paths.push(["floor: blind Node relay (relay floor)", blindFloor]);
        const wssFloor = await spread(() => wssDirect.trip(bytes));
        paths.push(["floor: Node WebSocket echo over TLS (direct TLS floor)", wssFloor]);
        const directPath = await spread(() => direct.request("echo", req));
        paths.push(["product: direct (relay-client -> worker)", directPath]);
        const call = { signal: new AbortController().signal, deadlineMs: 30_000 };
        const expertReq = { ...req, dtype: "f32" as const, x: req.x as Float32Array };
        const linkPath = await spread(() => product.request("echo", expertReq, call));
        paths.push(["product: direct link (DirectTransport -> serveDirect, TLS)", linkPath]);
        const relayPath = await spread(() => viaRelay.request("echo", req));
        paths.push(["product: relay (relay-client -> hub relay -> worker)", relayPath]);
        const blindTlsFloor = await spread(() => tlsRelay.blind.trip(bytes));
        paths.push(["floor: blind Node relay over TLS (TLS relay floor)", blindTlsFloor]);
        const codecTls = await spread(() => tlsRelay.codec.trip(req));
        paths.push(["floor: codec chain over TLS (the blind relay validating, its ends encoding)", codecTls]);
        const relayTlsPath = await spread(() => tlsRelay.relay.request("echo", req));
        paths.push(["product: relay over TLS (relay-client -> hub relay, wss -> worker)", relayTlsPath]);
        const cTcp = paths.find(([path]) => path === "floor: C echo, TCP")?.[1];
        // each product path's floor, by the start of its name (the longest prefix first)
        const floors: Array<[string, Spread]> = [
          ["product: relay over TLS", blindTlsFloor],
          ["product: relay", blindFloor],
          ["product: direct link", wssFloor],
          ["product: direct", wsFloor],
        ];
        for (const [path, s] of paths) {
          const floor = floors.find(([prefix]) => path.startsWith(prefix))?.[1];
          rows.push({
            path,
            tokens: n,
            "frame KB": Math.round(bytes.byteLength / 1024),
            "p50 us": s.p50,
            "p10-p90 us": fmt(s),
            // the echo worker computes nothing: the whole round trip is overhead
            "overhead us": s.p50,
            "overhead/floor": floor ? s.p50 / floor.p50 : "",
          });
        }
        const kb = Math.round(bytes.byteLength / 1024);
        if (typeof native !== "string")
          rows.push(...nativeRows(n, kb, await native.measure(n), cTcp, ratios));
        ratios[`relay/blind-relay floor, ${n} tok`] = relayPath.p50 / blindFloor.p50;
        ratios[`direct/Node ws floor, ${n} tok`] = directPath.p50 / wsFloor.p50;
        ratios[`direct link (TLS)/Node wss floor, ${n} tok`] = linkPath.p50 / wssFloor.p50;
        ratios[`direct link (TLS)/relay, ${n} tok`] = linkPath.p50 / relayPath.p50;
        if (c) ratios[`relay/C unix floor, ${n} tok`] = relayPath.p50 / paths[0]![1].p50;
        ratios[`relay (TLS)/blind relay (TLS) floor, ${n} tok`] = relayTlsPath.p50 / blindTlsFloor.p50;
        // the TLS relay, its codec chain and its blind floor in one interleaving: the two
        // ratios that split the first come from the same samples
        const groups: Array<[Array<() => Promise<unknown>>, Array<[string, number, number]>]> = [
          [
            [() => viaRelay.request("echo", req), () => wsBlind.trip(bytes)],
            [["relay/blind-relay floor", 0, 1]],
          ],
          [
            [
              () => tlsRelay.relay.request("echo", req),
              () => tlsRelay.codec.trip(req),
              () => tlsRelay.blind.trip(bytes),
            ],
            [
              ["relay (TLS)/blind relay (TLS) floor", 0, 2],
              ["codec chain (TLS)/blind relay (TLS) floor", 1, 2],
              ["relay (TLS)/codec chain (TLS)", 0, 1],
            ],
          ],
          [[() => direct.request("echo", req), () => wsDirect.trip(bytes)], [["direct/Node ws floor", 0, 1]]],
          [
            [() => product.request("echo", expertReq, call), () => wssDirect.trip(bytes)],
            [["direct link (TLS)/Node wss floor", 0, 1]],
          ],
        ];
        for (const [group, wanted] of groups) {
          for (const { name, passes, median } of await interleavedPasses(group, wanted)) {
            ratios[`${name}, interleaved, ${n} tok`] = median;
            rows.push({
              path: `interleaved ${name}: ${PASSES} passes`,
              tokens: n,
              "overhead/floor": median,
              passes: passes.map((r) => r.toFixed(2)).join(" "),
            });
          }
        }
        if (typeof pins !== "string") {
          rows.push(...(await pinnedTlsRelay(pins, tlsRelay, groups[1]!, n, ratios)));
        }
        if (perfOff === undefined) rows.push(...(await perfRows(tlsRelay, req, bytes, n)));
        const relayCpu = sum(
          await cpuPerTrip([relayPeer.child, worker.child], () => viaRelay.request("echo", req)),
        );
        const blindCpu = sum(await cpuPerTrip([blind.child, blindWorker.child], () => wsBlind.trip(bytes)));
        ratios[`relay/blind-relay floor, CPU per round trip, ${n} tok`] = relayCpu / blindCpu;
        rows.push(
          { path: "CPU per round trip: relay (3 processes)", tokens: n, "CPU us": relayCpu },
          { path: "CPU per round trip: blind relay (3 processes)", tokens: n, "CPU us": blindCpu },
        );
        // the TLS chains process by process: which of the three carries the product's extra work
        const tlsChains: Array<[string, () => Promise<unknown>, readonly ChildProcess[]]> = [
          ["relay over TLS", () => tlsRelay.relay.request("echo", req), tlsRelay.processes.relay],
          ["codec chain over TLS", () => tlsRelay.codec.trip(req), tlsRelay.processes.codec],
          ["blind relay over TLS", () => tlsRelay.blind.trip(bytes), tlsRelay.processes.blind],
        ];
        for (const [name, trip, processes] of tlsChains) {
          const split = await cpuPerTrip(processes, trip);
          rows.push({
            path: `CPU per round trip, backbone / relay / worker: ${name}`,
            tokens: n,
            "CPU us": split.map((us) => us.toFixed(0)).join(" / "),
          });
        }
      }
      const soakRequest = request(64);
      await soak(rows, ratios, [relayPeer.child, worker.child], () => viaRelay.request("echo", soakRequest));
      return {
        rows,
        ratios,
        notes: [
          ...goalLines(ratios, TOKENS),
          "the relay and direct paths' worker computes nothing (an echo worker), so their overhead = round trip; p50 and p10-p90 of one-at-a-time round trips",
          `goals (issue 15): relay <= 1.2x the blind-relay floor, direct <= 1.2x the Node direct floor${c ? "" : "; no cc: the C floors were not measured"}`,
          "codec chain over TLS: the blind TLS relay and its ends doing the protocol's own work and nothing more (the relay validates each frame, raw, as the hub's does; the worker decodes each dispatch and encodes its result; the client encodes and decodes; encoders' memory reused, zero masks as relay-client sends): 'codec chain (TLS)/blind relay (TLS)' is what that work costs in the running chain, 'relay (TLS)/codec chain (TLS)' what the product's plumbing (auth, routing, request tables, deadlines, rewriting in place) adds to it",
          "relay over TLS: a hub's relay serving wss, as deployed (createHub, as moeswarm-hub runs it: its metrics, market and placement observers see every forwarded dispatch and answer), against the blind relay over TLS with stock ws clients; the product's clients send over TLS with a zero WebSocket mask (nothing to mask or unmask; docs/protocol.md), the floor's with ws's random masks",
          typeof native === "string"
            ? native
            : "native: its worker computes a Q8_0 slice (n_embd 3072, n_ff 256, 16 experts); 'compute us' is the p50 of the results' ms, 'overhead us' the p50 of (round trip - the result's ms), 'overhead/floor' that over the held TLS echo floor (the same client and TLS code against an echo in C that holds each answer busy for the worker's compute p50, less that hold: what encrypting, moving the frames and waking the client cost here); goal (issue 15): <= 0.1 ms above compute",
          `the 'interleaved' ratios time the product path and its floor in turn, one round trip each (load on a shared machine falls on both alike; the TLS relay, its codec chain and its blind floor all three in turn), in ${PASSES} passes of ${SAMPLE_MS} ms: the ratio is the passes' median, the 'interleaved ... passes' rows list each pass's; the others time each path in a block of its own`,
          `'CPU per round trip': user + system CPU time of the path's three processes over ${CPU_TRIPS} round trips, divided by ${CPU_TRIPS}; the 'backbone / relay / worker' rows give it per process for the three TLS chains, each timed in a block of its own`,
          typeof pins === "string"
            ? `no pinned passes: ${pins}`
            : "pinned: the TLS relay, its codec chain and its blind floor interleaved again with each chain's relay on CPU 1 and everything else (this process, the workers) on CPU 0: unpinned, the scheduler moves the three processes of a chain between the CPUs and each move costs one its caches, which weighs most on the process that touches the most code per frame (bench/src/benchmarks/pinning.ts)",
          perfOff === undefined
            ? "perf: the TLS relay, its codec chain and its blind floor interleaved once more (one pass) while Linux perf samples each chain's relay and worker (cpu-clock, 4 kHz): each process's CPU per round trip by where it ran (JavaScript: code V8 compiled; V8 builtins: property access, calls, typed arrays; V8 runtime: the collector and compilers; bench/src/benchmarks/perf-split.ts); perf's own sampling inflates the totals, the split between categories is what to read"
            : `no perf rows: ${perfOff}`,
          `soak: ${SOAK_WINDOWS} x ${SOAK_TRIPS} more relay round trips at 64 tokens, after ${SOAK_TRIPS} untimed ones (the large-frame code's warm-up); the backbone's (this process), the relay's and the worker's CPU per round trip in each window (their heaps sized for frames as the executables size them: core tuneHeapForFrames); last/first near 1 means no collection storm`,
        ],
      };
    } finally {
      for (const close of closers) await close();
      await stopChildren(children);
    }
  },
};

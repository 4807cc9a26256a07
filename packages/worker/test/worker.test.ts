// runWorker in this process against a hub (tiny model): the library's stop paths, a drain sent by
// the relay, options and failures that retrying cannot fix.
import { readFileSync, writeFileSync } from "node:fs";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import {
  decodeFrame,
  encodeFrame,
  type Frame,
  frameAllocatorState,
  isMoeswarmError,
  PROTOCOL_VERSION,
} from "@moeswarm/core";
import { type Hub, mintToken } from "@moeswarm/hub";
import type { TempDir } from "@moeswarm/testkit";
import { loadExpertCompute } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { WebSocketServer } from "ws";
import type { WorkerEvent } from "../src/events.js";
import type { RunWorkerOptions } from "../src/options.js";
import { runWorker } from "../src/run-worker.js";
import { startTestHub } from "./fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-runtime-unit-secret-0123456789";

let hub: Hub;
let url: string;
let work: string;
let workDir: TempDir | undefined;
let modelPath: string;
let n = 0;

const token = (id: string) => mintToken({ role: "worker", id, ttlS: 600 }, SECRET);
const cacheDir = () => join(work, `cache-${n++}`);

beforeAll(async () => {
  ({
    hub,
    url,
    modelPath,
    work: workDir,
  } = await startTestHub({
    secret: SECRET,
    model: MODEL,
    preset: "tiny",
    workPrefix: "moeswarm-run-worker-",
  }));
  work = workDir.dir;
});

afterAll(async () => {
  await hub?.close();
  workDir?.remove();
});

const N = 256;
const EMBD = 64;
const X = Float32Array.from({ length: N * EMBD }, (_, i) => Math.sin(i * 0.37));
const IDS = Int32Array.from({ length: N * 2 }, (_, i) => (i * 5) % 8);
const DISPATCH: Frame = {
  t: "dispatch",
  v: PROTOCOL_VERSION,
  id: 7,
  from: "bb",
  model: MODEL,
  layer: 1,
  n: N,
  embd: EMBD,
  dtype: "f32",
  x: X,
  k: 2,
  ids: IDS,
  mode: "each",
};

/**
 * A stand-in relay: accepts the hello, records what the worker sends, and sends it a `drain`
 * once it registered (the frame a hub sends to take a worker out of service).
 */
async function drainingRelay() {
  const wss = new WebSocketServer({ port: 0, host: "127.0.0.1" });
  await new Promise<void>((r) => wss.once("listening", () => r()));
  const received: Frame[] = [];
  let closed = false;
  wss.on("connection", (ws) => {
    ws.on("message", (data: Buffer) => {
      const frame = decodeFrame(new Uint8Array(data));
      received.push(frame);
      if (frame.t === "hello") {
        ws.send(encodeFrame({ t: "hello", v: PROTOCOL_VERSION, role: frame.role, id: frame.id, token: "" }));
      } else if (frame.t === "register") {
        // one request in flight, then the drain: the worker must still answer it
        ws.send(encodeFrame(DISPATCH));
        setImmediate(() => ws.send(encodeFrame({ t: "drain", v: PROTOCOL_VERSION, reason: "maintenance" })));
      } else if (frame.t === "ping") {
        ws.send(encodeFrame({ t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts }));
      }
    });
    ws.on("close", () => {
      closed = true;
    });
  });
  return {
    url: `ws://127.0.0.1:${(wss.address() as AddressInfo).port}/relay`,
    received,
    closed: () => closed,
    close: () => new Promise<void>((r) => wss.close(() => r())),
  };
}

/** Runs a worker (TypeScript compute) until the stand-in relay drains it; gives its lease back. */
async function runUntilDrained(id: string, dir: string, extra: Partial<RunWorkerOptions> = {}) {
  const relay = await drainingRelay();
  const events: WorkerEvent[] = [];
  try {
    const summary = await runWorker({
      hub: url,
      relay: relay.url,
      token: token(id),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: dir,
      backend: "ts",
      log: (e) => events.push(e),
      pollMs: 50,
      ...extra,
    });
    return { summary, events, received: relay.received, closed: relay.closed() };
  } finally {
    await relay.close();
    // the stand-in relay never told the hub: give the lease back so the next tests find demand
    for (const e of events) {
      if (e.event !== "claimed") continue;
      await fetch(`${url}/api/claims/${e.leaseId}`, {
        method: "DELETE",
        headers: { authorization: `Bearer ${token(id)}` },
      });
    }
  }
}

describe("runWorker", () => {
  it("drains when the relay sends drain: answers what it holds, deregisters, closes and resolves", async () => {
    const { summary, events, received, closed } = await runUntilDrained("wk-drain", cacheDir());
    expect(summary).toMatchObject({ id: "wk-drain", reason: "drain", served: true, backend: "ts" });
    expect(summary.slice).toMatchObject({ model: MODEL, layers: "0:2", experts: "0:8", reused: false });
    expect(received.map((f) => f.t).sort()).toEqual(["drain", "hello", "register", "result"]);
    // the hello says what the TypeScript compute takes: no q8 rows (backbones send it f32 at once)
    const hello = received[0] as Extract<Frame, { t: "hello" }>;
    expect(hello.caps?.dtypes).toEqual(["f32", "f16", "bf16"]);
    const register = received[1] as Extract<Frame, { t: "register" }>;
    expect(register).toMatchObject({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
    expect(closed).toBe(true);
    // the request it held when the drain came was answered, with the bits of a local compute
    const result = received.find((f) => f.t === "result") as Extract<Frame, { t: "result" }>;
    await using local = await loadExpertCompute(modelPath, { backend: "ts" });
    const want = await local.run({ layer: 1, x: X, ids: IDS, k: 2, mode: "each" });
    expect(result.id).toBe(7);
    expect(Buffer.from(result.y.buffer, result.y.byteOffset, result.y.byteLength)).toEqual(
      Buffer.from(want.buffer, want.byteOffset, want.byteLength),
    );
    expect(summary).toMatchObject({ requests: 1, tokens: N, failed: 0 });
    expect(events.find((e) => e.event === "drain")).toMatchObject({ reason: "the hub asked: maintenance" });
    // the TypeScript path says so
    expect(events.find((e) => e.event === "loaded")).toMatchObject({ backend: "ts" });
    expect(hub.status({ model: MODEL }).leases).toEqual([]);
  });

  it("serves through wrapCompute: the wrapper sees every run and its answer is what goes out", async () => {
    const seen: number[] = [];
    const { summary, received } = await runUntilDrained("wk-wrap", cacheDir(), {
      // a liar of the kind the trust tests use: every output scaled by 1.05
      wrapCompute: (inner) => ({
        info: inner.info,
        run: async (request, options) => {
          seen.push(request.layer);
          const y = await inner.run(request, options);
          return y.map((v) => Math.fround(v * 1.05));
        },
        close: () => inner.close(),
        [Symbol.asyncDispose]: () => inner.close(),
      }),
    });
    expect(summary).toMatchObject({ served: true, requests: 1 });
    expect(seen).toEqual([1]);
    const result = received.find((f) => f.t === "result") as Extract<Frame, { t: "result" }>;
    await using local = await loadExpertCompute(modelPath, { backend: "ts" });
    const honest = await local.run({ layer: 1, x: X, ids: IDS, k: 2, mode: "each" });
    expect(Array.from(result.y as Float32Array)).toEqual(Array.from(honest, (v) => Math.fround(v * 1.05)));
  });

  it("refuses a wrapCompute that is not a function", async () => {
    const error = await runWorker({
      hub: url,
      token: token("wk-bad-wrap"),
      capacity: { ramBytes: 1 },
      cacheDir: cacheDir(),
      wrapCompute: 42 as never,
    }).catch((e: unknown) => e);
    expect(isMoeswarmError(error, "MOESWARM_INVALID_ARGUMENT")).toBe(true);
  });

  it("re-verifies a cached slice before reusing it: a corrupt one is deleted and downloaded again", async () => {
    const dir = cacheDir();
    const first = await runUntilDrained("wk-cache", dir);
    const path = first.summary.slice?.path as string;
    const clean = await runUntilDrained("wk-cache", dir);
    expect(clean.summary).toMatchObject({ downloadedBytes: 0, slice: { reused: true } });
    expect(clean.events.some((e) => e.event === "download-start")).toBe(false);
    // flip one byte of the last expert's down projection on disk
    const original = readFileSync(path);
    const bytes = Buffer.from(original);
    bytes[bytes.length - 10] = (bytes[bytes.length - 10] as number) ^ 1;
    writeFileSync(path, bytes);
    const healed = await runUntilDrained("wk-cache", dir);
    const steps = healed.events
      .map((e) => e.event)
      .filter((e) => ["corrupt", "downloaded", "verified"].includes(e));
    expect(steps).toEqual(["corrupt", "downloaded", "verified"]);
    expect(healed.events.find((e) => e.event === "corrupt")).toMatchObject({ reused: true, expert: 7 });
    expect(healed.summary).toMatchObject({ served: true, slice: { reused: false } });
    expect(healed.summary.downloadedBytes).toBe(bytes.length);
    expect(readFileSync(path).equals(original)).toBe(true);
  });

  it("stops before serving when its signal aborts, and gives its lease back", async () => {
    const controller = new AbortController();
    const events: WorkerEvent[] = [];
    const summary = await runWorker({
      hub: url,
      token: token("wk-stop"),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: cacheDir(),
      signal: controller.signal,
      log: (e) => {
        events.push(e);
        if (e.event === "claimed") controller.abort("test stop");
      },
    });
    expect(summary).toMatchObject({ reason: "signal", served: false, requests: 0 });
    expect(events.map((e) => e.event)).toContain("lease-released");
    expect(events.at(-1)).toMatchObject({ event: "stopped", reason: "test stop" });
    expect(hub.status({ model: MODEL }).leases.filter((l) => l.worker === "wk-stop")).toEqual([]);
  });

  it("returns at once for an already aborted signal", async () => {
    const events: WorkerEvent[] = [];
    const summary = await runWorker({
      hub: url,
      token: token("wk-aborted"),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: cacheDir(),
      signal: AbortSignal.abort(),
      log: (e) => events.push(e),
    });
    expect(summary.served).toBe(false);
    expect(events.map((e) => e.event)).toEqual(["start", "stopped"]);
    // the start says how this process's malloc is set (docs/deploy.md, "Memory allocator")
    expect(events[0]).toMatchObject({ event: "start", malloc: frameAllocatorState(process.env) });
  });

  it("keeps retrying a hub it cannot reach, and stops when told", async () => {
    const controller = new AbortController();
    const events: WorkerEvent[] = [];
    const dead = await import("node:net").then(
      ({ createServer }) =>
        new Promise<number>((resolve) => {
          const s = createServer();
          s.listen(0, "127.0.0.1", () => {
            const port = (s.address() as AddressInfo).port;
            s.close(() => resolve(port));
          });
        }),
    );
    const summary = await runWorker({
      hub: `http://127.0.0.1:${dead}`,
      token: token("wk-unreachable"),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: cacheDir(),
      signal: controller.signal,
      pollMs: 50,
      log: (e) => {
        events.push(e);
        if (events.filter((x) => x.event === "hub-unreachable").length === 2) controller.abort();
      },
    });
    expect(summary.served).toBe(false);
    const first = events.find((e) => e.event === "hub-unreachable");
    expect(first).toMatchObject({ code: "MOESWARM_TRANSPORT_CONNECT" });
  });

  it("rejects what retrying cannot fix: a token the hub refuses", async () => {
    const forged = mintToken(
      { role: "worker", id: "wk-forged", ttlS: 600 },
      "another-secret-0123456789abcdef",
    );
    const error = await runWorker({
      hub: url,
      token: forged,
      capacity: { ramBytes: 10_000_000 },
      cacheDir: cacheDir(),
    }).catch((e) => e);
    expect(isMoeswarmError(error, "MOESWARM_AUTH_INVALID")).toBe(true);
  });

  it("validates its options", async () => {
    const base = { hub: url, token: token("wk-x"), capacity: { ramBytes: 1000 }, cacheDir: cacheDir() };
    const cases: Array<[Record<string, unknown>, RegExp]> = [
      [{ token: "" }, /token/],
      [{ capacity: { ramBytes: -1 } }, /capacity\.ramBytes/],
      [{ capacity: { ramBytes: 0 } }, /capacity must offer/],
      [{ backend: "gpu" }, /backend/],
      [{ hub: "ftp://x" }, /http\(s\)/],
      [{ relay: "http://x" }, /ws:\/\//],
      [{ id: "someone-else" }, /bound to worker "wk-x"/],
      [{ threads: 0 }, /threads/],
      [{ cacheMaxBytes: -5 }, /cacheMaxBytes/],
    ];
    for (const [patch, message] of cases) {
      const error = await runWorker({ ...base, ...patch } as never).catch((e) => e);
      expect(isMoeswarmError(error, "MOESWARM_INVALID_ARGUMENT"), String(error)).toBe(true);
      expect(error.message).toMatch(message);
    }
  });
});

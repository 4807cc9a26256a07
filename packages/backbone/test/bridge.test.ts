// The bridge on its own: a raw socket speaking the protocol plays the plugin, functions in an
// in-process transport play the workers. No llama.cpp here.

import { spawnSync } from "node:child_process";
import { existsSync, writeFileSync } from "node:fs";
import { connect, type Socket } from "node:net";
import { join } from "node:path";
import {
  decodeFrame,
  dispatchFrame,
  type ErrorFrame,
  type ExpertHandler,
  type ExpertRequest,
  encodeLengthPrefixed,
  type Frame,
  FrameReader,
  type ResultFrame,
  sumSlots,
} from "@moeswarm/core";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import { afterAll, describe, expect, it } from "vitest";
import {
  formatLayerSelection,
  moeswarmOverride,
  parseLayerSelection,
  serveBackboneBridge,
} from "../src/index.js";
import { tempDir } from "./helpers.js";

const EMBD = 8;
const K = 3;
const N_EXPERT = 6;
const MODEL = "unit";

/** Expert e's output for a row x: fround(x * (e + 1) + e), so every expert is distinguishable. */
function expertOut(x: Float32Array, e: number): Float32Array {
  return x.map((v) => Math.fround(Math.fround(v * (e + 1)) + e));
}

function fakeWorker(calls: ExpertRequest[] = []): ExpertHandler {
  return (request) => {
    calls.push(request);
    const { n, k, embd } = request;
    const y = new Float32Array(n * k * embd);
    for (let i = 0; i < n; i++) {
      const x = request.x.subarray(i * embd, (i + 1) * embd) as Float32Array;
      for (let j = 0; j < k; j++) {
        const e = request.ids[i * k + j]!;
        if (e >= 0) y.set(expertOut(x, e), (i * k + j) * embd);
      }
    }
    // a worker answers the mode it is asked (the bridge asks "sum" where one worker holds a token's slots)
    if (request.mode === "sum")
      return { mode: "sum", n, k, embd, y: sumSlots(y, request.w!, request.ids, { n, k, embd }), ms: 0.1 };
    return { mode: "each", n, k, embd, y, ms: 0.1 };
  };
}

/** The combine as llama.cpp does it: products rounded to f32, then f32 adds in slot order. */
function expected(x: Float32Array, ids: Int32Array, w: Float32Array, n: number): Float32Array {
  const out = new Float32Array(n * EMBD);
  for (let i = 0; i < n; i++) {
    const xi = x.subarray(i * EMBD, (i + 1) * EMBD);
    for (let j = 0; j < K; j++) {
      const y = expertOut(xi, ids[i * K + j]!);
      for (let c = 0; c < EMBD; c++) {
        const p = Math.fround(w[i * K + j]! * y[c]!);
        out[i * EMBD + c] = j === 0 ? p : Math.fround(out[i * EMBD + c]! + p);
      }
    }
  }
  return out;
}

function request(id: number, layer: number, n: number, seed: number, model = MODEL) {
  const x = new Float32Array(n * EMBD).map((_, i) => Math.sin(seed + i * 0.37));
  const ids = new Int32Array(n * K).map((_, i) => (seed + i * 5) % N_EXPERT);
  // distinct ids per token
  for (let i = 0; i < n; i++) for (let j = 0; j < K; j++) ids[i * K + j] = (seed + i + j * 2) % N_EXPERT;
  const w = new Float32Array(n * K).map((_, i) => 0.1 + ((seed * 7 + i) % 5) / 10);
  return {
    frame: dispatchFrame({ id, model, layer, n, embd: EMBD, dtype: "f32", x, k: K, ids, w, mode: "sum" }),
    x,
    ids,
    w,
  };
}

/** A plugin stand-in: writes frames, reads the answers. */
class Peer {
  readonly socket: Socket;
  readonly #reader = new FrameReader();
  readonly #frames: Frame[] = [];
  #waiters: (() => void)[] = [];
  closed = false;

  constructor(address: string) {
    this.socket = address.startsWith("unix:")
      ? connect(address.slice(5))
      : connect(Number(address.slice(address.lastIndexOf(":") + 1)), "127.0.0.1");
    this.socket.on("data", (chunk: Buffer) => {
      for (const p of this.#reader.push(chunk)) this.#frames.push(decodeFrame(p, { copy: true }));
      this.#wake();
    });
    this.socket.on("close", () => {
      this.closed = true;
      this.#wake();
    });
    this.socket.on("error", () => {});
  }

  #wake(): void {
    for (const w of this.#waiters.splice(0)) w();
  }

  send(bytes: Uint8Array | Frame): void {
    this.socket.write(bytes instanceof Uint8Array ? bytes : encodeLengthPrefixed(bytes));
  }

  async next(): Promise<Frame | undefined> {
    while (this.#frames.length === 0 && !this.closed) await new Promise<void>((r) => this.#waiters.push(r));
    return this.#frames.shift();
  }

  close(): void {
    this.socket.destroy();
  }
}

function swarm(workers: Record<string, number[]>, calls: Record<string, ExpertRequest[]> = {}) {
  const placement = new Placement({ model: MODEL });
  const transport = new InProcessTransport();
  for (const [id, experts] of Object.entries(workers)) {
    calls[id] = [];
    transport.set(id, fakeWorker(calls[id]));
    placement.register({ id, model: MODEL, layers: [0, 1, 2], experts });
  }
  return { placement, transport };
}

describe("serveBackboneBridge", () => {
  const tmp = tempDir("mswb-br-");
  afterAll(() => tmp.remove());

  it("answers each dispatch with the combine in slot order, over a Unix socket and over TCP", async () => {
    const calls: Record<string, ExpertRequest[]> = {};
    const { placement, transport } = swarm({ a: [0, 1, 2], b: [3, 4, 5] }, calls);
    for (const socket of [join(tmp.dir, "u.sock"), { host: "127.0.0.1", port: 0 }]) {
      await using bridge = await serveBackboneBridge({ socket, placement, transport });
      expect(bridge.address).toMatch(typeof socket === "string" ? /^unix:\// : /^tcp:127\.0\.0\.1:\d+$/);
      const peer = new Peer(bridge.address);
      const r = request(7, 1, 5, 3);
      peer.send(r.frame);
      const answer = (await peer.next()) as ResultFrame;
      expect(answer).toMatchObject({ t: "result", id: 7, mode: "sum", n: 5, k: K, embd: EMBD });
      expect([...answer.y]).toEqual([...expected(r.x, r.ids, r.w, 5)]);
      peer.close();
    }
    // both workers were asked, each for its own experts only
    expect(calls.a!.length).toBe(2);
    expect(calls.b!.length).toBe(2);
    for (const req of calls.a!) expect([...req.ids].every((e) => e < 3)).toBe(true);
  });

  it("serves several connections with several requests in flight, and counts them", async () => {
    const { placement, transport } = swarm({ a: [0, 1, 2, 3, 4, 5] });
    const seen: number[] = [];
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "many.sock"),
      placement,
      transport,
      onStats: (s) => seen.push(s.layer),
    });
    const peers = [new Peer(bridge.address), new Peer(bridge.address)];
    const reqs = [0, 1, 2, 3].map((i) => request(100 + i, i % 3, 1 + i, i));
    for (const [i, r] of reqs.entries()) peers[i % 2]!.send(r.frame);
    const answers = new Map<number, ResultFrame>();
    for (let i = 0; i < 4; i++) {
      const f = (await peers[i % 2]!.next()) as ResultFrame;
      answers.set(f.id, f);
    }
    for (const [i, r] of reqs.entries()) {
      expect([...answers.get(100 + i)!.y]).toEqual([...expected(r.x, r.ids, r.w, 1 + i)]);
    }
    const m = bridge.metrics();
    expect(m).toMatchObject({
      connections: 2,
      connectionsTotal: 2,
      requests: 4,
      failed: 0,
      tokens: 1 + 2 + 3 + 4,
    });
    expect(m.layers.map((l) => [l.layer, l.requests])).toEqual([
      [0, 2],
      [1, 1],
      [2, 1],
    ]);
    expect(m.layers[0]!.p99Ms).toBeGreaterThanOrEqual(m.layers[0]!.p50Ms);
    expect(m.bytesIn).toBe(reqs.reduce((s, r) => s + encodeLengthPrefixed(r.frame).byteLength, 0));
    expect(seen.sort()).toEqual([0, 0, 1, 2]);
    for (const p of peers) p.close();
  });

  it("reports routing counts and receipts in the hub's stats shape", async () => {
    const { placement, transport } = swarm({ a: [0, 1, 2], b: [3, 4, 5] });
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "stats.sock"),
      placement,
      transport,
    });
    const peer = new Peer(bridge.address);
    const r0 = request(1, 0, 4, 1);
    const r2 = request(2, 2, 3, 2);
    peer.send(r0.frame);
    await peer.next();
    peer.send(r2.frame);
    await peer.next();
    const count = (ids: Int32Array) => {
      const c = new Array<number>(N_EXPERT).fill(0);
      for (const e of ids) c[e]!++;
      return c;
    };
    expect([...bridge.routingCounts()].filter((c) => c.layer === 2).map((c) => c.count)).toEqual(
      count(r2.ids).filter((c) => c > 0),
    );
    const report = bridge.takeStatsReport({ nExpert: N_EXPERT });
    expect(report.counts).toEqual({ "0": count(r0.ids), "2": count(r2.ids) });
    expect(report.tokens).toBe(4);
    const pairs = (ids: Int32Array, lo: number, hi: number) =>
      [...ids].filter((e) => e >= lo && e < hi).length;
    expect(report.receipts.a!.expertTokens).toBe(pairs(r0.ids, 0, 3) + pairs(r2.ids, 0, 3));
    expect(report.receipts.b!.expertTokens).toBe(pairs(r0.ids, 3, 6) + pairs(r2.ids, 3, 6));
    expect(report.ms).toBeGreaterThan(0);
    // a new span starts empty
    expect(bridge.takeStatsReport({ nExpert: N_EXPERT })).toMatchObject({
      tokens: 0,
      counts: {},
      receipts: {},
    });
    expect(() => bridge.takeStatsReport({ nExpert: 0 })).toThrow(/nExpert/);
    peer.close();
  });

  it("answers what it cannot serve with error frames and keeps the connection", async () => {
    const { placement, transport } = swarm({ a: [0, 1, 2] }); // experts 3..5: nobody
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "err.sock"),
      placement,
      transport,
    });
    const peer = new Peer(bridge.address);
    peer.send(request(1, 0, 2, 0, "other-model").frame);
    expect(await peer.next()).toMatchObject({ t: "error", id: 1, code: "MOESWARM_PROTOCOL_BAD_FIELD" });
    const each = dispatchFrame({
      id: 2,
      model: MODEL,
      layer: 0,
      n: 1,
      embd: EMBD,
      dtype: "f32",
      x: new Float32Array(EMBD),
      k: K,
      ids: new Int32Array([0, 1, 2]),
      mode: "each",
    });
    peer.send(each);
    expect(await peer.next()).toMatchObject({ t: "error", id: 2, code: "MOESWARM_PROTOCOL_BAD_FIELD" });
    peer.send(request(3, 0, 2, 3).frame); // routes to experts without an owner, no fallback
    const failed = (await peer.next()) as ErrorFrame;
    expect(failed).toMatchObject({ t: "error", id: 3, code: "MOESWARM_DISPATCH_NO_OWNER" });
    // a payload that is not a frame: a connection-level error, then the connection still works
    peer.send(encodeLengthPrefixed(new Uint8Array([0xc1, 0x00])));
    const bad = (await peer.next()) as ErrorFrame;
    expect(bad.t).toBe("error");
    expect(bad.id).toBeUndefined();
    peer.send({ t: "ping", v: 1, seq: 5, ts: 1.5 });
    expect(await peer.next()).toMatchObject({ t: "pong", seq: 5, ts: 1.5 });
    const m = bridge.metrics();
    expect(m.failed).toBe(4);
    expect(m.errors).toMatchObject({ MOESWARM_PROTOCOL_BAD_FIELD: 2, MOESWARM_DISPATCH_NO_OWNER: 1 });
    peer.close();
  });

  it("a fallback serves the experts nobody owns", async () => {
    const { placement, transport } = swarm({ a: [0, 1, 2] });
    const fallbackCalls: ExpertRequest[] = [];
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "fb.sock"),
      placement,
      transport,
      fallback: fakeWorker(fallbackCalls),
    });
    const peer = new Peer(bridge.address);
    const r = request(9, 2, 4, 5);
    peer.send(r.frame);
    const answer = (await peer.next()) as ResultFrame;
    expect([...answer.y]).toEqual([...expected(r.x, r.ids, r.w, 4)]);
    expect(fallbackCalls.length).toBe(1);
    expect(bridge.metrics().fallbacks).toBe(1);
    // the fallback is this process: no receipt for it
    expect(Object.keys(bridge.takeStatsReport({ nExpert: N_EXPERT }).receipts)).toEqual(["a"]);
    peer.close();
  });

  it("closes the connection on an oversized length prefix without allocating it", async () => {
    const { placement, transport } = swarm({ a: [0, 1, 2, 3, 4, 5] });
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "big.sock"),
      placement,
      transport,
      maxFrameBytes: 4096,
    });
    const peer = new Peer(bridge.address);
    const prefix = new Uint8Array(4);
    new DataView(prefix.buffer).setUint32(0, 0xffff_fff0, true);
    peer.send(prefix);
    expect(await peer.next()).toMatchObject({ t: "error", code: "MOESWARM_PROTOCOL_FRAME_TOO_LARGE" });
    expect(await peer.next()).toBeUndefined();
    expect(peer.closed).toBe(true);
  });

  it("close and abort: connections end, the socket file goes, a stale socket file is reused", async () => {
    const { placement, transport } = swarm({ a: [0, 1, 2, 3, 4, 5] });
    const path = join(tmp.dir, "life.sock");
    // a socket file left by a process that died while listening
    spawnSync(process.execPath, [
      "-e",
      `require("net").createServer().listen(${JSON.stringify(path)}, () => process.kill(process.pid, "SIGKILL"))`,
    ]);
    expect(existsSync(path)).toBe(true);
    writeFileSync(join(tmp.dir, "not-a-socket"), "x");
    const controller = new AbortController();
    const bridge = await serveBackboneBridge({
      socket: path,
      placement,
      transport,
      signal: controller.signal,
    });
    const peer = new Peer(bridge.address);
    peer.send({ t: "ping", v: 1, seq: 1, ts: 0 });
    await peer.next();
    controller.abort();
    await bridge.close();
    expect(await peer.next()).toBeUndefined();
    expect(peer.closed).toBe(true);
    expect(existsSync(path)).toBe(false);
    await bridge.close(); // idempotent
    await expect(
      serveBackboneBridge({ socket: join(tmp.dir, "not-a-socket"), placement, transport }),
    ).rejects.toMatchObject({ code: "MOESWARM_TRANSPORT_CONNECT" });
    const aborted = AbortSignal.abort(new Error("stop"));
    await expect(
      serveBackboneBridge({ socket: path, placement, transport, signal: aborted }),
    ).rejects.toThrow("stop");
  });

  it("validates its options", async () => {
    const { placement, transport } = swarm({ a: [0] });
    await expect(serveBackboneBridge({ socket: "", placement, transport })).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
    });
    await expect(
      serveBackboneBridge({ socket: "x".repeat(200), placement, transport }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    await expect(
      serveBackboneBridge({ socket: { port: 70000 }, placement, transport }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    await expect(
      serveBackboneBridge({ socket: join(tmp.dir, "v.sock"), placement: {} as Placement, transport }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    await expect(
      serveBackboneBridge({ socket: join(tmp.dir, "h.sock"), placement, transport, hedgeMs: -1 }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT", message: /hedgeMs/ });
  });
});

describe("layer selections", () => {
  it("parses and formats what MOESWARM_LAYERS takes", () => {
    expect(parseLayerSelection("all")).toBe("all");
    expect(parseLayerSelection("0,1,4-7, 3")).toEqual([0, 1, 3, 4, 5, 6, 7]);
    expect(parseLayerSelection("none")).toEqual([]);
    expect(parseLayerSelection([3, 1, 3])).toEqual([1, 3]);
    expect(formatLayerSelection([0, 1, 2, 5, 7, 8])).toBe("0-2,5,7-8");
    expect(formatLayerSelection([])).toBe("none");
    for (const bad of ["1-", "a", "5-2", "4096", "1,,2"]) {
      expect(() => parseLayerSelection(bad)).toThrow(/layer/);
    }
    expect(() => parseLayerSelection([1.5])).toThrow(/layer/);
  });

  it("builds the -ot override llama-server takes", () => {
    const two = new RegExp(moeswarmOverride([0, 1]).split("=")[0]!);
    for (const name of [
      "blk.0.ffn_up_exps.weight",
      "blk.1.ffn_gate_up_exps.bias",
      "blk.1.ffn_down_exps.scale",
    ]) {
      expect(two.test(name)).toBe(true);
    }
    for (const name of [
      "blk.10.ffn_up_exps.weight",
      "blk.0.ffn_up.weight",
      "blk.0.ffn_gate_inp.weight",
      "blk.2.ffn_down_exps.weight",
    ]) {
      expect(two.test(name)).toBe(false);
    }
    expect(moeswarmOverride("all").endsWith("=MOESWARM")).toBe(true);
    expect(new RegExp(moeswarmOverride("all").split("=")[0]!).test("blk.31.ffn_down_exps.weight")).toBe(true);
    expect(() => moeswarmOverride([])).toThrow(/at least one layer/);
  });
});

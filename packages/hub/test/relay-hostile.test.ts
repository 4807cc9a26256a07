import {
  decodeFrame,
  encodeFrame,
  type Frame,
  isMoeswarmError,
  PROTOCOL_VERSION,
  sleep,
} from "@moeswarm/core";
import { connectRelay, type IncomingDispatch, type RelayConnection } from "@moeswarm/relay-client";
import { rng } from "@moeswarm/testkit";
import { encode as msgpack } from "@msgpack/msgpack";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import WebSocket from "ws";
import { listenRelay, mintToken, type RelayListener } from "../src/index.js";
import { fakeExperts, randomRequest, sameBytes, startProxy, waitFor } from "./helpers.js";

const SECRET = "hostile-test-secret-0123456789abcdef";
const MAX = 64 * 1024;
const MODEL = "test-moe";
const unhandled: unknown[] = [];
const onUnhandled = (e: unknown) => unhandled.push(e);

let listener: RelayListener;
const open: RelayConnection[] = [];

interface Raw {
  ws: WebSocket;
  frames: Frame[];
  closed: Promise<{ code: number; reason: string }>;
  next(t: Frame["t"]): Promise<Frame>;
  send(data: Uint8Array | string): void;
}

/** A bare WebSocket peer that speaks (or abuses) the protocol by hand. */
async function raw(url: string): Promise<Raw> {
  const ws = new WebSocket(url);
  const frames: Frame[] = [];
  const waiters: { t: string; resolve(f: Frame): void }[] = [];
  ws.on("message", (data: Buffer) => {
    const frame = decodeFrame(data);
    if (frame.t === "ping") {
      // alive like any peer, so only the behaviour under test decides its fate
      ws.send(encodeFrame({ t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts }));
      return;
    }
    const i = waiters.findIndex((w) => w.t === frame.t);
    if (i >= 0) waiters.splice(i, 1)[0]!.resolve(frame);
    else frames.push(frame);
  });
  ws.on("error", () => {});
  const closed = new Promise<{ code: number; reason: string }>((resolve) =>
    ws.on("close", (code, reason) => resolve({ code, reason: reason.toString() })),
  );
  await new Promise((resolve, reject) => {
    ws.once("open", resolve);
    ws.once("error", reject);
  });
  return {
    ws,
    frames,
    closed,
    next(t) {
      const seen = frames.findIndex((f) => f.t === t);
      if (seen >= 0) return Promise.resolve(frames.splice(seen, 1)[0]!);
      return new Promise((resolve) => waiters.push({ t, resolve }));
    },
    send(data) {
      ws.send(data, { binary: typeof data !== "string" });
    },
  };
}

async function helloed(role: "worker" | "backbone", id: string): Promise<Raw> {
  const peer = await raw(listener.url);
  peer.send(
    encodeFrame({
      t: "hello",
      v: PROTOCOL_VERSION,
      role,
      id,
      token: mintToken({ role, id, ttlS: 60 }, SECRET),
    }),
  );
  expect(await peer.next("hello")).toMatchObject({ t: "hello", role, id });
  return peer;
}

async function client(
  role: "worker" | "backbone",
  id: string,
  onDispatch?: (r: IncomingDispatch) => unknown,
) {
  const conn = await connectRelay(listener.url, {
    role,
    id,
    token: mintToken({ role, id, ttlS: 60 }, SECRET),
    heartbeatMs: 50,
    deadPeerMs: 1000,
    reconnect: false,
    maxFrameBytes: MAX,
    onDispatch: onDispatch as never,
  });
  open.push(conn);
  return conn;
}

const errorOf = (f: Frame) => (f.t === "error" ? f : undefined);

beforeAll(async () => {
  process.on("unhandledRejection", onUnhandled);
  listener = await listenRelay({
    secret: SECRET,
    maxFrameBytes: MAX,
    heartbeatMs: 50,
    deadPeerMs: 1000,
    helloTimeoutMs: 300,
    maxViolations: 8,
    violationWindowMs: 10_000,
    maxInFlight: 4,
  });
});

afterAll(async () => {
  await Promise.all(open.map((c) => c.close()));
  await listener?.close();
  process.off("unhandledRejection", onUnhandled);
  expect(unhandled).toEqual([]);
});

describe("relay against bad peers (plain ws://)", () => {
  it("refuses garbage, a non-hello first frame and silence before hello, and closes", async () => {
    const a = await raw(listener.url);
    a.send(new Uint8Array([0xc1, 0x00, 0xff]));
    expect(errorOf(await a.next("error"))?.code).toBe("MOESWARM_PROTOCOL_MALFORMED");
    expect((await a.closed).code).toBe(4001);

    const b = await raw(listener.url);
    b.send(encodeFrame({ t: "ping", v: PROTOCOL_VERSION, seq: 1, ts: 1 }));
    expect(errorOf(await b.next("error"))?.code).toBe("MOESWARM_AUTH_MISSING");
    expect(await b.closed).toEqual({ code: 4001, reason: "MOESWARM_AUTH_MISSING" });

    const c = await raw(listener.url);
    expect(errorOf(await c.next("error"))?.code).toBe("MOESWARM_AUTH_MISSING");
    expect((await c.closed).code).toBe(4001);
  });

  it("answers each bad frame with an error frame and keeps the connection", async () => {
    const p = await helloed("backbone", "messy");
    const expectError = async (code: string, id?: number) => {
      const e = errorOf(await p.next("error"));
      expect(e?.code).toBe(code);
      expect(e?.id).toBe(id);
    };
    p.send(new Uint8Array([0x92, 0x01])); // a truncated array
    await expectError("MOESWARM_PROTOCOL_MALFORMED");
    p.send("not binary");
    await expectError("MOESWARM_PROTOCOL_MALFORMED");
    p.send(msgpack({ t: "teleport", v: 1 }));
    await expectError("MOESWARM_PROTOCOL_UNKNOWN_TYPE");
    p.send(msgpack({ t: "ping", v: 2, seq: 1, ts: 0 }));
    await expectError("MOESWARM_PROTOCOL_VERSION");
    // a dispatch whose activations do not match n*embd: refused with its request id
    const ids = new Uint8Array(4);
    p.send(
      msgpack({
        t: "dispatch",
        v: 1,
        id: 77,
        to: "w",
        model: MODEL,
        layer: 0,
        n: 2,
        embd: 4,
        dtype: "f32",
        x: new Uint8Array(12),
        k: 1,
        ids,
        mode: "each",
      }),
    );
    await expectError("MOESWARM_PROTOCOL_BAD_LENGTH", 77);
    expect(p.ws.readyState).toBe(WebSocket.OPEN);
    p.send(encodeFrame({ t: "ping", v: PROTOCOL_VERSION, seq: 9, ts: 123.5 }));
    expect(await p.next("pong")).toMatchObject({ seq: 9, ts: 123.5 });
  });

  it("refuses an oversized frame without buffering a hostile length, and closes repeat offenders", async () => {
    const p = await helloed("backbone", "big");
    p.send(new Uint8Array(MAX + 1));
    expect(errorOf(await p.next("error"))?.code).toBe("MOESWARM_PROTOCOL_FRAME_TOO_LARGE");
    p.send(encodeFrame({ t: "register", v: PROTOCOL_VERSION, model: MODEL, layers: [0], experts: [0] }));
    expect(errorOf(await p.next("error"))?.code).toBe("MOESWARM_AUTH_ROLE");
    expect(p.ws.readyState).toBe(WebSocket.OPEN);
    for (let i = 0; i < 6; i++) p.send(new Uint8Array([0xc1]));
    expect((await p.closed).code).toBe(4002); // the 8th violation in the window

    // beyond twice the limit the WebSocket layer cuts the connection before buffering the frame
    const q = await helloed("backbone", "huge");
    q.send(new Uint8Array(2 * MAX + 1));
    expect((await q.closed).code).toBe(1009);
  });

  it("survives a seeded fuzz of random and truncated frames, then still routes", async () => {
    const rand = rng(42);
    const valid = encodeFrame({
      t: "dispatch",
      v: PROTOCOL_VERSION,
      id: 1,
      to: "fw",
      model: MODEL,
      layer: 0,
      n: 1,
      embd: 4,
      dtype: "f32",
      x: new Float32Array(4),
      k: 1,
      ids: new Int32Array([0]),
      mode: "each",
    });
    const peers = await Promise.all([helloed("backbone", "fz0"), helloed("worker", "fz1")]);
    let fresh = 2;
    for (let round = 0; round < 300; round++) {
      const slot = round % 2;
      // a peer closed as hostile is replaced, so the fuzz keeps reaching a live connection
      if (peers[slot]!.ws.readyState !== WebSocket.OPEN) {
        peers[slot] = await helloed(slot === 0 ? "backbone" : "worker", `fz${fresh++}`);
      }
      const peer = peers[slot]!;
      const kind = rand();
      let data: Uint8Array;
      if (kind < 0.4) data = new Uint8Array(Math.floor(rand() * 64)).map(() => Math.floor(rand() * 256));
      else if (kind < 0.7) data = valid.slice(0, Math.floor(rand() * valid.byteLength));
      else {
        data = valid.slice();
        for (let i = 0; i < 3; i++) data[Math.floor(rand() * data.byteLength)] = Math.floor(rand() * 256);
      }
      peer.send(data);
      await sleep(1);
    }
    // unauthenticated garbage too
    for (let i = 0; i < 20; i++) {
      const r = await raw(listener.url);
      r.send(new Uint8Array(Math.floor(rand() * 32)).map(() => Math.floor(rand() * 256)));
    }
    expect(fresh).toBeGreaterThan(4); // hostile peers were closed along the way
    for (const p of peers) p.ws.terminate();

    const worker = await client("worker", "fw", (req) => ({
      y: fakeExperts(5, { ...req, x: req.activations() }),
    }));
    worker.register({ model: MODEL, layers: [0], experts: [0, 1, 2, 3] });
    const backbone = await client("backbone", "fb");
    await waitFor(() => listener.relay.workers().some((w) => w.id === "fw" && w.slices.length === 1), "fw");
    const req = randomRequest(rng(43), { n: 3, embd: 16, k: 2, experts: 4, mode: "sum" });
    const reply = await backbone.request("fw", req);
    expect(sameBytes(reply.y, fakeExperts(5, req))).toBe(true);
    expect(listener.relay.stats().violations).toBeGreaterThan(20);
  });

  it("refuses a dispatch larger than the worker said it accepts, keeping the worker", async () => {
    const worker = await connectRelay(listener.url, {
      role: "worker",
      id: "tiny",
      token: mintToken({ role: "worker", id: "tiny", ttlS: 60 }, SECRET),
      reconnect: false,
      maxFrameBytes: 2048,
      onDispatch: (req) => ({ y: fakeExperts(4, { ...req, x: req.activations() }) }),
    });
    open.push(worker);
    worker.register({ model: MODEL, layers: [0], experts: [0, 1] });
    const backbone = await client("backbone", "sender");
    await waitFor(
      () => listener.relay.workers().some((w) => w.id === "tiny" && w.slices.length === 1),
      "tiny",
    );
    const big = randomRequest(rng(46), { n: 4, embd: 256, k: 1, experts: 2, mode: "each" });
    const error = await backbone.request("tiny", big).catch((e: unknown) => e);
    expect(isMoeswarmError(error, "MOESWARM_PROTOCOL_FRAME_TOO_LARGE")).toBe(true);
    const small = randomRequest(rng(47), { n: 1, embd: 16, k: 1, experts: 2, mode: "each" });
    const reply = await backbone.request("tiny", small);
    expect(sameBytes(reply.y, fakeExperts(4, small))).toBe(true);
    expect(worker.state).toBe("connected");
  });

  it("limits in-flight requests per connection", async () => {
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const worker = await client("worker", "slow", async (req) => {
      await gate;
      return { y: fakeExperts(3, { ...req, x: req.activations() }) };
    });
    worker.register({ model: MODEL, layers: [0], experts: [0, 1] });
    const backbone = await client("backbone", "eager");
    await waitFor(
      () => listener.relay.workers().some((w) => w.id === "slow" && w.slices.length === 1),
      "slow",
    );
    const req = randomRequest(rng(44), { n: 1, embd: 8, k: 1, experts: 2, mode: "each" });
    const results = Array.from({ length: 6 }, () =>
      backbone.request("slow", req).then(
        (r) => sameBytes(r.y, fakeExperts(3, req)),
        (e: unknown) => (isMoeswarmError(e) ? e.code : e),
      ),
    );
    await waitFor(() => listener.relay.workers().find((w) => w.id === "slow")?.inFlight === 4, "4 in flight");
    release();
    expect((await Promise.all(results)).sort()).toEqual([
      "MOESWARM_TRANSPORT_LIMIT",
      "MOESWARM_TRANSPORT_LIMIT",
      true,
      true,
      true,
      true,
    ]);
  });

  it("rate-limits a flooding connection without closing it", async () => {
    const limited = await listenRelay({ secret: SECRET, ratePerSec: 5, burst: 5 });
    try {
      const peer = await raw(limited.url);
      peer.send(
        encodeFrame({
          t: "hello",
          v: PROTOCOL_VERSION,
          role: "backbone",
          id: "flood",
          token: mintToken({ role: "backbone", id: "flood", ttlS: 60 }, SECRET),
        }),
      );
      await peer.next("hello");
      for (let seq = 0; seq < 20; seq++)
        peer.send(encodeFrame({ t: "ping", v: PROTOCOL_VERSION, seq, ts: 0 }));
      await waitFor(
        () => peer.frames.filter((f) => f.t === "pong" || f.t === "error").length >= 20,
        "20 answers",
      );
      const pongs = peer.frames.filter((f) => f.t === "pong").length;
      const limits = peer.frames.filter(
        (f) => f.t === "error" && f.code === "MOESWARM_TRANSPORT_LIMIT",
      ).length;
      expect(pongs + limits).toBe(20);
      expect(pongs).toBeGreaterThanOrEqual(5); // the burst, plus what refilled meanwhile
      expect(limits).toBeGreaterThan(0);
      expect(peer.ws.readyState).toBe(WebSocket.OPEN);
      peer.ws.close();
    } finally {
      await limited.close();
    }
  });

  it("replaces a peer that connects again with the same id, and 404s other upgrade paths", async () => {
    const first = await helloed("worker", "twin");
    const second = await helloed("worker", "twin");
    expect((await first.closed).code).toBe(4004);
    expect(second.ws.readyState).toBe(WebSocket.OPEN);
    expect(listener.relay.workers().filter((w) => w.id === "twin")).toHaveLength(1);
    second.ws.close();
    const other = new WebSocket(listener.url.replace("/relay", "/elsewhere"));
    const status = await new Promise<number>((resolve) => {
      other.on("unexpected-response", (_req, res) => resolve(res.statusCode ?? 0));
      other.on("error", () => {});
    });
    expect(status).toBe(404);
  });

  it("forgets a route the worker never answers and tells the backbone", async () => {
    const worker = await helloed("worker", "mute");
    worker.send(encodeFrame({ t: "register", v: PROTOCOL_VERSION, model: MODEL, layers: [0], experts: [0] }));
    const backbone = await helloed("backbone", "asker");
    await waitFor(
      () => listener.relay.workers().some((w) => w.id === "mute" && w.slices.length === 1),
      "mute",
    );
    const dispatch = encodeFrame({
      t: "dispatch",
      v: PROTOCOL_VERSION,
      id: 4242,
      to: "mute",
      model: MODEL,
      layer: 0,
      n: 1,
      embd: 2,
      dtype: "f32",
      x: new Float32Array([1, 2]),
      k: 1,
      ids: new Int32Array([0]),
      mode: "each",
      deadline: 10,
    });
    backbone.send(dispatch);
    const forwarded = await worker.next("dispatch");
    expect(forwarded).toMatchObject({ from: "asker", to: "mute", n: 1 });
    const error = errorOf(await backbone.next("error"));
    expect(error).toMatchObject({ id: 4242, from: "mute", code: "MOESWARM_TRANSPORT_TIMEOUT" });
    expect(listener.relay.workers().find((w) => w.id === "mute")?.inFlight).toBe(0);
    // the late answer is dropped: nothing more reaches the backbone
    if (forwarded.t === "dispatch") {
      worker.send(
        encodeFrame({
          t: "result",
          v: PROTOCOL_VERSION,
          id: forwarded.id,
          mode: "each",
          n: 1,
          k: 1,
          embd: 2,
          y: new Float32Array(2),
        }),
      );
    }
    backbone.send(encodeFrame({ t: "ping", v: PROTOCOL_VERSION, seq: 1, ts: 0 }));
    await backbone.next("pong");
    expect(backbone.frames.filter((f) => f.t === "result")).toHaveLength(0);
    worker.ws.close();
    backbone.ws.close();
  });

  it("applies back-pressure when a peer stops reading, on the relay and in the client", async () => {
    const small = await listenRelay({
      secret: SECRET,
      maxFrameBytes: MAX,
      maxQueueBytes: MAX,
      deadPeerMs: 30_000,
    });
    const proxy = await startProxy(small.port);
    const viaProxy = `ws://127.0.0.1:${proxy.port}/relay`;
    try {
      const connect = (role: "worker" | "backbone", id: string, u: string) =>
        connectRelay(u, {
          role,
          id,
          token: mintToken({ role, id, ttlS: 60 }, SECRET),
          reconnect: false,
          maxFrameBytes: MAX,
          maxQueueBytes: 2 * MAX,
          deadPeerMs: 30_000,
          onDispatch: role === "worker" ? () => new Promise(() => {}) : undefined,
        });
      const worker = await connect("worker", "stuck", viaProxy);
      worker.register({ model: MODEL, layers: [0], experts: [0] });
      const backbone = await connect("backbone", "pusher", small.url);
      await waitFor(() => small.relay.workers().some((w) => w.slices.length === 1), "stuck registered");
      proxy.freeze(); // the worker stops reading: its socket buffers fill, then the relay's queue
      const big = randomRequest(rng(45), { n: 8, embd: 1024, k: 1, experts: 1, mode: "each" }); // 32 KiB of x
      const codes = new Map<string, number>();
      let relayRefusal: unknown;
      const pending: Promise<void>[] = [];
      for (let i = 0; i < 400 && !codes.has("MOESWARM_TRANSPORT_BACKPRESSURE"); i++) {
        pending.push(
          backbone.request("stuck", big, { deadlineMs: 60_000 }).then(
            () => {},
            (e: unknown) => {
              const code = isMoeswarmError(e) ? e.code : String(e);
              codes.set(code, (codes.get(code) ?? 0) + 1);
              if (code === "MOESWARM_TRANSPORT_BACKPRESSURE") relayRefusal ??= e;
            },
          ),
        );
        await new Promise((r) => setImmediate(r));
      }
      expect(codes.get("MOESWARM_TRANSPORT_BACKPRESSURE")).toBeGreaterThan(0);
      // the refusal came from the relay (an error frame from the worker's side), not this client
      expect(isMoeswarmError(relayRefusal) && relayRefusal.details?.from).toBe("stuck");

      // the client's own bound: a backbone whose relay link is black-holed refuses to queue more
      const proxy2 = await startProxy(small.port);
      const blocked = await connect("backbone", "blocked", `ws://127.0.0.1:${proxy2.port}/relay`);
      proxy2.freeze();
      let refused: unknown;
      let maxBuffered = 0;
      for (let i = 0; i < 2000 && refused === undefined; i++) {
        // a full queue rejects at once; the other requests just wait (no one answers them)
        blocked.request("stuck", big, { deadlineMs: 60_000 }).catch((e: unknown) => {
          if (isMoeswarmError(e, "MOESWARM_TRANSPORT_BACKPRESSURE")) refused = e;
        });
        maxBuffered = Math.max(maxBuffered, blocked.bufferedBytes);
        await new Promise((r) => setImmediate(r));
      }
      expect(isMoeswarmError(refused, "MOESWARM_TRANSPORT_BACKPRESSURE")).toBe(true);
      // what waits in memory stays within the bound plus one frame
      expect(maxBuffered).toBeLessThanOrEqual(2 * MAX + MAX);
      expect(maxBuffered).toBeGreaterThan(MAX);
      await Promise.all([worker.close(), backbone.close(), blocked.close()]);
      await proxy2.close();
    } finally {
      await proxy.close();
      await small.close();
    }
  });
});

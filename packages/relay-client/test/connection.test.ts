import { execFileSync } from "node:child_process";
import { getEventListeners } from "node:events";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  AuthError,
  type ExpertTransport,
  encodeFrame,
  InvalidArgumentError,
  isMoeswarmError,
  PROTOCOL_VERSION,
  ProtocolError,
  TransportError,
} from "@moeswarm/core";
import { expectNoUnhandledRejections, waitFor } from "@moeswarm/testkit";
import { afterEach, beforeAll, beforeEach, describe, expect, it, vi } from "vitest";
import {
  type ConnectRelayOptions,
  connectRelay,
  type IncomingDispatch,
  type RelayConnection,
  type RelayEvent,
  RelayTransport,
} from "../src/index.js";
import { FakeRelay } from "./fake-relay.js";

expectNoUnhandledRejections(0);
let relay: FakeRelay;
const open: RelayConnection[] = [];

// The heartbeat (its interval and its clock) runs on fake timers: a ping goes out and a silent relay
// is declared dead only when a test moves the clock, never because the machine was slow. Sockets,
// deadlines (here they only expire on requests nobody answers) and reconnect delays keep real
// timers, except in the test whose reconnect delay must not elapse before it looks.
beforeEach(() => {
  vi.useFakeTimers({ toFake: ["setInterval", "clearInterval", "performance"] });
});

afterEach(async () => {
  vi.useRealTimers();
  await Promise.all(open.splice(0).map((c) => c.close()));
  await relay?.close();
});

async function connect(extra: Partial<ConnectRelayOptions> = {}, url = relay.url): Promise<RelayConnection> {
  const conn = await connectRelay(url, {
    role: "backbone",
    id: "bb",
    token: "good",
    heartbeatMs: 50,
    deadPeerMs: 600,
    reconnect: { initialDelayMs: 10, maxDelayMs: 50 },
    ...extra,
  });
  open.push(conn);
  return conn;
}

const request = (n = 2, embd = 4, k = 2) => ({
  model: "m",
  layer: 3,
  n,
  embd,
  k,
  x: Float32Array.from({ length: n * embd }, (_, i) => i * 0.25 - 1),
  ids: Int32Array.from({ length: n * k }, (_, i) => i % 5),
  mode: "each" as const,
});

async function codeOf(p: Promise<unknown>): Promise<unknown> {
  return p.then(
    () => "resolved",
    (e: unknown) => (isMoeswarmError(e) ? e.code : e),
  );
}

describe("connectRelay", () => {
  it("says hello with its role, id, token and frame limit, and multiplexes requests", async () => {
    relay = await FakeRelay.start();
    const conn = await connect({ maxFrameBytes: 1 << 20, caps: { backends: ["cpu"] } });
    expect(conn.state).toBe("connected");
    expect(relay.framesOf("hello")[0]).toMatchObject({
      role: "backbone",
      id: "bb",
      token: "good",
      caps: { backends: ["cpu"], maxFrame: 1 << 20 },
    });
    const reqs = [
      request(1, 8, 1),
      request(3, 4, 2),
      { ...request(2, 2, 3), mode: "sum" as const, w: new Float32Array(6).fill(0.5) },
    ];
    const replies = await Promise.all(reqs.map((r) => conn.request("w", r)));
    expect([...replies[0]!.y]).toEqual([...reqs[0]!.x]);
    // token i's activations in each of its k slots
    expect([...replies[1]!.y.subarray(0, 8)]).toEqual([
      ...reqs[1]!.x.subarray(0, 4),
      ...reqs[1]!.x.subarray(0, 4),
    ]);
    expect([...replies[2]!.y]).toEqual([...reqs[2]!.x].map((v) => v * 1.5));
    expect(replies[1]).toMatchObject({ ms: 1.5, from: "w" });
    const ids = relay.framesOf("dispatch").map((d) => d.id);
    expect(new Set(ids).size).toBe(3);
    expect(relay.framesOf("dispatch")[0]).toMatchObject({ to: "w", layer: 3, deadline: 30_000 });
  });

  it("rejects a refused hello with the relay's AuthError", async () => {
    relay = await FakeRelay.start();
    const error = await connect({ token: "bad" }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(AuthError);
    expect((error as AuthError).code).toBe("MOESWARM_AUTH_INVALID");
    expect(relay.connections).toBe(1);
  });

  it("rejects a first dial that fails, and an aborted connect, with clear errors", async () => {
    relay = await FakeRelay.start();
    const port = Number(new URL(relay.url).port);
    await relay.close();
    const error = await connect({}, `ws://127.0.0.1:${port}/relay`).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(TransportError);
    expect((error as TransportError).code).toBe("MOESWARM_TRANSPORT_CONNECT");
    relay = await FakeRelay.start();
    relay.silent = true; // never accepts the hello
    const controller = new AbortController();
    const pending = connect({ signal: controller.signal });
    await waitFor(() => relay.connections === 1, "the dial");
    controller.abort(new Error("stop"));
    await expect(pending).rejects.toThrow("stop");
    expect(getEventListeners(controller.signal, "abort").length).toBe(0);
    await expect(connect({ connectTimeoutMs: 50 })).rejects.toMatchObject({
      code: "MOESWARM_TRANSPORT_CONNECT",
    });
  });

  it("validates options and requests eagerly", async () => {
    relay = await FakeRelay.start();
    await expect(connectRelay("http://x", { role: "worker", id: "a", token: "t" })).rejects.toThrow(
      InvalidArgumentError,
    );
    await expect(connectRelay(relay.url, { role: "boss" as "worker", id: "a", token: "t" })).rejects.toThrow(
      InvalidArgumentError,
    );
    await expect(
      connectRelay(relay.url, { role: "worker", id: "a", token: "t", heartbeatMs: 100, deadPeerMs: 50 }),
    ).rejects.toThrow(InvalidArgumentError);
    const conn = await connect({ maxFrameBytes: 4096 });
    await expect(conn.request("w", { ...request(), n: 3 })).rejects.toThrow(InvalidArgumentError);
    await expect(conn.request("", request())).rejects.toThrow(InvalidArgumentError);
    await expect(conn.request("w", { ...request(), mode: "sum" })).rejects.toThrow(InvalidArgumentError);
    // larger than maxFrameBytes on send: refused before anything is written
    const big = await conn.request("w", request(64, 64, 1)).catch((e: unknown) => e);
    expect(big).toBeInstanceOf(ProtocolError);
    expect((big as ProtocolError).code).toBe("MOESWARM_PROTOCOL_FRAME_TOO_LARGE");
    expect(relay.framesOf("dispatch")).toHaveLength(0);
    expect(() => conn.register({ model: "m", layers: [0], experts: [3, 1] })).toThrow(InvalidArgumentError);
  });

  it("sends q8_0 rows (dispatch's quantizingTransport) as their bytes, and refuses rows of the wrong size", async () => {
    relay = await FakeRelay.start();
    const conn = await connect();
    relay.hold = true;
    // 2 rows of 32 values: one q8_0 block (34 bytes) each
    const x = Uint8Array.from({ length: 68 }, (_, i) => (i * 7) & 0xff);
    const q8 = { ...request(2, 32), dtype: "q8_0" as const, x };
    const controller = new AbortController();
    const pending = conn.request("w", q8, { signal: controller.signal }).catch(() => "aborted");
    await waitFor(() => relay.held.length === 1, "the dispatch");
    const sent = relay.framesOf("dispatch")[0] as unknown as { dtype: string; x: Uint8Array };
    expect(sent.dtype).toBe("q8_0");
    expect([...sent.x]).toEqual([...x]);
    controller.abort();
    expect(await pending).toBe("aborted");
    await expect(conn.request("w", { ...q8, x: x.subarray(1) })).rejects.toThrow(InvalidArgumentError);
    await expect(conn.request("w", { ...q8, embd: 33 })).rejects.toThrow(InvalidArgumentError);
    await expect(conn.request("w", { ...q8, x: new Float32Array(64) as never })).rejects.toThrow(
      InvalidArgumentError,
    );
  });

  it("times out, aborts and cleans up; late answers are dropped", async () => {
    relay = await FakeRelay.start();
    const conn = await connect();
    relay.hold = true;
    expect(await codeOf(conn.request("w", request(), { deadlineMs: 30 }))).toBe("MOESWARM_TRANSPORT_TIMEOUT");
    const controller = new AbortController();
    const pending = conn.request("w", request(), { signal: controller.signal });
    await waitFor(() => relay.held.length === 2, "two held");
    controller.abort(new Error("no longer needed"));
    await expect(pending).rejects.toThrow("no longer needed");
    expect(getEventListeners(controller.signal, "abort").length).toBe(0);
    for (const d of relay.held) relay.answer(relay.last, d); // both late
    relay.hold = false;
    const reply = await conn.request("w", request());
    expect(reply.y.length).toBe(16);
    await expect(
      conn.request("w", request(), { signal: AbortSignal.abort(new Error("early")) }),
    ).rejects.toThrow("early");
    expect(relay.framesOf("dispatch")).toHaveLength(3);
  });

  it("rejects a result of the wrong shape and surfaces undecodable frames as notices", async () => {
    relay = await FakeRelay.start();
    const conn = await connect();
    const notices: RelayEvent[] = [];
    conn.on((e) => e.type === "notice" && notices.push(e));
    relay.hold = true;
    const pending = conn.request("w", request(2, 4, 2));
    await waitFor(() => relay.held.length === 1, "held");
    const d = relay.held[0]!;
    relay.send(relay.last, {
      t: "result",
      v: PROTOCOL_VERSION,
      id: d.id,
      mode: "sum",
      n: 2,
      k: 2,
      embd: 4,
      y: new Float32Array(8),
    });
    expect(await codeOf(pending)).toBe("MOESWARM_PROTOCOL_BAD_LENGTH");
    relay.last.send(new Uint8Array([0xc1]));
    await waitFor(() => notices.length === 1, "notice");
    expect(notices[0]).toMatchObject({ type: "notice", error: { code: "MOESWARM_PROTOCOL_MALFORMED" } });
    expect(conn.state).toBe("connected");
  });

  it("detects a silent relay, fails in-flight requests, reconnects and replays every registration", async () => {
    relay = await FakeRelay.start();
    const states: RelayEvent[] = [];
    const conn = await connect({ role: "worker", id: "w1" });
    conn.on((e) => states.push(e));
    // several slices accumulate, of one model or several; the same slice again replaces itself
    conn.register({ model: "a", layers: [0], experts: [0, 1] });
    conn.register({ model: "b", layers: [1, 2], experts: [5] });
    conn.register({ model: "a", layers: [1, 2, 3], experts: [0, 1, 2] });
    conn.register({ model: "a", layers: [0], experts: [0, 1], capacity: 4096 });
    await waitFor(() => relay.framesOf("register").length === 4, "registers");
    expect(conn.registrations()).toEqual([
      { model: "a", layers: [0], experts: [0, 1], capacity: 4096 },
      { model: "b", layers: [1, 2], experts: [5] },
      { model: "a", layers: [1, 2, 3], experts: [0, 1, 2] },
    ]);
    relay.silent = true; // no pongs, nothing: the link looks alive to TCP but the relay is gone
    const first = relay.last;
    await vi.advanceTimersByTimeAsync(550); // pings go unanswered, but 600 ms of silence have not passed
    expect(conn.state).toBe("connected");
    await vi.advanceTimersByTimeAsync(100); // the tick at 650 ms finds the relay silent for > deadPeerMs
    await waitFor(() => conn.state === "reconnecting", "dead relay detected");
    expect(states.find((e) => e.type === "state" && e.state === "reconnecting")).toMatchObject({
      error: { code: "MOESWARM_TRANSPORT_TIMEOUT" },
    });
    relay.silent = false;
    await conn.waitConnected();
    expect(relay.last).not.toBe(first);
    await waitFor(() => relay.framesOf("register").length === 7, "registrations replayed");
    const replayed = relay.framesOf("register").slice(4);
    expect(replayed.map((r) => [r.model, r.layers, r.experts, r.capacity])).toEqual([
      ["a", [0], [0, 1], 4096],
      ["b", [1, 2], [5], undefined],
      ["a", [1, 2, 3], [0, 1, 2], undefined],
    ]);
    expect(relay.framesOf("hello")).toHaveLength(2);
    expect(relay.framesOf("drain")).toHaveLength(0);

    // a drain withdraws every registration: after the next reconnect only the drain is replayed
    conn.drain("upgrading");
    expect(conn.registrations()).toEqual([]);
    await waitFor(() => relay.framesOf("drain").length === 1, "drain");
    relay.dropAll();
    await waitFor(
      () => relay.framesOf("hello").length === 3 && relay.framesOf("drain").length === 2,
      () => `replay: ${relay.received.map((f) => f.t).join(",")} ${conn.state}`,
    );
    expect(relay.framesOf("drain")[1]).toMatchObject({ reason: "upgrading" });
    expect(relay.framesOf("register")).toHaveLength(7);
    // a register after the drain starts a new set (and ends the drain)
    conn.register({ model: "c", layers: [0], experts: [1] });
    await waitFor(() => relay.framesOf("register").length === 8, "register");
    relay.dropAll();
    await waitFor(
      () => relay.framesOf("hello").length === 4 && relay.framesOf("register").length === 9,
      "replay",
    );
    expect(relay.framesOf("register").at(-1)).toMatchObject({ model: "c", experts: [1] });
    expect(relay.framesOf("drain")).toHaveLength(2);
  });

  it("tells a worker when the relay drains it: the drain event and onDrain", async () => {
    relay = await FakeRelay.start();
    const calls: Array<string | undefined> = [];
    const conn = await connect({ role: "worker", id: "w2", onDrain: (reason) => calls.push(reason) });
    const events: RelayEvent[] = [];
    conn.on((e) => events.push(e));
    conn.register({ model: "m", layers: [0], experts: [0] });
    relay.send(relay.last, { t: "drain", v: PROTOCOL_VERSION, reason: "maintenance" });
    relay.send(relay.last, { t: "drain", v: PROTOCOL_VERSION });
    await waitFor(() => calls.length === 2, "onDrain");
    expect(calls).toEqual(["maintenance", undefined]);
    expect(events.filter((e) => e.type === "drain")).toEqual([
      { type: "drain", reason: "maintenance" },
      { type: "drain" },
    ]);
    // being told is not draining: the application decides (its registrations are still there)
    expect(conn.registrations()).toHaveLength(1);
    expect(conn.state).toBe("connected");
    // a throwing callback does not break the connection
    const throwing = await connect({
      role: "worker",
      id: "w3",
      onDrain: () => {
        throw new Error("callback bug");
      },
    });
    relay.send(relay.last, { t: "drain", v: PROTOCOL_VERSION });
    await expect(throwing.request("w2", request())).resolves.toMatchObject({ y: expect.any(Float32Array) });
    // a backbone is never drained: the frame is ignored
    const bb = await connect({ role: "backbone", id: "bb-d", onDrain: () => calls.push("backbone") });
    relay.send(relay.last, { t: "drain", v: PROTOCOL_VERSION });
    await expect(bb.request("w2", request())).resolves.toBeDefined();
    expect(calls).toHaveLength(2);
    await expect(
      connectRelay(relay.url, { role: "worker", id: "x", token: "good", onDrain: 3 as never }),
    ).rejects.toThrow(InvalidArgumentError);
  });

  it("names its peer (peerName) in the error of the requests a dropped link held", async () => {
    relay = await FakeRelay.start();
    const conn = await connect({ reconnect: false, peerName: "worker w on its direct link wss://w:1" });
    relay.hold = true;
    const pending = conn.request("w", request(), { deadlineMs: 60_000 });
    await waitFor(() => relay.held.length === 1, "held");
    relay.dropAll();
    const error = (await pending.catch((e: unknown) => e)) as TransportError;
    expect(error.code).toBe("MOESWARM_TRANSPORT_CLOSED");
    expect(error.message).toMatch(
      /^connection to worker w on its direct link wss:\/\/w:1 lost before w answered: /,
    );
    expect(error.details).toMatchObject({ peer: "worker w on its direct link wss://w:1" });
  });

  it("fails in-flight requests with TRANSPORT_CLOSED when the link drops, and fails fast while away", async () => {
    relay = await FakeRelay.start();
    const conn = await connect({ reconnect: { initialDelayMs: 800, maxDelayMs: 800, jitter: 0 } });
    relay.hold = true;
    const pending = conn.request("w", request(), { deadlineMs: 60_000 });
    await waitFor(() => relay.held.length === 1, "held");
    // from here the reconnect delay is on fake timers too: the link stays away until the clock moves
    vi.useFakeTimers({
      toFake: ["setTimeout", "clearTimeout", "setInterval", "clearInterval", "performance"],
    });
    relay.dropAll();
    const error = await pending.catch((e: unknown) => e);
    expect(error).toBeInstanceOf(TransportError);
    expect((error as TransportError).code).toBe("MOESWARM_TRANSPORT_CLOSED");
    expect((error as TransportError).message).toMatch(/^connection to the relay lost before w answered: /);
    expect(conn.state).toBe("reconnecting");
    expect(await codeOf(conn.request("w", request()))).toBe("MOESWARM_TRANSPORT_CLOSED");
    await vi.advanceTimersByTimeAsync(800);
    await conn.waitConnected();
    relay.hold = false;
    expect((await conn.request("w", request())).y.length).toBe(16);
  });

  it("treats a frame over maxFrameBytes from the relay as a protocol error and reconnects", async () => {
    relay = await FakeRelay.start();
    const conn = await connect({ maxFrameBytes: 2048 });
    const states: RelayEvent[] = [];
    conn.on((e) => states.push(e));
    relay.last.send(new Uint8Array(4096));
    await waitFor(() => states.some((e) => e.type === "state" && e.state === "reconnecting"), "reconnecting");
    const e = states.find((s) => s.type === "state" && s.state === "reconnecting");
    expect(e).toMatchObject({ error: { code: "MOESWARM_PROTOCOL_FRAME_TOO_LARGE" } });
    await conn.waitConnected();
  });

  it("stops after a replaced close and after close(), ending its iterables", async () => {
    relay = await FakeRelay.start();
    const conn = await connect();
    const events = conn.events();
    relay.last.close(4004, "replaced by a newer connection with the same id");
    const seen: string[] = [];
    for await (const e of events) if (e.type === "state") seen.push(e.state);
    expect(seen).toEqual(["closed"]);
    expect(conn.state).toBe("closed");
    expect(relay.connections).toBe(1);
    await expect(conn.waitConnected()).rejects.toThrow(TransportError);

    const other = await connect({ id: "bb2" });
    relay.hold = true;
    const pending = codeOf(other.request("w", request()));
    await waitFor(() => relay.held.length === 1, "held");
    await other[Symbol.asyncDispose]();
    expect(await pending).toBe("MOESWARM_TRANSPORT_CLOSED");
    expect(other.state).toBe("closed");
    expect(() => other.register({ model: "m", layers: [], experts: [] })).toThrow(TransportError);
  });

  it("answers the relay's pings and measures its own round trips", async () => {
    relay = await FakeRelay.start();
    const conn = await connect();
    relay.send(relay.last, { t: "ping", v: PROTOCOL_VERSION, seq: 41, ts: 7.25 });
    await vi.advanceTimersByTimeAsync(50); // heartbeatMs: the client's own ping goes out
    await waitFor(() => relay.framesOf("ping").length > 0 && conn.rttMs !== undefined, "heartbeats");
    expect(typeof conn.rttMs).toBe("number");
    // the pong to our ping is the fake relay's; the client's pong to the relay's ping:
    await waitFor(() => conn.bufferedBytes === 0, "flushed");
  });
});

describe("worker side", () => {
  it("delivers dispatches through the iterator and sends results and errors back", async () => {
    relay = await FakeRelay.start();
    const conn = await connect({ role: "worker", id: "w", maxIncoming: 2 });
    const dispatch = (id: number, deadline?: number) =>
      relay.send(relay.last, {
        t: "dispatch",
        v: PROTOCOL_VERSION,
        id,
        from: "bb",
        model: "m",
        layer: 1,
        n: 1,
        embd: 2,
        dtype: "f16",
        x: new Uint16Array([0x3c00, 0xc000]), // 1, -2
        k: 2,
        ids: new Int32Array([4, -1]),
        mode: "each",
        deadline,
      });
    const inbox = conn.dispatches();
    dispatch(7);
    const a = (await inbox.next()).value as IncomingDispatch;
    expect([a.id, a.from, a.dtype, [...a.activations()], [...a.ids]]).toEqual([
      7,
      "bb",
      "f16",
      [1, -2],
      [4, -1],
    ]);
    expect(a.respond({ y: new Float32Array([1, 2, 0, 0]) })).toBe(true);
    expect(a.respond({ y: new Float32Array(4) })).toBe(false); // once only
    await waitFor(() => relay.framesOf("result").length === 1, "result");
    expect(relay.framesOf("result")[0]).toMatchObject({ id: 7, to: "bb", mode: "each", n: 1, k: 2, embd: 2 });
    expect([...(relay.framesOf("result")[0]!.y as Float32Array)]).toEqual([1, 2, 0, 0]);

    dispatch(8);
    const b = (await inbox.next()).value as IncomingDispatch;
    b.respond({ y: new Float32Array(3) }); // wrong length: the backbone gets an error, not garbage
    dispatch(9);
    const c = (await inbox.next()).value as IncomingDispatch;
    c.fail(new TransportError("MOESWARM_TRANSPORT_LIMIT", "busy"));
    dispatch(10, 20);
    const d = (await inbox.next()).value as IncomingDispatch;
    await waitFor(() => d.signal.aborted, "deadline");
    expect(d.respond({ y: new Float32Array(4) })).toBe(false);
    // holding two already (maxIncoming 2): a third is refused at once
    dispatch(11);
    dispatch(12);
    dispatch(13);
    await waitFor(() => relay.framesOf("error").length === 3, "errors");
    expect(relay.framesOf("error").map((e) => [e.id, e.code])).toEqual([
      [8, "MOESWARM_PROTOCOL_BAD_LENGTH"],
      [9, "MOESWARM_TRANSPORT_LIMIT"],
      [13, "MOESWARM_TRANSPORT_LIMIT"],
    ]);
    await conn.close();
    const rest: number[] = [];
    for await (const inc of inbox) rest.push(inc.id);
    expect(rest).toEqual([]); // aborted by the close, so not handed out
  });

  it("runs an onDispatch handler and reports its failures with their codes", async () => {
    relay = await FakeRelay.start();
    await connect({
      role: "worker",
      id: "w",
      onDispatch: async (req) => {
        if (req.layer === 9) throw new Error("boom");
        return { y: new Float32Array(req.n * req.k * req.embd).fill(req.layer) };
      },
    });
    const send = (id: number, layer: number) =>
      relay.send(relay.last, {
        t: "dispatch",
        v: PROTOCOL_VERSION,
        id,
        model: "m",
        layer,
        n: 1,
        embd: 1,
        dtype: "f32",
        x: new Float32Array([1]),
        k: 1,
        ids: new Int32Array([0]),
        mode: "each",
      });
    send(1, 4);
    send(2, 9);
    await waitFor(
      () => relay.framesOf("result").length === 1 && relay.framesOf("error").length === 1,
      "answers",
    );
    expect([...(relay.framesOf("result")[0]!.y as Float32Array)]).toEqual([4]);
    expect(relay.framesOf("result")[0]!.ms).toBeGreaterThanOrEqual(0);
    expect(relay.framesOf("error")[0]).toMatchObject({
      id: 2,
      code: "MOESWARM_DISPATCH_FAILED",
      msg: "boom",
    });
  });

  it("answers a compact dispatch with the filled slots' rows only", async () => {
    relay = await FakeRelay.start();
    await connect({
      role: "worker",
      id: "w",
      // a handler answers in full: slot s holds the value s in each of its 2 columns
      onDispatch: (req) => ({
        y: Float32Array.from({ length: req.n * req.k * req.embd }, (_, i) => Math.floor(i / req.embd)),
      }),
    });
    const send = (id: number, compact: boolean) =>
      relay.send(relay.last, {
        t: "dispatch",
        v: PROTOCOL_VERSION,
        id,
        model: "m",
        layer: 0,
        n: 2,
        embd: 2,
        dtype: "f32",
        x: new Float32Array(4),
        k: 3,
        ids: Int32Array.from([5, -1, 2, -1, -1, 7]),
        mode: "each",
        ...(compact ? { compact: true } : {}),
      });
    send(1, true);
    send(2, false);
    await waitFor(() => relay.framesOf("result").length === 2, "answers");
    const [compact, full] = relay.framesOf("result");
    // slots 0, 2 and 5 are filled
    expect(compact).toMatchObject({ id: 1, compact: true });
    expect([...(compact!.y as Float32Array)]).toEqual([0, 0, 2, 2, 5, 5]);
    expect(full).not.toHaveProperty("compact");
    expect((full!.y as Float32Array).length).toBe(12);
  });

  it("refuses dispatches on a backbone connection", async () => {
    relay = await FakeRelay.start();
    await connect();
    relay.last.send(
      encodeFrame({
        t: "dispatch",
        v: PROTOCOL_VERSION,
        id: 5,
        model: "m",
        layer: 0,
        n: 1,
        embd: 1,
        dtype: "f32",
        x: new Float32Array(1),
        k: 1,
        ids: new Int32Array(1),
        mode: "each",
      }),
    );
    await waitFor(() => relay.framesOf("error").length === 1, "refusal");
    expect(relay.framesOf("error")[0]).toMatchObject({ id: 5, code: "MOESWARM_AUTH_ROLE" });
  });
});

describe("RelayTransport", () => {
  it("implements core's ExpertTransport over a backbone connection", async () => {
    relay = await FakeRelay.start();
    const conn = await connect();
    // a compile-time check against the expert contract's interface, and the runtime shape below
    const transport: ExpertTransport = new RelayTransport(conn, { wireDtype: "bf16" });
    const req = { ...request(1, 4, 1), dtype: "f32" as const, deadline: 1000 };
    const result = await transport.request("w7", req, { signal: new AbortController().signal });
    expect(relay.framesOf("dispatch")[0]).toMatchObject({
      to: "w7",
      model: "m",
      dtype: "bf16",
      deadline: 1000,
    });
    // bf16 of -1, -0.75, -0.5, -0.25 is exact
    expect(result).toMatchObject({ mode: "each", n: 1, k: 1, embd: 4, ms: 1.5 });
    // the dispatcher's wish for a compact answer goes on the wire
    await transport.request("w7", { ...req, compact: true }, { signal: new AbortController().signal });
    expect(relay.framesOf("dispatch")[1]).toMatchObject({ compact: true, mode: "each" });
    expect(relay.framesOf("dispatch")[0]).not.toHaveProperty("compact");
    expect([...result.y]).toEqual([-1, -0.75, -0.5, -0.25]);
    await expect(
      transport.request(
        "w7",
        { ...req, dtype: "f64", x: new Float64Array(4) },
        { signal: new AbortController().signal },
      ),
    ).rejects.toThrow(InvalidArgumentError);
    const worker = await connect({ role: "worker", id: "w" });
    expect(() => new RelayTransport(worker)).toThrow(InvalidArgumentError);
  });
});

describe("TLS", () => {
  let pems: { ca: string; cert: string; key: string };
  beforeAll(() => {
    const dir = mkdtempSync(join(tmpdir(), "relay-client-tls-"));
    const run = (args: string[]) => execFileSync("openssl", args, { cwd: dir, stdio: "pipe" });
    const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    run(["req", "-x509", ...ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test CA"]);
    run(["req", ...ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=localhost"]);
    writeFileSync(join(dir, "ext"), "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost\n");
    const sign = ["x509", "-req", "-in", "leaf.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"];
    run([...sign, "-out", "leaf.crt", "-days", "2", "-extfile", "ext"]);
    const read = (f: string) => readFileSync(join(dir, f), "utf8");
    pems = { ca: read("ca.crt"), cert: read("leaf.crt"), key: read("leaf.key") };
    rmSync(dir, { recursive: true, force: true });
  });

  it("connects over wss with a custom CA, and says why without it", async () => {
    relay = await FakeRelay.start({ cert: pems.cert, key: pems.key });
    const error = await connect().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(TransportError);
    expect((error as TransportError).code).toBe("MOESWARM_TRANSPORT_CONNECT");
    // the TLS reason reaches the user (a reason undici's WebSocket does not give)
    expect((error as Error).message).toMatch(/certificate|verify/i);
    const conn = await connect({ ca: pems.ca });
    expect((await conn.request("w", request())).y.length).toBe(16);
  });
});

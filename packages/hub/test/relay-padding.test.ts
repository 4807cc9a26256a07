// The relay writes the padding entry `_` (docs/protocol.md section 8, rule 9) anew on every
// dispatch and result it forwards: frames from an older sender (no padding) and frames whose
// padding no longer fits after the routing fields changed arrive in canonical form, `x` and `y`
// at a multiple of 8 within the frame, with the same values. A sender that leaves room
// (`relayHeadroom`, as relay-client does) has its frames rewritten in their own memory, never
// copied (the `copied` count says which way each went).
import {
  type DispatchFrame,
  decodeFrame,
  encodeFrame,
  type Frame,
  PROTOCOL_VERSION,
  type ResultFrame,
  relayHeadroom,
} from "@moeswarm/core";
import { connectRelay } from "@moeswarm/relay-client";
import { rng } from "@moeswarm/testkit";
import { decode as msgpackDecode, encode as msgpackEncode } from "@msgpack/msgpack";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import WebSocket from "ws";
import { listenRelay, mintToken, type RelayListener } from "../src/index.js";
import { randomRequest, sameBytes, waitFor } from "./helpers.js";

const SECRET = "padding-test-secret-0123456789abcdef";
const MODEL = "test-moe";
let listener: RelayListener;
const sockets: WebSocket[] = [];

/** A bare WebSocket peer that keeps every frame's bytes as received. */
async function peer(role: "worker" | "backbone", id: string) {
  const ws = new WebSocket(listener.url);
  sockets.push(ws);
  const received: Uint8Array[] = [];
  const waiters: Array<(b: Uint8Array) => void> = [];
  ws.on("message", (data: Buffer) => {
    const frame = decodeFrame(data);
    if (frame.t === "ping") {
      ws.send(encodeFrame({ t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts }));
      return;
    }
    if (frame.t !== "dispatch" && frame.t !== "result") return;
    const bytes = new Uint8Array(data); // a copy: the frame's own bytes, at offset 0
    const waiter = waiters.shift();
    if (waiter) waiter(bytes);
    else received.push(bytes);
  });
  await new Promise((resolve, reject) => {
    ws.once("open", resolve);
    ws.once("error", reject);
  });
  ws.send(encodeFrame({ t: "hello", v: 1, role, id, token: mintToken({ role, id, ttlS: 60 }, SECRET) }));
  return {
    send: (bytes: Uint8Array) => ws.send(bytes, { binary: true }),
    next: (): Promise<Uint8Array> =>
      received.length > 0
        ? Promise.resolve(received.shift()!)
        : new Promise((resolve) => waiters.push(resolve)),
  };
}

/** A bare worker holding experts 0..3 of `layer`, registered, and a bare backbone. */
async function pair(workerId: string, backboneId: string, layer: number) {
  const worker = await peer("worker", workerId);
  worker.send(encodeFrame({ t: "register", v: 1, model: MODEL, layers: [layer], experts: [0, 1, 2, 3] }));
  const backbone = await peer("backbone", backboneId);
  await waitFor(
    () => listener.relay.workers().some((w) => w.id === workerId && w.slices.length === 1),
    "the worker's registration",
  );
  return { worker, backbone };
}

/** The frame as an older encoder wrote it: the canonical entries without `_`, or with `pad` in its place. */
function asOlder(frame: Frame, pad?: Uint8Array): Uint8Array {
  const o = msgpackDecode(encodeFrame(frame)) as Record<string, unknown>;
  expect(o._).toBeInstanceOf(Uint8Array); // (this encoder pads)
  delete o._;
  if (pad !== undefined) o._ = pad; // at the end, of the wrong length
  return msgpackEncode(o);
}

/** Checks a forwarded frame: canonical (so padded as encodeFrame pads) with the values expected. */
function expectCanonical(bytes: Uint8Array, expected: Frame): void {
  expect(msgpackDecode(bytes)).toHaveProperty("_");
  const frame = decodeFrame(bytes);
  expect(Buffer.from(encodeFrame(frame)).equals(Buffer.from(bytes))).toBe(true);
  expect(frame).toEqual(expected);
}

beforeAll(async () => {
  listener = await listenRelay({ secret: SECRET, heartbeatMs: 1000, deadPeerMs: 10_000 });
});

afterAll(async () => {
  for (const ws of sockets) ws.close();
  await listener?.close();
});

describe("the relay's padding", () => {
  it("pads an older sender's dispatch and an older worker's result, and fixes padding that no longer fits", async () => {
    const { worker, backbone } = await pair("old-worker", "old-backbone", 0);
    const copiedBefore = listener.relay.stats().copied;
    const rand = rng(15);
    for (const [i, n, pad] of [
      [1, 1, undefined],
      [2, 3, Uint8Array.of(9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9)],
      [70_000, 17, undefined],
    ] as const) {
      const req = randomRequest(rand, { n, embd: 48, k: 2, experts: 4, mode: "each" });
      const dispatch = {
        t: "dispatch",
        v: 1,
        id: i,
        to: "old-worker",
        dtype: "f32",
        ...req,
      } as DispatchFrame;
      backbone.send(asOlder(dispatch, pad));
      const forwarded = await worker.next();
      const relayed = decodeFrame(forwarded) as DispatchFrame;
      expectCanonical(forwarded, { ...dispatch, id: relayed.id, from: "old-backbone" });
      const result: ResultFrame = {
        t: "result",
        v: 1,
        id: relayed.id,
        mode: "each",
        n,
        k: 2,
        embd: 48,
        y: new Float32Array(n * 2 * 48).map(() => rand()),
        ms: 0.5,
      };
      worker.send(asOlder(result, pad));
      const answer = await backbone.next();
      expectCanonical(answer, { ...result, id: i, from: "old-worker", to: "old-backbone" });
    }
    expect(listener.relay.stats().copied).toBe(copiedBefore + 6);
  });

  it("a sender's headroom: rewritten in place (nothing copied), the same values, the tensor aligned", async () => {
    const { worker, backbone } = await pair("roomy-worker", "roomy-backbone", 1);
    const copiedBefore = listener.relay.stats().copied;
    const rand = rng(16);
    // request ids of 1, 3 and 5 bytes against the relay's own
    for (const [i, n] of [
      [1, 1],
      [300, 2],
      [0xffff_fff0, 64],
    ] as const) {
      const req = randomRequest(rand, { n, embd: 48, k: 2, experts: 4, mode: "each", layer: 1 });
      const dispatch = {
        t: "dispatch",
        v: 1,
        id: i,
        to: "roomy-worker",
        dtype: "f32",
        ...req,
      } as DispatchFrame;
      backbone.send(encodeFrame(dispatch, { headroom: relayHeadroom("roomy-backbone") }));
      const forwarded = await worker.next();
      const relayed = decodeFrame(forwarded) as DispatchFrame;
      expect(relayed).toEqual({ ...dispatch, id: relayed.id, from: "roomy-backbone" });
      expect((relayed.x as Float32Array).byteOffset % 8).toBe(0);
      const y = new Float32Array(n * 2 * 48).map(() => rand());
      const result: ResultFrame = {
        t: "result",
        v: 1,
        id: relayed.id,
        to: "roomy-backbone",
        mode: "each",
        n,
        k: 2,
        embd: 48,
        y,
        ms: 0.5,
      };
      worker.send(encodeFrame(result, { headroom: relayHeadroom("roomy-worker") }));
      const answer = decodeFrame(await backbone.next());
      expect(answer).toEqual({ ...result, id: i, from: "roomy-worker", to: "roomy-backbone" });
      expect((answer as ResultFrame).y.byteOffset % 8).toBe(0);
    }
    expect(listener.relay.stats().copied).toBe(copiedBefore);
  });

  it("relay-client's frames leave that room: a worker's and a backbone's requests go through uncopied", async () => {
    const conn = (role: "worker" | "backbone", id: string) =>
      connectRelay(listener.url, {
        role,
        id,
        token: mintToken({ role, id, ttlS: 60 }, SECRET),
        reconnect: false,
        ...(role === "worker"
          ? { onDispatch: (req: { x: unknown }) => ({ y: req.x as Float32Array, ms: 0 }) }
          : {}),
      });
    await using worker = await conn("worker", "client-worker");
    worker.register({ model: MODEL, layers: [2], experts: [0, 1, 2, 3] });
    await using backbone = await conn("backbone", "client-backbone-with-a-longer-id");
    await waitFor(
      () => listener.relay.workers().some((w) => w.id === "client-worker" && w.slices.length === 1),
      "the worker's registration",
    );
    const before = listener.relay.stats();
    const rand = rng(17);
    for (const n of [1, 8, 64]) {
      const req = randomRequest(rand, { n, embd: 48, k: 1, experts: 4, mode: "sum", layer: 2 });
      const answer = await backbone.request("client-worker", req);
      expect(sameBytes(answer.y, req.x)).toBe(true);
    }
    const after = listener.relay.stats();
    expect(after.routed - before.routed).toBe(3);
    expect(after.copied).toBe(before.copied);
  });
});

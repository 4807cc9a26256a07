import type { AddressInfo } from "node:net";
import { type DispatchFrame, decodeFrame } from "@moeswarm/core";
import { expectNoUnhandledRejections, waitFor } from "@moeswarm/testkit";
import { afterEach, describe, expect, it } from "vitest";
import { WebSocketServer } from "ws";
import { connectRelay, dialWebSocket, type FrameDialer, type RelayConnection } from "../src/index.js";
import { FakeRelay } from "./fake-relay.js";
import { recordingDialer } from "./fixtures.js";

// Frames go out through memory the connection reuses only when the link says it is done with the
// bytes once send returns (copiesOnSend: the WebSocket link). These tests send frames of falling
// sizes back to back, so that each is encoded over the last one's memory before any reaches the
// socket, and check every one arrives as sent; and that a link that keeps its bytes gets its own.

expectNoUnhandledRejections(0);
let relay: FakeRelay | undefined;
const open: RelayConnection[] = [];

afterEach(async () => {
  await Promise.all(open.splice(0).map((c) => c.close()));
  await relay?.close();
  relay = undefined;
});

// typed arrays compared as bytes: toEqual walks 16k elements one by one, for seconds
const same = (a: Float32Array, b: Float32Array) =>
  Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength));

async function connect(dial?: FrameDialer): Promise<RelayConnection> {
  relay = await FakeRelay.start();
  const conn = await connectRelay(relay.url, {
    role: "backbone",
    id: "bb",
    token: "good",
    ...(dial ? { dial } : {}),
  });
  open.push(conn);
  return conn;
}

/** Requests of falling sizes, each token's activations distinct from every other request's. */
const requests = [64, 17, 8, 3, 1].map((n, r) => ({
  model: "m",
  layer: 3,
  n,
  embd: 256,
  k: 1,
  x: Float32Array.from({ length: n * 256 }, (_, i) => r * 1e5 + i),
  ids: new Int32Array(n),
  mode: "each" as const,
}));

describe("sending frames through reused memory", () => {
  it("delivers back-to-back dispatches intact over the WebSocket link", async () => {
    const conn = await connect();
    for (let round = 0; round < 3; round++) {
      const replies = await Promise.all(requests.map((r) => conn.request("w", r)));
      expect(replies.map((reply, i) => same(reply.y, requests[i]!.x))).toEqual(requests.map(() => true));
    }
    const xs = relay!.framesOf("dispatch").map((d) => d.x);
    expect(xs).toHaveLength(3 * requests.length);
    expect(xs.every((x, i) => same(x as Float32Array, requests[i % requests.length]!.x))).toBe(true);
  });

  it("reuses one piece of memory for a link that copies on send", async () => {
    const sent: Uint8Array[] = [];
    const conn = await connect(recordingDialer(sent, true));
    await Promise.all(requests.map((r) => conn.request("w", r)));
    const dispatches = sent.filter((b) => b.byteLength > 1000);
    expect(dispatches).toHaveLength(requests.length);
    // every dispatch was lent out of the same memory: the encoder's own, reused
    expect(new Set(dispatches.map((b) => b.buffer)).size).toBe(1);
  });

  it("gives a link that keeps its bytes frames of its own, never overwritten by later ones", async () => {
    const sent: Uint8Array[] = [];
    const conn = await connect(recordingDialer(sent, false));
    await Promise.all(requests.map((r) => conn.request("w", r)));
    // all sent, answered, and more frames encoded since: what the link kept is still each frame
    const kept = sent.map((b) => decodeFrame(b)).filter((f): f is DispatchFrame => f.t === "dispatch");
    expect(kept).toHaveLength(requests.length);
    expect(kept.map((f, i) => same(f.x as Float32Array, requests[i]!.x))).toEqual(requests.map(() => true));
  });

  it("the WebSocket link is done with the bytes when send returns, as copiesOnSend says", async () => {
    // bytes scribbled over right after each send, as the next encode would: the peer must still
    // get every frame as it was (this breaks if a ws upgrade stops copying as it masks)
    const wss = new WebSocketServer({ port: 0, host: "127.0.0.1" });
    await new Promise<void>((r) => wss.once("listening", () => r()));
    const got: Buffer[] = [];
    wss.on("connection", (ws) => ws.on("message", (data: Buffer) => got.push(data)));
    try {
      const url = `ws://127.0.0.1:${(wss.address() as AddressInfo).port}`;
      const link = await dialWebSocket(url, {
        handlers: { frame: () => {}, activity: () => {}, close: () => {} },
        maxFrameBytes: 1 << 20,
        connectTimeoutMs: 5000,
      });
      expect(link.copiesOnSend).toBe(true);
      const frames = [200_000, 5000, 100, 1].map((size, i) => {
        const bytes = new Uint8Array(size);
        for (let j = 0; j < size; j++) bytes[j] = (i * 31 + j) & 0xff;
        return bytes;
      });
      for (const frame of frames) {
        const lent = frame.slice();
        link.send(lent);
        lent.fill(0xee);
      }
      await waitFor(() => got.length === frames.length, "every frame");
      expect(got.map((g, i) => g.equals(frames[i]!))).toEqual(frames.map(() => true));
      link.destroy();
    } finally {
      await new Promise<void>((r) => wss.close(() => r()));
    }
  });
});

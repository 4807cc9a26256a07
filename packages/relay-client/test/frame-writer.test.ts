import { createHash, X509Certificate } from "node:crypto";
import {
  type AddressInfo,
  createServer as createNetServer,
  type Server as NetServer,
  type Socket,
} from "node:net";
import { createServer as createTlsServer } from "node:tls";
import { type DispatchFrame, decodeFrame, type EncodableFrame, PROTOCOL_VERSION } from "@moeswarm/core";
import { expectNoUnhandledRejections, waitFor } from "@moeswarm/testkit";
import { afterEach, describe, expect, it } from "vitest";
import { FrameWriter } from "../src/frame-writer.js";
import {
  connectRelay,
  dialWebSocket,
  type FrameDialer,
  type FrameLink,
  type RelayConnection,
  selfSignedCertificate,
} from "../src/index.js";
import { FakeRelay } from "./fake-relay.js";
import { recordingDialer } from "./fixtures.js";

// Frames go out through memory the connection reuses only when the link says when it is done with
// the bytes (callsSent: the WebSocket links), and only after it said so. These tests send frames
// back to back (each encoded before the last reached the socket) and one at a time (each written
// over the last one's memory), and check that every one arrives as sent; that a link that keeps
// its bytes gets its own; and what a WebSocket link puts on the wire: over TLS the bytes it is
// given, unmasked and uncopied; over plain ws:// masked, as RFC 6455 asks.

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

const dispatchFrame = (id: number, r: (typeof requests)[number]): EncodableFrame => ({
  t: "dispatch",
  v: PROTOCOL_VERSION,
  id,
  to: "w",
  ...r,
  dtype: "f32",
  deadline: 1000,
});

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

  it("reuses one piece of memory for a link that calls sent, frame after frame", async () => {
    const sent: Uint8Array[] = [];
    const conn = await connect(recordingDialer(sent, true));
    for (const r of requests) {
      const reply = await conn.request("w", r);
      expect(same(reply.y, r.x)).toBe(true);
    }
    const dispatches = sent.filter((b) => b.byteLength > 1000);
    expect(dispatches).toHaveLength(requests.length);
    // every dispatch was lent out of the same memory, taken back once the last one was written
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

  it("takes memory back only when the link calls sent", () => {
    const held: (() => void)[] = [];
    const got: Uint8Array[] = [];
    const link: FrameLink = {
      callsSent: true,
      bufferedBytes: 0,
      send: (bytes, sent) => {
        got.push(bytes);
        held.push(sent!);
      },
      close: () => {},
      destroy: () => {},
    };
    const writer = new FrameWriter(1 << 20);
    const frame = (id: number) => dispatchFrame(id, requests[0]!);
    writer.send(link, frame(1));
    writer.send(link, frame(2));
    // the first is still held: the second got other memory
    expect(got[1]!.buffer).not.toBe(got[0]!.buffer);
    held[0]!();
    held[0]!(); // a second call changes nothing
    writer.send(link, frame(3));
    writer.send(link, frame(4));
    expect(got[2]!.buffer).toBe(got[0]!.buffer);
    expect(got[3]!.buffer).not.toBe(got[0]!.buffer);
    expect(got[3]!.buffer).not.toBe(got[1]!.buffer);
  });

  for (const scheme of ["wss", "ws"] as const) {
    it(`a ${scheme}:// link ${scheme === "wss" ? "sends the bytes it is given unmasked" : "masks every frame"}, intact though reused once sent`, async () => {
      const peer = await RawWebSocketPeer.start(scheme === "wss" ? await selfSignedCertificate() : undefined);
      try {
        const link = await dialWebSocket(peer.url, {
          handlers: { frame: () => {}, activity: () => {}, close: () => {} },
          maxFrameBytes: 1 << 20,
          connectTimeoutMs: 5000,
          ...(peer.pin !== undefined ? { pin: peer.pin } : {}),
        });
        expect(link.callsSent).toBe(true);
        const frames = [200_000, 5000, 100, 1].map((size, i) => {
          const bytes = new Uint8Array(size);
          for (let j = 0; j < size; j++) bytes[j] = (i * 31 + j) & 0xff;
          return bytes;
        });
        let done = 0;
        for (const frame of frames) {
          const lent = frame.slice();
          // scribbled over once sent, as the writer's next encode would
          link.send(lent, () => {
            lent.fill(0xee);
            done++;
          });
        }
        await waitFor(() => peer.frames.length === frames.length && done === frames.length, "every frame");
        expect(peer.frames.map((f, i) => f.payload.equals(frames[i]!))).toEqual(frames.map(() => true));
        const zero = peer.frames.map((f) => f.mask.equals(Buffer.alloc(4)));
        expect(zero).toEqual(frames.map(() => scheme === "wss"));
        link.destroy();
      } finally {
        await peer.close();
      }
    });
  }
});

/**
 * A WebSocket server written out by hand, so a test sees the client's frames as they are on the
 * wire (ws's own server unmasks them out of sight): the upgrade, then each frame's mask and its
 * unmasked payload. Plain TCP, or TLS with `tls` (whose certificate the client pins).
 */
class RawWebSocketPeer {
  readonly frames: { mask: Buffer; payload: Buffer }[] = [];
  readonly #sockets = new Set<Socket>();
  private constructor(
    private readonly server: NetServer,
    readonly url: string,
    readonly pin: string | undefined,
  ) {}

  static async start(tls?: { cert: string; key: string }): Promise<RawWebSocketPeer> {
    let peer: RawWebSocketPeer | undefined;
    const onSocket = (socket: Socket) => peer!.serve(socket);
    const server = tls ? createTlsServer(tls, onSocket) : createNetServer(onSocket);
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    const port = (server.address() as AddressInfo).port;
    const pin = tls ? new X509Certificate(tls.cert).fingerprint256 : undefined;
    peer = new RawWebSocketPeer(server, `${tls ? "wss" : "ws"}://127.0.0.1:${port}/`, pin);
    return peer;
  }

  private serve(socket: Socket): void {
    let buf: Buffer = Buffer.alloc(0);
    let upgraded = false;
    this.#sockets.add(socket);
    socket.on("error", () => {});
    socket.on("data", (chunk: Buffer) => {
      buf = Buffer.concat([buf, chunk]);
      if (!upgraded) {
        const end = buf.indexOf("\r\n\r\n");
        if (end < 0) return;
        const key = /sec-websocket-key: *(\S+)/i.exec(buf.subarray(0, end).toString())![1]!;
        const accept = createHash("sha1")
          .update(`${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11`)
          .digest("base64");
        socket.write(
          `HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: ${accept}\r\n\r\n`,
        );
        upgraded = true;
        buf = buf.subarray(end + 4);
      }
      buf = this.takeFrames(buf);
    });
  }

  /** Reads the complete client frames at the front of `buf` (all masked); returns the rest. */
  private takeFrames(from: Buffer): Buffer {
    let buf = from;
    for (;;) {
      if (buf.length < 2) return buf;
      let len = buf[1]! & 0x7f;
      let at = 2;
      if (len === 126) [len, at] = [buf.length < 4 ? -1 : buf.readUInt16BE(2), 4];
      else if (len === 127) [len, at] = [buf.length < 10 ? -1 : Number(buf.readBigUInt64BE(2)), 10];
      if (len < 0 || buf.length < at + 4 + len) return buf;
      expect(buf[1]! & 0x80).toBe(0x80); // a client frame always carries a mask, zero or not
      const mask = Buffer.from(buf.subarray(at, at + 4));
      const payload = Buffer.from(buf.subarray(at + 4, at + 4 + len));
      for (let i = 0; i < payload.length; i++) payload[i]! ^= mask[i & 3]!;
      this.frames.push({ mask, payload });
      buf = buf.subarray(at + 4 + len);
    }
  }

  close(): Promise<void> {
    for (const socket of this.#sockets) socket.destroy();
    return new Promise((r) => this.server.close(() => r()));
  }
}

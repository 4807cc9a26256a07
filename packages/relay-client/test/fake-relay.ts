import { createServer as createHttp, type Server } from "node:http";
import { createServer as createHttps } from "node:https";
import type { AddressInfo } from "node:net";
import {
  decodeBf16,
  decodeF16,
  decodeFrame,
  encodeFrame,
  type Frame,
  PROTOCOL_VERSION,
} from "@moeswarm/core";
import { type WebSocket, WebSocketServer } from "ws";

/**
 * A scriptable stand-in for the hub's relay, just enough protocol to drive one client: it accepts
 * the token "good", records every frame, answers dispatches by echoing x as each slot's output,
 * and can go silent, drop connections or misbehave on demand.
 */
export class FakeRelay {
  readonly received: Frame[] = [];
  readonly sockets: WebSocket[] = [];
  connections = 0;
  silent = false;
  /** Hold dispatches instead of answering them. */
  hold = false;
  readonly held: Extract<Frame, { t: "dispatch" }>[] = [];
  private constructor(
    readonly server: Server,
    readonly wss: WebSocketServer,
    readonly url: string,
  ) {}

  static async start(tls?: { cert: string; key: string }): Promise<FakeRelay> {
    const server = tls ? createHttps(tls) : createHttp();
    const wss = new WebSocketServer({ server, perMessageDeflate: false });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    const port = (server.address() as AddressInfo).port;
    const relay = new FakeRelay(server, wss, `${tls ? "wss://localhost" : "ws://127.0.0.1"}:${port}/relay`);
    wss.on("connection", (ws) => relay.onConnection(ws));
    return relay;
  }

  private onConnection(ws: WebSocket): void {
    this.connections++;
    this.sockets.push(ws);
    ws.on("error", () => {});
    ws.on("message", (data: Buffer) => {
      if (this.silent) return;
      const frame = decodeFrame(data);
      this.received.push(frame);
      this.onFrame(ws, frame);
    });
  }

  private onFrame(ws: WebSocket, frame: Frame): void {
    switch (frame.t) {
      case "hello":
        if (frame.token !== "good") {
          this.send(ws, { t: "error", v: PROTOCOL_VERSION, code: "MOESWARM_AUTH_INVALID", msg: "bad token" });
          ws.close(4001, "MOESWARM_AUTH_INVALID");
          return;
        }
        this.send(ws, { ...frame, token: "" });
        return;
      case "ping":
        this.send(ws, { t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts });
        return;
      case "dispatch": {
        if (this.hold) {
          this.held.push(frame);
          return;
        }
        this.answer(ws, frame);
        return;
      }
      default:
    }
  }

  /** Answers with y = x of token i in every slot (mode each) or x * sum_j w_ij (mode sum). */
  answer(ws: WebSocket, frame: Extract<Frame, { t: "dispatch" }>): void {
    const { n, k, embd, mode } = frame;
    const x =
      frame.dtype === "f32" ? frame.x : frame.dtype === "f16" ? decodeF16(frame.x) : decodeBf16(frame.x);
    const y = new Float32Array((mode === "each" ? n * k : n) * embd);
    for (let i = 0; i < n; i++) {
      if (mode === "each")
        for (let j = 0; j < k; j++) y.set(x.subarray(i * embd, (i + 1) * embd), (i * k + j) * embd);
      else {
        let s = 0;
        for (let j = 0; j < k; j++) s += frame.w![i * k + j]!;
        for (let d = 0; d < embd; d++) y[i * embd + d] = x[i * embd + d]! * s;
      }
    }
    this.send(ws, {
      t: "result",
      v: PROTOCOL_VERSION,
      id: frame.id,
      from: frame.to,
      mode,
      n,
      k,
      embd,
      y,
      ms: 1.5,
    });
  }

  send(ws: WebSocket, frame: Frame): void {
    ws.send(encodeFrame(frame, { maxFrameBytes: 2 ** 30 }));
  }

  get last(): WebSocket {
    return this.sockets.at(-1)!;
  }

  framesOf<T extends Frame["t"]>(t: T): Extract<Frame, { t: T }>[] {
    return this.received.filter((f): f is Extract<Frame, { t: T }> => f.t === t);
  }

  dropAll(): void {
    for (const ws of this.sockets) ws.terminate();
  }

  async close(): Promise<void> {
    this.dropAll();
    await new Promise<void>((r) => this.wss.close(() => r()));
    this.server.closeAllConnections?.();
    await new Promise<void>((r) => this.server.close(() => r()));
  }
}

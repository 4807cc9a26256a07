import { existsSync, lstatSync, rmSync } from "node:fs";
import { connect, createServer, type Server, type Socket } from "node:net";
import {
  encodeLengthPrefixed,
  errorFrame,
  type Frame,
  FrameReader,
  isMoeswarmError,
  TransportError,
  traceHop,
} from "@moeswarm/core";
import type { BridgeCounters } from "./bridge-metrics.js";

// The plugin's side of the bridge: the socket libggml-moeswarm connects to, and each connection's
// intake of length-prefixed frames. What a frame asks for is the caller's business (`onPayload`).

/** Where the bridge listens: a Unix socket path, or TCP (port 0 picks a free one). */
export type BridgeSocket = string | { readonly host?: string; readonly port: number };

/** Writes one frame back to the plugin connection it came from. */
export type ReplyFn = (frame: Frame) => void;

/** One plugin connection, as the frames' handlers see it. */
export interface PluginConnection {
  /** Writes one of core's frames (a result, an error, a pong). */
  readonly reply: ReplyFn;
  /** Writes one msgpack payload that is not one of core's frames (the native plane's), length-prefixed. */
  sendPayload(payload: Uint8Array): void;
  /** Called once when the connection is gone (at once if it already is). */
  onClose(listener: () => void): void;
}

export interface PluginServerOptions {
  maxFrameBytes: number;
  /** Connections, bytes and broken streams are counted here. */
  counters: BridgeCounters;
  /** One whole frame's payload (its length prefix counted and removed), in arrival order. */
  onPayload(payload: Uint8Array, conn: PluginConnection): void;
}

/** A Unix socket left by a process that died: nobody accepts on it. */
function staleSocket(path: string): Promise<boolean> {
  return new Promise((resolve) => {
    if (!existsSync(path) || !lstatSync(path).isSocket()) {
      resolve(false);
      return;
    }
    const probe = connect(path);
    probe.once("connect", () => {
      probe.destroy();
      resolve(false);
    });
    probe.once("error", (e: NodeJS.ErrnoException) => resolve(e.code === "ECONNREFUSED"));
  });
}

function listen(server: Server, socket: BridgeSocket): Promise<void> {
  return new Promise((resolve, reject) => {
    const onError = (e: Error) => {
      server.off("listening", onListening);
      reject(e);
    };
    const onListening = () => {
      server.off("error", onError);
      resolve();
    };
    server.once("error", onError);
    server.once("listening", onListening);
    if (typeof socket === "string") server.listen(socket);
    else server.listen(socket.port, socket.host ?? "127.0.0.1");
  });
}

function errorMessage(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/** The socket server the plugin connects to; `listen` resolves with its `MOESWARM_BRIDGE` address. */
export class PluginServer {
  private readonly server: Server;
  private readonly sockets = new Set<Socket>();
  private socketPath: string | undefined;

  constructor(private readonly options: PluginServerOptions) {
    this.server = createServer((socket) => this.serveConnection(socket));
  }

  /** Plugin connections open now. */
  get connections(): number {
    return this.sockets.size;
  }

  /** Listens on `socket`, taking over a Unix socket a dead process left; the address to give the plugin. */
  async listen(socket: BridgeSocket): Promise<string> {
    const socketPath = typeof socket === "string" ? socket : undefined;
    try {
      await listen(this.server, socket);
    } catch (error) {
      if (
        socketPath &&
        (error as NodeJS.ErrnoException).code === "EADDRINUSE" &&
        (await staleSocket(socketPath))
      ) {
        rmSync(socketPath, { force: true });
        await listen(this.server, socket);
      } else {
        throw new TransportError(
          "MOESWARM_TRANSPORT_CONNECT",
          `the bridge cannot listen on ${socketPath ?? JSON.stringify(socket)}: ${(error as Error).message}`,
          { cause: error },
        );
      }
    }
    this.socketPath = socketPath;
    if (socketPath !== undefined) return `unix:${socketPath}`;
    const bound = this.server.address();
    const host =
      typeof bound === "object" && bound
        ? bound.family === "IPv6"
          ? `[${bound.address}]`
          : bound.address
        : "127.0.0.1";
    return `tcp:${host}:${typeof bound === "object" && bound ? bound.port : 0}`;
  }

  /** Stops listening, drops every connection and removes the Unix socket. */
  async close(): Promise<void> {
    const closed = new Promise<void>((resolve) => this.server.close(() => resolve()));
    for (const s of this.sockets) s.destroy();
    await closed;
    const path = this.socketPath;
    if (path && (await staleSocket(path))) rmSync(path, { force: true });
  }

  private send(socket: Socket, frame: Frame | Uint8Array): void {
    if (socket.destroyed) return;
    const bytes = encodeLengthPrefixed(frame, { maxFrameBytes: 0xffff_ffff });
    this.options.counters.totals.bytesOut += bytes.byteLength;
    socket.write(bytes);
  }

  // core's FrameReader (what readFrames wraps): on a broken stream the bridge can still write its
  // error frame before it ends the connection
  private serveConnection(socket: Socket): void {
    const { counters, maxFrameBytes, onPayload } = this.options;
    this.sockets.add(socket);
    counters.totals.connectionsTotal++;
    socket.setNoDelay(true);
    const reader = new FrameReader({ maxFrameBytes });
    const reply: ReplyFn = (frame) => this.send(socket, frame);
    const conn: PluginConnection = {
      reply,
      sendPayload: (payload) => this.send(socket, payload),
      onClose: (listener) => {
        if (socket.destroyed) listener();
        else socket.once("close", listener);
      },
    };
    const broken = (error: unknown) => {
      const code = isMoeswarmError(error) ? error.code : "MOESWARM_PROTOCOL_MALFORMED";
      counters.error(code);
      reply(errorFrame({ code, msg: errorMessage(error) }));
      socket.end();
      socket.removeListener("data", onData);
    };
    const onData = (chunk: Buffer) => {
      traceHop("bridge.in");
      let payloads: Uint8Array[];
      try {
        payloads = reader.push(chunk);
      } catch (error) {
        broken(error);
        return;
      }
      for (const p of payloads) {
        counters.totals.bytesIn += p.byteLength + 4;
        onPayload(p, conn);
      }
    };
    socket.on("data", onData);
    socket.on("end", () => {
      try {
        reader.end();
        socket.end();
      } catch (error) {
        broken(error);
      }
    });
    socket.on("error", () => socket.destroy());
    socket.on("close", () => this.sockets.delete(socket));
  }
}

import type { KeyObject } from "node:crypto";
import { X509Certificate } from "node:crypto";
import { createServer, type Server } from "node:https";
import type { AddressInfo, Socket } from "node:net";
import {
  AuthError,
  InvalidArgumentError,
  isMoeswarmError,
  type MoeswarmError,
  TransportError,
  traceHop,
} from "@moeswarm/core";
import { type WebSocket, WebSocketServer } from "ws";
import { CLOSE_AUTH, CLOSE_HOSTILE, CLOSE_SHUTDOWN } from "./close-codes.js";
import type { DispatchHandler } from "./connection-types.js";
import { type DirectTicketClaims, ticketKeyId, verifyDirectTicket } from "./direct-ticket.js";
import { FrameWriter } from "./frame-writer.js";
import type { FrameLink } from "./link.js";
import { WorkerServing } from "./serving.js";
import { decodeFrame, type EncodableFrame, type Frame, PROTOCOL_VERSION } from "./wire.js";

/*
 * A worker's direct endpoint: a TLS WebSocket server that speaks the relay's frames to backbones
 * that dial it, so a reachable worker is one hop from its backbones instead of two. It behaves,
 * to a backbone, as a relay that knows one worker: the backbone's `connectRelay` says hello with a
 * ticket the hub signed (direct-ticket.ts) instead of its token, and then sends `dispatch` frames
 * addressed to this worker. Nothing but a hello is read before the ticket checks out, and every
 * refusal is an error frame with its code, then a close (as the relay does).
 */

export interface DirectServerOptions {
  /** This worker's id (tickets must name it). */
  id: string;
  /** PEM certificate and key served (self-signed is fine: backbones pin the fingerprint). */
  cert: string;
  key: string;
  /** Interface to listen on (default "0.0.0.0"). */
  host?: string;
  /** Port (default 0: any free one). */
  port?: number;
  /**
   * The hub's ticket-signing key with id `kid` (GET /api/direct/key), asked when a ticket names a
   * key not seen yet (the hub restarted); at most once per `keyRefreshMs`.
   */
  hubKey(kid: string | undefined): Promise<{ kid: string; key: KeyObject }>;
  /** Answers each dispatch (the same handler as the relay connection's). */
  onDispatch: DispatchHandler;
  /** Largest frame accepted or sent (default 64 MiB). */
  maxFrameBytes?: number;
  /** Dispatches held at once per backbone before MOESWARM_TRANSPORT_LIMIT (default 256). */
  maxIncoming?: number;
  /** Time a new connection has to say hello (default 10000 ms). */
  helloTimeoutMs?: number;
  /**
   * Silence after which a backbone counts as dead and its connection is cut (default 15000 ms;
   * a backbone pings every 5 s), so a vanished one does not hold its dispatches.
   */
  deadPeerMs?: number;
  /** Connections not past the hello at once; more are refused at once (default 64). */
  maxPending?: number;
  /** Least time between two key fetches (default 10000 ms). */
  keyRefreshMs?: number;
  /** Now, unix ms (tests). */
  now?: () => number;
  /** Each refused hello, for the worker's log. */
  onRefused?(error: MoeswarmError, remote: string | undefined): void;
}

export interface DirectServerStats {
  /** Connections accepted (a valid ticket), and refused. */
  accepted: number;
  refused: number;
  /** Backbones connected now. */
  connected: number;
  /** Dispatch frames received on accepted connections. */
  dispatches: number;
}

export interface DirectServer extends AsyncDisposable {
  /** The port listened on. */
  readonly port: number;
  /** SHA-256 fingerprint of the certificate served (what the hub publishes for pinning). */
  readonly fingerprint: string;
  stats(): DirectServerStats;
  /** Closes every connection (their dispatches are aborted) and the listener. */
  close(): Promise<void>;
}

/** The SHA-256 fingerprint of a PEM certificate, as Node prints it (AA:BB:...). */
export function certificateFingerprint(pem: string): string {
  return new X509Certificate(pem).fingerprint256;
}

/** Starts a worker's direct endpoint; resolves once it listens. */
export async function serveDirect(options: DirectServerOptions): Promise<DirectServer> {
  if (typeof options?.id !== "string" || options.id.length === 0) {
    throw new InvalidArgumentError("serveDirect needs the worker's id");
  }
  if (typeof options.onDispatch !== "function" || typeof options.hubKey !== "function") {
    throw new InvalidArgumentError("serveDirect needs onDispatch and hubKey functions");
  }
  const fingerprint = certificateFingerprint(options.cert);
  const server = createServer({ cert: options.cert, key: options.key });
  const state = new DirectState(options);
  const wss = new WebSocketServer({
    server,
    maxPayload: 2 * state.maxFrameBytes,
    perMessageDeflate: false,
    clientTracking: false,
  });
  wss.on("error", () => {});
  wss.on("connection", (ws, req) => state.connection(ws, req.socket));
  await new Promise<void>((resolve, reject) => {
    server.once("error", (cause) =>
      reject(
        new TransportError(
          "MOESWARM_TRANSPORT_CONNECT",
          `cannot listen on ${options.host ?? "0.0.0.0"}:${options.port ?? 0}: ${cause.message}`,
          { cause },
        ),
      ),
    );
    server.listen(options.port ?? 0, options.host ?? "0.0.0.0", () => resolve());
  });
  const port = (server.address() as AddressInfo).port;
  let closing: Promise<void> | undefined;
  const close = () => {
    closing ??= closeServer(server, wss, state);
    return closing;
  };
  return {
    port,
    fingerprint,
    stats: () => ({ ...state.counters, connected: state.links.size }),
    close,
    [Symbol.asyncDispose]: close,
  };
}

async function closeServer(server: Server, wss: WebSocketServer, state: DirectState): Promise<void> {
  for (const close of [...state.links]) close();
  await new Promise<void>((resolve) => wss.close(() => resolve()));
  server.closeAllConnections?.();
  await new Promise<void>((resolve) => server.close(() => resolve()));
}

/** What every connection shares: the keys, the counters, the live connections. */
class DirectState {
  readonly maxFrameBytes: number;
  readonly counters = { accepted: 0, refused: 0, dispatches: 0 };
  /** Connections not past the hello. */
  pending = 0;
  /** Each live connection's close. */
  readonly links = new Set<() => void>();
  readonly #o: DirectServerOptions;
  readonly #writer: FrameWriter;
  readonly #keys = new Map<string, KeyObject>();
  #lastFetch = Number.NEGATIVE_INFINITY;
  #fetching: Promise<void> | undefined;

  constructor(o: DirectServerOptions) {
    this.#o = o;
    this.maxFrameBytes = o.maxFrameBytes ?? 64 * 1024 * 1024;
    this.#writer = new FrameWriter(this.maxFrameBytes);
  }

  /** The hub's keys, fetched again when a ticket names one not seen (rate-limited). */
  async #keysFor(kid: string | undefined): Promise<ReadonlyMap<string, KeyObject>> {
    if (kid !== undefined && this.#keys.has(kid)) return this.#keys;
    const now = performance.now();
    if (!this.#fetching && now - this.#lastFetch >= (this.#o.keyRefreshMs ?? 10_000)) {
      this.#lastFetch = now;
      this.#fetching = this.#o
        .hubKey(kid)
        .then(({ kid: id, key }) => void this.#keys.set(id, key))
        .catch(() => {})
        .finally(() => {
          this.#fetching = undefined;
        });
    }
    await this.#fetching;
    return this.#keys;
  }

  #send(link: FrameLink, frame: EncodableFrame): void {
    this.#writer.send(link, frame);
  }

  connection(ws: WebSocket, socket: Socket): void {
    socket.setNoDelay(true);
    // any bytes reset it; a healthy backbone pings every 5 s
    socket.setTimeout(this.#o.deadPeerMs ?? 15_000, () => ws.terminate());
    let live: { claims: DirectTicketClaims; serving: WorkerServing } | undefined;
    let verifying = false;
    let closed = false;
    const link: FrameLink = {
      // a server frame is never masked: ws writes the bytes it is given, and calls back once written
      callsSent: true,
      get bufferedBytes() {
        return ws.bufferedAmount;
      },
      send: (bytes, sent) => ws.send(bytes, { binary: true }, sent),
      close: (code = 1000, reason = "") => ws.close(code, reason.slice(0, 120)),
      destroy: () => ws.terminate(),
    };
    let refused = false;
    const refuse = (error: MoeswarmError, code = CLOSE_AUTH) => {
      // once: frames may still arrive while the close completes
      if (refused) return;
      refused = true;
      this.counters.refused++;
      this.#o.onRefused?.(error, socket.remoteAddress);
      this.#send(link, { t: "error", v: PROTOCOL_VERSION, code: error.code, msg: error.message });
      ws.close(code, error.code);
    };
    let pending = true;
    const settle = () => {
      if (pending) this.pending--;
      pending = false;
    };
    this.pending++;
    if (this.pending > (this.#o.maxPending ?? 64)) {
      settle();
      refuse(
        new TransportError("MOESWARM_TRANSPORT_LIMIT", "too many connections waiting for their hello"),
        1013,
      );
      return;
    }
    const hello = setTimeout(() => {
      if (!live) refuse(new AuthError("MOESWARM_AUTH_MISSING", "no hello within the hello timeout"));
    }, this.#o.helloTimeoutMs ?? 10_000);
    hello.unref?.();
    const closeThis = () => ws.close(CLOSE_SHUTDOWN, "the worker is closing");
    this.links.add(closeThis);
    ws.on("close", () => {
      closed = true;
      settle();
      clearTimeout(hello);
      this.links.delete(closeThis);
      live?.serving.abortAll(new TransportError("MOESWARM_TRANSPORT_CLOSED", "direct link closed"));
      live?.serving.end();
    });
    ws.on("error", () => {});
    ws.on("message", (data: Buffer, isBinary: boolean) => {
      traceHop("direct.in");
      let frame: Frame;
      try {
        if (!isBinary) throw new TransportError("MOESWARM_TRANSPORT_CLOSED", "frames are binary");
        frame = decodeFrame(data, { maxFrameBytes: this.maxFrameBytes });
      } catch (error) {
        const e = isMoeswarmError(error) ? error : new AuthError("MOESWARM_AUTH_MISSING", String(error));
        refuse(e, CLOSE_HOSTILE);
        return;
      }
      if (!live) {
        if (verifying)
          refuse(new AuthError("MOESWARM_AUTH_MISSING", "a frame arrived before the hello was accepted"));
        else if (frame.t !== "hello" || frame.role !== "backbone") {
          refuse(new AuthError("MOESWARM_AUTH_MISSING", "the first frame must be a backbone's hello"));
        } else {
          verifying = true;
          void this.#admit(frame.token, frame.id).then(
            (claims) => {
              verifying = false;
              if (closed || refused) return;
              clearTimeout(hello);
              settle();
              live = { claims, serving: this.#serving(() => (closed ? undefined : link)) };
              this.counters.accepted++;
              const caps = {
                maxFrame: Math.min(frame.caps?.maxFrame ?? this.maxFrameBytes, this.maxFrameBytes),
              };
              this.#send(link, {
                t: "hello",
                v: PROTOCOL_VERSION,
                role: "backbone",
                id: frame.id,
                token: "",
                caps,
              });
            },
            (error: unknown) => {
              verifying = false;
              if (!closed)
                refuse(
                  isMoeswarmError(error)
                    ? error
                    : new AuthError("MOESWARM_AUTH_TICKET_INVALID", String(error)),
                );
            },
          );
        }
        return;
      }
      this.#onFrame(link, live.claims, live.serving, frame);
    });
  }

  async #admit(ticket: string, backbone: string): Promise<DirectTicketClaims> {
    const keys = await this.#keysFor(ticketKeyId(ticket));
    return verifyDirectTicket(ticket, {
      keys,
      worker: this.#o.id,
      backbone,
      now: this.#o.now?.() ?? Date.now(),
    });
  }

  #serving(current: () => FrameLink | undefined): WorkerServing {
    return new WorkerServing({
      id: this.#o.id,
      maxIncoming: this.#o.maxIncoming ?? 256,
      onDispatch: this.#o.onDispatch,
      send: (l, frame) => this.#send(l, frame),
      link: current,
    });
  }

  #onFrame(link: FrameLink, claims: DirectTicketClaims, serving: WorkerServing, frame: Frame): void {
    switch (frame.t) {
      case "dispatch":
        this.counters.dispatches++;
        if (frame.to !== undefined && frame.to !== this.#o.id) {
          const msg = `this is worker ${this.#o.id}, not ${frame.to}`;
          this.#send(link, {
            t: "error",
            v: PROTOCOL_VERSION,
            id: frame.id,
            code: "MOESWARM_TRANSPORT_UNKNOWN_PEER",
            msg,
          });
          return;
        }
        // the sender is who the ticket names, whatever the frame says
        serving.accept(link, frame, claims.sub);
        return;
      case "ping":
        this.#send(link, { t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts });
        return;
      default:
        // pongs, a second hello, register or drain: nothing for a direct endpoint to do
        return;
    }
  }
}

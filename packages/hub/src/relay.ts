import type { Server as HttpServer, IncomingMessage } from "node:http";
import type { Server as HttpsServer } from "node:https";
import type { Duplex } from "node:stream";
import {
  decodeFrame,
  encodeFrame,
  type Frame,
  FrameRerouter,
  InvalidArgumentError,
  isMoeswarmError,
  PROTOCOL_VERSION,
  traceHop,
} from "@moeswarm/core";
import {
  CLOSE_AUTH,
  CLOSE_DEAD_PEER,
  CLOSE_HOSTILE,
  CLOSE_REPLACED,
  CLOSE_SHUTDOWN,
} from "@moeswarm/relay-client";
import { type WebSocket, WebSocketServer } from "ws";
import { RouteDeadlines } from "./relay-deadlines.js";
import { Peer, type RelaySettings, readRelayOptions, sliceKey } from "./relay-peer.js";
import {
  answerBackbone,
  expireRoute,
  finishRoute,
  type RelayLink,
  routeAnswer,
  routeDispatch,
} from "./relay-routing.js";
import type {
  BackboneInfo,
  Relay,
  RelayOptions,
  RelayServerEvent,
  RelayStats,
  SliceInfo,
  WorkerInfo,
} from "./relay-types.js";
import { principalOf, type TokenClaims, unboundMessage, verifyToken } from "./token.js";
import { TokenBucket } from "./token-bucket.js";

export type {
  BackboneInfo,
  ForwardInfo,
  Relay,
  RelayOptions,
  RelayServerEvent,
  RelayStats,
  SliceInfo,
  WorkerInfo,
} from "./relay-types.js";

const noop = () => {};

// The relay server: connections (admission, hello and its token, heartbeats, violations, drops)
// and the frames they carry. The peer state and options are in relay-peer.ts, the routing of
// dispatches and answers in relay-routing.ts, the public shapes in relay-types.ts.

/**
 * Creates the relay: peers dial in over WebSocket, say hello with a token, workers register
 * their slices, backbones' dispatches are routed to the named worker and its answers back.
 * It serves no port itself; mount it with attach(server) or handleUpgrade().
 */
export function createRelay(options: RelayOptions): Relay {
  return new RelayServer(readRelayOptions(options));
}

class RelayServer implements Relay {
  readonly path: string;
  readonly #s: RelaySettings;
  /**
   * Frames are validated with `raw`: activations and outputs stay the frame's bytes, so a
   * forwarded frame's payload is never decoded. (One object for every frame.)
   */
  readonly #decodeOptions: { readonly maxFrameBytes: number; readonly raw: true };
  /** What relay-routing.ts reaches of this server. */
  readonly #link: RelayLink;
  readonly #wss: WebSocketServer;
  readonly #peers = new Set<Peer>();
  readonly #workers = new Map<string, Peer>();
  readonly #backbones = new Map<string, Peer>();
  readonly #sweep: ReturnType<typeof setInterval>;
  #closed = false;
  readonly #stats: RelayStats = {
    connections: 0,
    workers: 0,
    backbones: 0,
    framesIn: 0,
    framesOut: 0,
    bytesIn: 0,
    bytesOut: 0,
    routed: 0,
    copied: 0,
    refused: 0,
    violations: 0,
  };

  constructor(s: RelaySettings) {
    this.#s = s;
    this.path = s.path;
    this.#decodeOptions = { maxFrameBytes: s.maxFrameBytes, raw: true };
    this.#wss = new WebSocketServer({
      noServer: true,
      // the soft limit (maxFrameBytes) answers with an error frame; this hard one stops a
      // hostile length before ws buffers it
      maxPayload: 2 * s.maxFrameBytes,
      perMessageDeflate: false,
      clientTracking: false,
    });
    this.#wss.on("error", noop);
    const tick = Math.max(5, Math.min(s.heartbeatMs, s.deadPeerMs / 4));
    this.#sweep = setInterval(() => this.#guard(() => this.#onTick()), tick);
    this.#sweep.unref?.();
    this.#link = {
      s,
      stats: this.#stats,
      workers: this.#workers,
      guard: (fn) => this.#guard(fn),
      emit: (event) => this.#emit(event),
      sendBytes: (peer, bytes) => this.#sendBytes(peer, bytes),
      rerouter: new FrameRerouter(),
      deadlines: new RouteDeadlines(this.#workers, (route) =>
        this.#guard(() => expireRoute(this.#link, route)),
      ),
      error: (peer, code, msg, id, from) => this.#error(peer, code, msg, id, from),
      violation: (peer, code, msg, id) => this.#violation(peer, code, msg, id),
      drop: (peer, code, reason, destroy) => this.#drop(peer, code, reason, destroy),
    };
  }

  // --- plumbing -----------------------------------------------------------------------------

  /** Nothing a peer sends may throw out of an event handler and take the process down. */
  #guard(fn: () => void): void {
    try {
      fn();
    } catch {
      // a bug here must not crash the hub; the peer at fault is dropped by the caller's state
    }
  }

  #emit(event: RelayServerEvent): void {
    const hook = this.#s.onEvent;
    if (!hook) return;
    try {
      hook(event);
    } catch {
      // the hook's problem, not the relay's
    }
  }

  #send(peer: Peer, frame: Frame): boolean {
    if (peer.closed) return false;
    let bytes: Uint8Array;
    try {
      bytes = encodeFrame(frame, { maxFrameBytes: 2 * this.#s.maxFrameBytes });
    } catch {
      return false;
    }
    return this.#sendBytes(peer, bytes);
  }

  #sendBytes(peer: Peer, bytes: Uint8Array): boolean {
    if (peer.closed || peer.ws.readyState !== 1) return false;
    this.#stats.framesOut++;
    this.#stats.bytesOut += bytes.byteLength;
    peer.ws.send(bytes, { binary: true }, noop);
    return true;
  }

  #error(peer: Peer, code: string, msg: string, id?: number, from?: string): void {
    this.#send(peer, { t: "error", v: PROTOCOL_VERSION, id, from, code, msg: msg.slice(0, 4096) });
  }

  // --- connections --------------------------------------------------------------------------

  handleUpgrade(req: IncomingMessage, socket: Duplex, head: Buffer): boolean {
    let pathname: string;
    try {
      pathname = new URL(req.url ?? "/", "http://relay").pathname;
    } catch {
      return false;
    }
    if (pathname !== this.path) return false;
    socket.on("error", noop);
    if (this.#closed || this.#peers.size >= this.#s.maxConnections) {
      socket.end("HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
      return true;
    }
    const remote = `${req.socket.remoteAddress ?? "?"}:${req.socket.remotePort ?? "?"}`;
    try {
      this.#wss.handleUpgrade(req, socket, head, (ws) =>
        this.#guard(() => this.#onConnection(ws, socket, remote)),
      );
    } catch {
      socket.destroy();
    }
    return true;
  }

  attach(server: HttpServer | HttpsServer): () => void {
    const onUpgrade = (req: IncomingMessage, socket: Duplex, head: Buffer) => {
      if (this.handleUpgrade(req, socket, head)) return;
      // nobody else on this server takes upgrades: say so rather than leave the socket hanging
      if (server.listenerCount("upgrade") === 1) {
        socket.on("error", noop);
        socket.end("HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
      }
    };
    server.on("upgrade", onUpgrade);
    return () => {
      server.off("upgrade", onUpgrade);
    };
  }

  #onConnection(ws: WebSocket, socket: Duplex, remote: string): void {
    const peer = new Peer(ws, remote, new TokenBucket(this.#s.ratePerSec, this.#s.burst));
    this.#peers.add(peer);
    this.#stats.connections = this.#peers.size;
    // TCP_NODELAY: ws sets it on every socket it takes; dispatch latency depends on it
    socket.on("data", () => {
      peer.lastSeen = Date.now();
    });
    ws.on("error", noop);
    ws.on("message", (data: Buffer, isBinary: boolean) => {
      // #guard without its closure: this runs for every frame
      try {
        this.#onMessage(peer, data, isBinary);
      } catch {
        // as in #guard
      }
    });
    ws.on("close", (code: number, reason: Buffer) =>
      this.#guard(() => this.#drop(peer, code, reason.toString() || "closed by the peer", false)),
    );
  }

  #onTick(): void {
    const t = Date.now();
    for (const peer of [...this.#peers]) {
      if (peer.closed) continue;
      if (!peer.live) {
        if (t - peer.connectedAt > this.#s.helloTimeoutMs) {
          this.#refuse(peer, "MOESWARM_AUTH_MISSING", "no hello within the hello timeout");
        }
        continue;
      }
      if (t - peer.lastSeen > this.#s.deadPeerMs) {
        this.#drop(peer, CLOSE_DEAD_PEER, `no frame for ${t - peer.lastSeen} ms`, true);
        continue;
      }
      if (t - peer.lastPing >= this.#s.heartbeatMs) {
        peer.lastPing = t;
        this.#send(peer, { t: "ping", v: PROTOCOL_VERSION, seq: peer.pingSeq++, ts: performance.now() });
      }
    }
  }

  /** Refuses a peer that has not (validly) said hello: an error frame, then close. */
  #refuse(peer: Peer, code: string, msg: string): void {
    this.#error(peer, code, msg);
    this.#emit({ type: "refused", code, msg, remote: peer.remote });
    this.#drop(peer, CLOSE_AUTH, code, false);
  }

  /**
   * Forgets a peer at once: its routes fail now (a worker's in-flight requests are answered with
   * TRANSPORT_CLOSED so backbones fail over without waiting for their deadline), then the socket
   * is closed, or destroyed when the peer is dead.
   */
  #drop(peer: Peer, code: number, reason: string, destroy: boolean): void {
    if (peer.closed) return;
    peer.closed = true;
    this.#peers.delete(peer);
    this.#stats.connections = this.#peers.size;
    if (peer.live && peer.id !== undefined) {
      const table = peer.role === "worker" ? this.#workers : this.#backbones;
      if (table.get(peer.id) === peer) table.delete(peer.id);
      this.#stats.workers = this.#workers.size;
      this.#stats.backbones = this.#backbones.size;
    }
    for (const route of [...peer.routes.values()]) {
      finishRoute(this.#link, route);
      answerBackbone(this.#link, route, {
        t: "error",
        v: PROTOCOL_VERSION,
        id: route.origId,
        code: "MOESWARM_TRANSPORT_CLOSED",
        msg: `worker ${peer.id} went away before answering (${reason})`,
      });
    }
    // a gone backbone's routes stay with their workers until answered, so in-flight counts stay true
    peer.outstanding.clear();
    this.#emit({ type: "disconnect", role: peer.role, id: peer.id, code, reason });
    const ws = peer.ws;
    if (destroy || ws.readyState !== 1) {
      ws.terminate();
      return;
    }
    ws.close(code, reason.slice(0, 120));
    // a peer that does not answer the close handshake is cut off
    peer.killTimer = setTimeout(() => ws.terminate(), 2000);
    peer.killTimer.unref?.();
    ws.once("close", () => clearTimeout(peer.killTimer));
  }

  #violation(peer: Peer, code: string, msg: string, id?: number): void {
    this.#stats.violations++;
    if (!peer.live) {
      // an unauthenticated connection gets no second chance
      this.#refuse(peer, code, msg);
      return;
    }
    this.#error(peer, code, msg, id);
    const t = Date.now();
    peer.violations.push(t);
    while (peer.violations.length > 0 && t - (peer.violations[0] as number) > this.#s.violationWindowMs) {
      peer.violations.shift();
    }
    const hostile = peer.violations.length >= this.#s.maxViolations;
    this.#emit({ type: "violation", id: peer.id, code, msg, closed: hostile });
    if (hostile) {
      this.#drop(peer, CLOSE_HOSTILE, `${code}: ${peer.violations.length} protocol violations`, false);
    }
  }

  // --- frames -------------------------------------------------------------------------------

  #onMessage(peer: Peer, data: Buffer, isBinary: boolean): void {
    if (peer.closed) return;
    traceHop("hub.in");
    peer.lastSeen = Date.now();
    this.#stats.framesIn++;
    this.#stats.bytesIn += data.byteLength;
    if (!isBinary) {
      this.#violation(peer, "MOESWARM_PROTOCOL_MALFORMED", "frames are binary WebSocket messages");
      return;
    }
    let frame: Frame;
    try {
      // raw: activations and outputs stay the frame's bytes; a forwarded frame's payload is never decoded
      frame = decodeFrame(data, this.#decodeOptions);
    } catch (error) {
      if (!isMoeswarmError(error)) throw error;
      const id = typeof error.details?.id === "number" ? error.details.id : undefined;
      this.#violation(peer, error.code, error.message, id);
      return;
    }
    if (!peer.live) {
      if (frame.t === "hello") this.#onHello(peer, frame);
      else this.#refuse(peer, "MOESWARM_AUTH_MISSING", `the first frame must be hello, not ${frame.t}`);
      return;
    }
    // answers and pongs are bounded by what the relay itself sent; everything else is rated
    if (frame.t !== "result" && frame.t !== "error" && frame.t !== "pong" && !peer.bucket.take()) {
      const id = frame.t === "dispatch" ? frame.id : undefined;
      this.#stats.refused += id === undefined ? 0 : 1;
      this.#error(
        peer,
        "MOESWARM_TRANSPORT_LIMIT",
        `over the rate limit of ${this.#s.ratePerSec} frames/s`,
        id,
      );
      return;
    }
    switch (frame.t) {
      case "hello":
        this.#violation(peer, "MOESWARM_PROTOCOL_BAD_FIELD", "hello was already accepted on this connection");
        return;
      case "ping":
        this.#send(peer, { t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts });
        return;
      case "pong":
        if (frame.seq === peer.pingSeq - 1) peer.rttMs = performance.now() - frame.ts;
        return;
      case "register": {
        if (!this.#workerOnly(peer, frame.t)) return;
        // each register adds a slice; the same model, layers and experts again replaces itself
        const key = sliceKey(frame.model, frame.layers, frame.experts);
        const slice: SliceInfo = {
          model: frame.model,
          layers: frame.layers,
          experts: frame.experts,
          capacity: frame.capacity,
          backend: frame.backend,
        };
        const refusal = this.#s.admitRegister?.(peer.id as string, slice);
        if (refusal) {
          // not a protocol violation: an honest worker may race its lease's end
          this.#error(peer, refusal.code, refusal.message);
          this.#emit({ type: "refused", code: refusal.code, msg: refusal.message, remote: peer.remote });
          return;
        }
        if (!peer.slices.has(key) && peer.slices.size >= this.#s.maxSlicesPerWorker) {
          this.#violation(
            peer,
            "MOESWARM_TRANSPORT_LIMIT",
            `a worker may register at most ${this.#s.maxSlicesPerWorker} slices`,
          );
          return;
        }
        peer.setSlice(key, slice);
        peer.draining = false;
        this.#emit({
          type: "register",
          id: peer.id as string,
          model: frame.model,
          layers: frame.layers,
          experts: frame.experts,
          ...(frame.capacity !== undefined ? { capacity: frame.capacity } : {}),
          ...(frame.backend !== undefined ? { backend: frame.backend } : {}),
          owner: peer.owner ?? (peer.id as string),
        });
        return;
      }
      case "drain":
        if (!this.#workerOnly(peer, frame.t)) return;
        this.#setDraining(peer, frame.reason, "worker");
        return;
      case "dispatch":
        routeDispatch(this.#link, peer, frame, data);
        return;
      case "result":
      case "error":
        if (peer.role !== "worker") return; // a backbone has nothing to answer; ignored
        routeAnswer(this.#link, peer, frame, data);
        return;
    }
  }

  /** No new dispatches, every slice withdrawn (a later register starts a new set). */
  #setDraining(peer: Peer, reason: string | undefined, by: "worker" | "hub"): void {
    peer.draining = true;
    peer.clearSlices();
    this.#emit({
      type: "drain",
      id: peer.id as string,
      ...(reason !== undefined ? { reason } : {}),
      by,
    });
  }

  drainWorker(id: string, reason?: string): boolean {
    if (reason !== undefined && (typeof reason !== "string" || Buffer.byteLength(reason) > 1024)) {
      throw new InvalidArgumentError("a drain reason must be a string of at most 1024 bytes");
    }
    const peer = this.#workers.get(id);
    if (!peer || peer.closed) return false;
    this.#send(peer, { t: "drain", v: PROTOCOL_VERSION, ...(reason !== undefined ? { reason } : {}) });
    this.#setDraining(peer, reason, "hub");
    return true;
  }

  withdrawSlices(id: string, keep: (slice: SliceInfo) => boolean, code: string, reason: string): number {
    const peer = this.#workers.get(id);
    if (!peer || peer.closed) return 0;
    let gone = 0;
    for (const [key, slice] of [...peer.slices]) {
      if (keep(slice)) continue;
      peer.deleteSlice(key);
      gone++;
      this.#error(
        peer,
        code,
        `slice ${slice.model} layers ${slice.layers.join(",")} withdrawn: ${reason}`.slice(0, 4096),
      );
      this.#emit({
        type: "unregister",
        id,
        model: slice.model,
        layers: [...slice.layers],
        experts: [...slice.experts],
        reason,
      });
    }
    return gone;
  }

  notice(id: string, code: string, msg: string): boolean {
    const peer = this.#workers.get(id);
    if (!peer || peer.closed) return false;
    this.#error(peer, code, msg.slice(0, 4096));
    return true;
  }

  disconnect(id: string, code: string, reason: string): boolean {
    let found = false;
    for (const table of [this.#workers, this.#backbones]) {
      const peer = table.get(id);
      if (!peer || peer.closed) continue;
      found = true;
      this.#error(peer, code, reason);
      this.#drop(peer, CLOSE_AUTH, `${code}: ${reason}`, false);
    }
    return found;
  }

  #workerOnly(peer: Peer, t: string): boolean {
    if (peer.role === "worker") return true;
    this.#violation(peer, "MOESWARM_AUTH_ROLE", `a ${peer.role} cannot send ${t}`);
    return false;
  }

  #onHello(peer: Peer, frame: Extract<Frame, { t: "hello" }>): void {
    let claims: TokenClaims;
    try {
      claims = verifyToken(frame.token, this.#s.secret, { role: frame.role, id: frame.id });
    } catch (error) {
      if (!isMoeswarmError(error)) throw error;
      this.#refuse(peer, error.code, error.message);
      return;
    }
    // Only the holder of a token bound to an id can say hello as that id, so the newest hello
    // replacing an older connection below is a reconnect of the same holder, never a takeover.
    // An unbound worker or backbone token could name any id: refused unless the swarm is private
    // (an admin token is the operator's, who may act as anyone).
    if (claims.role !== "admin" && claims.id === undefined && !this.#s.allowUnboundTokens) {
      this.#refuse(peer, "MOESWARM_AUTH_INVALID", unboundMessage(frame.role));
      return;
    }
    const refusal = this.#s.admitHello?.(frame.role, frame.id);
    if (refusal) {
      this.#refuse(peer, refusal.code, refusal.message);
      return;
    }
    peer.role = frame.role;
    peer.id = frame.id;
    peer.owner = principalOf(claims, frame.id);
    peer.live = true;
    if (frame.caps?.maxFrame !== undefined) peer.maxFrame = frame.caps.maxFrame;
    const table = frame.role === "worker" ? this.#workers : this.#backbones;
    const previous = table.get(frame.id);
    // the newest connection wins: after a network change the old one may linger half-open
    if (previous)
      this.#drop(previous, CLOSE_REPLACED, "replaced by a newer connection with the same id", false);
    table.set(frame.id, peer);
    this.#stats.workers = this.#workers.size;
    this.#stats.backbones = this.#backbones.size;
    const peerMax = frame.caps?.maxFrame;
    this.#send(peer, {
      t: "hello",
      v: PROTOCOL_VERSION,
      role: frame.role,
      id: frame.id,
      token: "",
      caps: {
        maxFrame: peerMax === undefined ? this.#s.maxFrameBytes : Math.min(peerMax, this.#s.maxFrameBytes),
      },
    });
    const dtypes = frame.caps?.dtypes;
    this.#emit({
      type: "connect",
      role: frame.role,
      id: frame.id,
      remote: peer.remote,
      ...(dtypes ? { dtypes } : {}),
    });
  }

  // --- queries ------------------------------------------------------------------------------

  workers(): WorkerInfo[] {
    return [...this.#workers.values()].map((p) => ({
      id: p.id as string,
      slices: [...p.slices.values()].map((s) => ({ ...s, layers: [...s.layers], experts: [...s.experts] })),
      lastSeen: p.lastSeen,
      connectedAt: p.connectedAt,
      inFlight: p.routes.size,
      draining: p.draining,
      rttMs: p.rttMs,
      remote: p.remote,
    }));
  }

  backbones(): BackboneInfo[] {
    return [...this.#backbones.values()].map((p) => ({
      id: p.id as string,
      lastSeen: p.lastSeen,
      connectedAt: p.connectedAt,
      inFlight: p.outstanding.size,
      rttMs: p.rttMs,
      remote: p.remote,
    }));
  }

  stats(): RelayStats {
    return { ...this.#stats };
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    clearInterval(this.#sweep);
    this.#link.deadlines.close();
    const sockets = [...this.#peers].map((p) => p.ws);
    for (const peer of [...this.#peers]) this.#drop(peer, CLOSE_SHUTDOWN, "relay shutting down", false);
    await Promise.all(
      sockets.map(
        (ws) =>
          new Promise<void>((resolve) => {
            if (ws.readyState === 3) resolve();
            else ws.once("close", () => resolve());
          }),
      ),
    );
    await new Promise<void>((resolve) => this.#wss.close(() => resolve()));
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

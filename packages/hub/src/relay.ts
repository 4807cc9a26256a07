import type { Server as HttpServer, IncomingMessage } from "node:http";
import type { Server as HttpsServer } from "node:https";
import type { Duplex } from "node:stream";
import {
  type DispatchFrame,
  decodeFrame,
  type ErrorFrame,
  encodeFrame,
  type Frame,
  InvalidArgumentError,
  isMoeswarmError,
  type PeerRole,
  PROTOCOL_VERSION,
  type ResultFrame,
  traceHop,
} from "@moeswarm/core";
import {
  CLOSE_AUTH,
  CLOSE_DEAD_PEER,
  CLOSE_HOSTILE,
  CLOSE_REPLACED,
  CLOSE_SHUTDOWN,
  CLOSE_SLOW_CONSUMER,
} from "@moeswarm/relay-client";
import { type WebSocket, WebSocketServer } from "ws";
import { checkSecret, type TokenSecret, verifyToken } from "./token.js";
import { TokenBucket } from "./token-bucket.js";

export interface RelayOptions {
  /** HMAC secret(s) of the peers' tokens. */
  secret: TokenSecret;
  /** URL path of the WebSocket endpoint (default "/relay"). */
  path?: string;
  /**
   * Largest frame routed (default 64 MiB). A larger one is refused with an `error` frame and
   * the connection survives; one over twice this size is cut off by the WebSocket layer (1009)
   * before it is buffered.
   */
  maxFrameBytes?: number;
  /** Requests a backbone may have outstanding, and a worker may hold (default 256). */
  maxInFlight?: number;
  /** Sustained frames per second per connection, answers excluded (default 2000). */
  ratePerSec?: number;
  /** Burst size of the rate limit (default ratePerSec). */
  burst?: number;
  /** Interval of the relay's pings (default 5000 ms). */
  heartbeatMs?: number;
  /** Silence after which a peer is dropped and its requests fail (default 15000 ms). */
  deadPeerMs?: number;
  /** Time a new connection has to say hello (default 10000 ms). */
  helloTimeoutMs?: number;
  /** How long a routed request without a deadline is tracked (default 120000 ms). */
  requestTimeoutMs?: number;
  /** Bytes that may wait in one peer's send buffer (default 128 MiB, at least 2 frames). */
  maxQueueBytes?: number;
  /** Protocol violations within violationWindowMs that close a connection (default 10). */
  maxViolations?: number;
  violationWindowMs?: number;
  /** Open connections (default 10000); more are answered 503. */
  maxConnections?: number;
  /** Slices (register frames that differ) one worker may hold at once, all models (default 256). */
  maxSlicesPerWorker?: number;
  /** Observability hook (metrics, logs); its exceptions are swallowed. */
  onEvent?: (event: RelayServerEvent) => void;
}

export type RelayServerEvent =
  | { type: "connect"; role: PeerRole; id: string; remote: string }
  | { type: "disconnect"; role?: PeerRole; id?: string; code: number; reason: string }
  | { type: "refused"; code: string; msg: string; remote: string }
  | {
      type: "register";
      id: string;
      model: string;
      layers: number[];
      experts: number[];
      capacity?: number;
      backend?: string;
    }
  /** The worker stopped taking work (its slices are withdrawn): it said so, or the hub asked it. */
  | { type: "drain"; id: string; reason?: string; by: "worker" | "hub" }
  | {
      type: "routed";
      from: string;
      to: string;
      /** `result` delivered, or the code of the error the backbone got. */
      outcome: "result" | string;
      /** Relay-side round trip, dispatch in to answer out. */
      ms: number;
    }
  | { type: "violation"; id?: string; code: string; msg: string; closed: boolean };

export interface SliceInfo {
  model: string;
  layers: number[];
  experts: number[];
  capacity?: number;
  backend?: string;
}

export interface WorkerInfo {
  id: string;
  /** What the worker registered, one entry per slice (register frame), in the order registered. */
  slices: SliceInfo[];
  /** Unix ms of the last bytes received. */
  lastSeen: number;
  connectedAt: number;
  /** Dispatches routed to it and not yet answered. */
  inFlight: number;
  draining: boolean;
  rttMs?: number;
  remote: string;
}

export interface BackboneInfo {
  id: string;
  lastSeen: number;
  connectedAt: number;
  /** Its requests not yet answered. */
  inFlight: number;
  rttMs?: number;
  remote: string;
}

export interface RelayStats {
  connections: number;
  workers: number;
  backbones: number;
  framesIn: number;
  framesOut: number;
  bytesIn: number;
  bytesOut: number;
  /** Dispatches forwarded to a worker. */
  routed: number;
  /** Dispatches answered by the relay itself with an error (unknown peer, limit, worker lost...). */
  refused: number;
  violations: number;
}

export interface Relay extends AsyncDisposable {
  readonly path: string;
  /**
   * Takes an HTTP upgrade for the relay's path; returns false (touching nothing) for any other
   * path, so a server can route other upgrades itself.
   */
  handleUpgrade(req: IncomingMessage, socket: Duplex, head: Buffer): boolean;
  /** Serves the relay on a node:http/https server's upgrades; returns the detach function. */
  attach(server: HttpServer | HttpsServer): () => void;
  workers(): WorkerInfo[];
  backbones(): BackboneInfo[];
  /**
   * Takes a live worker out of service: sends it a `drain` frame, routes it no new dispatches from
   * now on (`MOESWARM_TRANSPORT_DRAINING`) and withdraws its slices; what it holds it finishes.
   * Returns false when no worker with that id is connected.
   */
  drainWorker(id: string, reason?: string): boolean;
  stats(): RelayStats;
  /** Closes every connection (1001) and stops accepting. */
  close(): Promise<void>;
}

type Role = PeerRole;

interface Route {
  relayId: number;
  origId: number;
  backbone: Peer;
  worker: Peer;
  started: number;
  timer: ReturnType<typeof setTimeout>;
}

class Peer {
  role: Role | undefined;
  id: string | undefined;
  live = false;
  closed = false;
  readonly connectedAt = Date.now();
  lastSeen = Date.now();
  lastPing = 0;
  pingSeq = 0;
  rttMs: number | undefined;
  readonly violations: number[] = [];
  /** Registered slices by `sliceKey` (model, layers, experts), in the order registered. */
  readonly slices = new Map<string, SliceInfo>();
  draining = false;
  /** Worker side: relay request id -> route. */
  readonly routes = new Map<number, Route>();
  /** Backbone side: its routes not yet answered. */
  readonly outstanding = new Set<Route>();
  nextRouteId = 0;
  /** The largest frame the peer said it accepts (hello caps.maxFrame). */
  maxFrame = Number.POSITIVE_INFINITY;
  killTimer: ReturnType<typeof setTimeout> | undefined;

  constructor(
    readonly ws: WebSocket,
    readonly remote: string,
    readonly bucket: TokenBucket,
  ) {}
}

const noop = () => {};

function servesModel(peer: Peer, model: string): boolean {
  for (const s of peer.slices.values()) if (s.model === model) return true;
  return false;
}

/** One slice of a worker: its model, layers and experts (a register frame's identity). */
function sliceKey(model: string, layers: readonly number[], experts: readonly number[]): string {
  return `${model}\0${layers.join(",")}\0${experts.join(",")}`;
}

function num(name: string, value: number | undefined, fallback: number, min: number): number {
  const v = value ?? fallback;
  if (typeof v !== "number" || !Number.isFinite(v) || v < min) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `relay option ${name} must be a number >= ${min}`,
    );
  }
  return v;
}

/**
 * Creates the relay: peers dial in over WebSocket, say hello with a token, workers register
 * their slices, backbones' dispatches are routed to the named worker and its answers back.
 * It serves no port itself; mount it with attach(server) or handleUpgrade().
 */
export function createRelay(options: RelayOptions): Relay {
  if (typeof options !== "object" || options === null) {
    throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "createRelay needs an options object");
  }
  // fail now on a missing or short secret, not at the first hello
  checkSecret(options.secret);
  const path = options.path ?? "/relay";
  if (typeof path !== "string" || !path.startsWith("/")) {
    throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", 'relay path must start with "/"');
  }
  const maxFrameBytes = num("maxFrameBytes", options.maxFrameBytes, 64 * 1024 * 1024, 1024);
  if (maxFrameBytes > 0x7fff_ffff) {
    throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "maxFrameBytes must be below 2 GiB");
  }
  const heartbeatMs = num("heartbeatMs", options.heartbeatMs, 5000, 5);
  const deadPeerMs = num("deadPeerMs", options.deadPeerMs, Math.max(15_000, 3 * heartbeatMs), 10);
  if (deadPeerMs <= heartbeatMs) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "deadPeerMs must be greater than heartbeatMs",
    );
  }
  const ratePerSec = num("ratePerSec", options.ratePerSec, 2000, 1);
  return new RelayServer({
    secret: options.secret,
    path,
    maxFrameBytes,
    maxInFlight: num("maxInFlight", options.maxInFlight, 256, 1),
    ratePerSec,
    burst: num("burst", options.burst, ratePerSec, 1),
    heartbeatMs,
    deadPeerMs,
    helloTimeoutMs: num("helloTimeoutMs", options.helloTimeoutMs, 10_000, 1),
    requestTimeoutMs: num("requestTimeoutMs", options.requestTimeoutMs, 120_000, 1),
    maxQueueBytes: num(
      "maxQueueBytes",
      options.maxQueueBytes,
      Math.max(128 * 1024 * 1024, 2 * maxFrameBytes),
      maxFrameBytes,
    ),
    maxViolations: num("maxViolations", options.maxViolations, 10, 1),
    violationWindowMs: num("violationWindowMs", options.violationWindowMs, 10_000, 1),
    maxConnections: num("maxConnections", options.maxConnections, 10_000, 1),
    maxSlicesPerWorker: num("maxSlicesPerWorker", options.maxSlicesPerWorker, 256, 1),
    onEvent: options.onEvent,
  });
}

type Settings = Required<Omit<RelayOptions, "onEvent">> & Pick<RelayOptions, "onEvent">;

// Answers a relay gives for a dispatch it cannot route.
type RouteErrorCode =
  | "MOESWARM_TRANSPORT_UNKNOWN_PEER"
  | "MOESWARM_TRANSPORT_DRAINING"
  | "MOESWARM_TRANSPORT_LIMIT"
  | "MOESWARM_TRANSPORT_BACKPRESSURE"
  | "MOESWARM_TRANSPORT_CLOSED"
  | "MOESWARM_TRANSPORT_TIMEOUT"
  | "MOESWARM_PROTOCOL_FRAME_TOO_LARGE";

class RelayServer implements Relay {
  readonly path: string;
  readonly #s: Settings;
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
    refused: 0,
    violations: 0,
  };

  constructor(s: Settings) {
    this.#s = s;
    this.path = s.path;
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
    ws.on("message", (data: Buffer, isBinary: boolean) =>
      this.#guard(() => this.#onMessage(peer, data, isBinary)),
    );
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
      this.#finishRoute(route);
      this.#answerBackbone(route, {
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
      frame = decodeFrame(data, { maxFrameBytes: this.#s.maxFrameBytes });
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
        if (!peer.slices.has(key) && peer.slices.size >= this.#s.maxSlicesPerWorker) {
          this.#violation(
            peer,
            "MOESWARM_TRANSPORT_LIMIT",
            `a worker may register at most ${this.#s.maxSlicesPerWorker} slices`,
          );
          return;
        }
        peer.slices.set(key, {
          model: frame.model,
          layers: frame.layers,
          experts: frame.experts,
          capacity: frame.capacity,
          backend: frame.backend,
        });
        peer.draining = false;
        this.#emit({
          type: "register",
          id: peer.id as string,
          model: frame.model,
          layers: frame.layers,
          experts: frame.experts,
          ...(frame.capacity !== undefined ? { capacity: frame.capacity } : {}),
          ...(frame.backend !== undefined ? { backend: frame.backend } : {}),
        });
        return;
      }
      case "drain":
        if (!this.#workerOnly(peer, frame.t)) return;
        this.#setDraining(peer, frame.reason, "worker");
        return;
      case "dispatch":
        this.#onDispatch(peer, frame);
        return;
      case "result":
      case "error":
        if (peer.role !== "worker") return; // a backbone has nothing to answer; ignored
        this.#onAnswer(peer, frame);
        return;
    }
  }

  /** No new dispatches, every slice withdrawn (a later register starts a new set). */
  #setDraining(peer: Peer, reason: string | undefined, by: "worker" | "hub"): void {
    peer.draining = true;
    peer.slices.clear();
    this.#emit({
      type: "drain",
      id: peer.id as string,
      ...(reason !== undefined ? { reason } : {}),
      by,
    });
  }

  drainWorker(id: string, reason?: string): boolean {
    if (reason !== undefined && (typeof reason !== "string" || Buffer.byteLength(reason) > 1024)) {
      throw new InvalidArgumentError(
        "MOESWARM_INVALID_ARGUMENT",
        "a drain reason must be a string of at most 1024 bytes",
      );
    }
    const peer = this.#workers.get(id);
    if (!peer || peer.closed) return false;
    this.#send(peer, { t: "drain", v: PROTOCOL_VERSION, ...(reason !== undefined ? { reason } : {}) });
    this.#setDraining(peer, reason, "hub");
    return true;
  }

  #workerOnly(peer: Peer, t: string): boolean {
    if (peer.role === "worker") return true;
    this.#violation(peer, "MOESWARM_AUTH_ROLE", `a ${peer.role} cannot send ${t}`);
    return false;
  }

  #onHello(peer: Peer, frame: Extract<Frame, { t: "hello" }>): void {
    try {
      verifyToken(frame.token, this.#s.secret, { role: frame.role, id: frame.id });
    } catch (error) {
      if (!isMoeswarmError(error)) throw error;
      this.#refuse(peer, error.code, error.message);
      return;
    }
    peer.role = frame.role;
    peer.id = frame.id;
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
    this.#emit({ type: "connect", role: frame.role, id: frame.id, remote: peer.remote });
  }

  #onDispatch(backbone: Peer, frame: DispatchFrame): void {
    const refuse = (code: RouteErrorCode, msg: string) => {
      this.#stats.refused++;
      this.#error(backbone, code, msg, frame.id, frame.to);
    };
    if (backbone.role !== "backbone") {
      this.#violation(backbone, "MOESWARM_AUTH_ROLE", "a worker cannot send dispatch", frame.id);
      return;
    }
    if (frame.to === undefined) {
      this.#violation(backbone, "MOESWARM_PROTOCOL_MISSING_FIELD", "dispatch.to names no worker", frame.id);
      return;
    }
    if (backbone.outstanding.size >= this.#s.maxInFlight) {
      refuse(
        "MOESWARM_TRANSPORT_LIMIT",
        `${backbone.outstanding.size} requests in flight (limit ${this.#s.maxInFlight})`,
      );
      return;
    }
    const worker = this.#workers.get(frame.to);
    if (!worker || worker.closed) {
      refuse("MOESWARM_TRANSPORT_UNKNOWN_PEER", `no live worker ${JSON.stringify(frame.to)}`);
      return;
    }
    if (worker.draining) {
      refuse("MOESWARM_TRANSPORT_DRAINING", `worker ${frame.to} is draining`);
      return;
    }
    if (!servesModel(worker, frame.model)) {
      refuse(
        "MOESWARM_TRANSPORT_UNKNOWN_PEER",
        `worker ${frame.to} has registered no slice of ${frame.model}`,
      );
      return;
    }
    if (worker.routes.size >= this.#s.maxInFlight) {
      refuse("MOESWARM_TRANSPORT_LIMIT", `worker ${frame.to} holds ${worker.routes.size} requests`);
      return;
    }
    let relayId = worker.nextRouteId;
    while (worker.routes.has(relayId)) relayId = (relayId + 1) >>> 0;
    worker.nextRouteId = (relayId + 1) >>> 0;
    let bytes: Uint8Array;
    try {
      bytes = encodeFrame(
        { ...frame, id: relayId, from: backbone.id, to: frame.to },
        { maxFrameBytes: this.#s.maxFrameBytes },
      );
    } catch (error) {
      // e.g. the added `from` pushed a frame at the limit over it
      const e = isMoeswarmError(error) ? error : undefined;
      this.#stats.refused++;
      this.#error(
        backbone,
        e?.code ?? "MOESWARM_PROTOCOL_MALFORMED",
        e?.message ?? "cannot forward",
        frame.id,
      );
      return;
    }
    if (bytes.byteLength > worker.maxFrame) {
      // the worker would drop its link on it; refusing keeps the worker and fails only this request
      refuse(
        "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
        `dispatch of ${bytes.byteLength} bytes exceeds worker ${frame.to}'s limit of ${worker.maxFrame}`,
      );
      return;
    }
    if (worker.ws.bufferedAmount + bytes.byteLength > this.#s.maxQueueBytes) {
      refuse("MOESWARM_TRANSPORT_BACKPRESSURE", `the send queue to worker ${frame.to} is full`);
      return;
    }
    const route: Route = {
      relayId,
      origId: frame.id,
      backbone,
      worker,
      started: performance.now(),
      // the backbone gives up at its deadline; the relay forgets the route a little later
      timer: setTimeout(
        () => this.#guard(() => this.#expire(route)),
        (frame.deadline ?? this.#s.requestTimeoutMs) + 1000,
      ),
    };
    route.timer.unref?.();
    worker.routes.set(relayId, route);
    backbone.outstanding.add(route);
    this.#stats.routed++;
    this.#sendBytes(worker, bytes);
    traceHop("hub.out.dispatch", relayId);
  }

  #finishRoute(route: Route): void {
    clearTimeout(route.timer);
    route.worker.routes.delete(route.relayId);
    route.backbone.outstanding.delete(route);
  }

  #expire(route: Route): void {
    if (route.worker.routes.get(route.relayId) !== route) return;
    this.#finishRoute(route);
    this.#answerBackbone(route, {
      t: "error",
      v: PROTOCOL_VERSION,
      id: route.origId,
      code: "MOESWARM_TRANSPORT_TIMEOUT",
      msg: `worker ${route.worker.id} did not answer in time`,
    });
  }

  #onAnswer(worker: Peer, frame: ResultFrame | ErrorFrame): void {
    if (frame.id === undefined) return; // a worker's connection-level notice; nothing to route
    const route = worker.routes.get(frame.id);
    if (!route) return; // late: the route expired or its backbone's connection is gone
    this.#finishRoute(route);
    this.#answerBackbone(route, { ...frame, id: route.origId });
  }

  #answerBackbone(route: Route, frame: ResultFrame | ErrorFrame): void {
    const backbone = route.backbone;
    this.#emit({
      type: "routed",
      from: backbone.id as string,
      to: route.worker.id as string,
      outcome: frame.t === "result" ? "result" : frame.code,
      ms: performance.now() - route.started,
    });
    if (backbone.closed) return;
    let bytes: Uint8Array;
    try {
      bytes = encodeFrame(
        { ...frame, from: route.worker.id, to: backbone.id },
        { maxFrameBytes: this.#s.maxFrameBytes },
      );
    } catch (error) {
      const e = isMoeswarmError(error) ? error : undefined;
      this.#error(
        backbone,
        e?.code ?? "MOESWARM_PROTOCOL_MALFORMED",
        e?.message ?? "the answer could not be re-encoded",
        route.origId,
        route.worker.id,
      );
      return;
    }
    if (backbone.ws.bufferedAmount + bytes.byteLength > this.#s.maxQueueBytes) {
      // the backbone does not read its answers: cut it off rather than buffer without bound
      this.#drop(
        backbone,
        CLOSE_SLOW_CONSUMER,
        "MOESWARM_TRANSPORT_BACKPRESSURE: answers are not being read",
        true,
      );
      return;
    }
    this.#sendBytes(backbone, bytes);
    traceHop("hub.out.answer", route.relayId);
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

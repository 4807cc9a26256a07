// The relay's public shapes: its options, the events it reports, what it tells of its peers and
// the `Relay` handle (the server itself is relay.ts).
import type { Server as HttpServer, IncomingMessage } from "node:http";
import type { Server as HttpsServer } from "node:https";
import type { Duplex } from "node:stream";
import type { PeerRole } from "@moeswarm/core";
import type { TokenSecret } from "./token.js";

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
  /**
   * Accept worker and backbone tokens that carry no peer id (`sub`). Off by default: an unbound
   * token lets its holder say hello as any id, and the newest hello for an id replaces the
   * older connection, so anyone holding one could take over another peer's id. Only for a
   * private swarm whose every token holder is trusted.
   */
  allowUnboundTokens?: boolean;
  /**
   * Asked before a worker's `register` is accepted: undefined accepts it; a refusal is answered
   * with an error frame carrying its code and message, and the slice is not registered (the
   * hub refuses slices no live lease of the worker covers: MOESWARM_HUB_NO_LEASE).
   */
  admitRegister?: (worker: string, slice: SliceInfo) => { code: string; message: string } | undefined;
  /**
   * Asked before a hello is accepted (after its token verified): undefined accepts it, a refusal
   * is sent as an error frame and the connection is closed (the hub refuses quarantined ids).
   */
  admitHello?: (role: PeerRole, id: string) => { code: string; message: string } | undefined;
  /**
   * Told of every dispatch the relay forwards (after every check passed), for accounting: the
   * hub bounds backbones' stats and credits by what it routed.
   */
  onForward?: (forward: ForwardInfo) => void;
  /** Observability hook (metrics, logs); its exceptions are swallowed. */
  onEvent?: (event: RelayServerEvent) => void;
}

/** A dispatch the relay forwarded: who sent it, to whom, and what it asked for. */
export interface ForwardInfo {
  backbone: string;
  worker: string;
  model: string;
  layer: number;
  /** Token rows (`n`). */
  n: number;
  /** Slots per token (`k`). */
  k: number;
  /** The n*k expert ids, -1 for an empty slot. */
  ids: Int32Array;
}

export type RelayServerEvent =
  | {
      type: "connect";
      role: PeerRole;
      id: string;
      remote: string;
      /** The activation dtypes its hello's `caps.dtypes` listed (a worker's compute), when it said. */
      dtypes?: string[];
    }
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
      /** The principal of the worker's token (its id when the token names none). */
      owner?: string;
    }
  /** A slice the relay withdrew: the lease that covered it ended, or the worker was quarantined. */
  | { type: "unregister"; id: string; model: string; layers: number[]; experts: number[]; reason: string }
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
  /**
   * Dispatches and results forwarded through a copy: their sender left no room for the relay's
   * routing fields (relay-client does; protocol section 8), so they could not be rewritten in place.
   */
  copied: number;
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
  /**
   * Withdraws a live worker's registered slices that `keep` rejects (they leave placement and the
   * worker is routed no dispatch for a model it no longer serves), each reported as an
   * `unregister` event; the worker is told with an error frame of `code`. Returns how many went.
   */
  withdrawSlices(id: string, keep: (slice: SliceInfo) => boolean, code: string, reason: string): number;
  /**
   * Sends a live worker a notice: a connection-level `error` frame (no `id`) with `code` and
   * `msg`, which a relay client reports as a notice and an older worker only logs (a pause).
   * False when no worker with that id is connected.
   */
  notice(id: string, code: string, msg: string): boolean;
  /** Closes a live worker's or backbone's connection (a quarantine); false when none is connected. */
  disconnect(id: string, code: string, reason: string): boolean;
  stats(): RelayStats;
  /** Closes every connection (1001) and stops accepting. */
  close(): Promise<void>;
}

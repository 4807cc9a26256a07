// A relay connection's state (`Peer`), a routed request (`Route`), and the relay's checked
// settings (options are checked once, in createRelay).
import { InvalidArgumentError, type PeerRole } from "@moeswarm/core";
import type { WebSocket } from "ws";
import type { RelayOptions, SliceInfo } from "./relay-types.js";
import { checkSecret } from "./token.js";
import type { TokenBucket } from "./token-bucket.js";

export type Role = PeerRole;

export interface Route {
  relayId: number;
  origId: number;
  backbone: Peer;
  worker: Peer;
  started: number;
  /** performance.now() at which the relay forgets it (RouteDeadlines). */
  due: number;
}

export class Peer {
  role: Role | undefined;
  id: string | undefined;
  /** The principal of its token (`own`, else the id): replicas count distinct owners. */
  owner: string | undefined;
  live = false;
  closed = false;
  readonly connectedAt = Date.now();
  lastSeen = Date.now();
  lastPing = 0;
  pingSeq = 0;
  rttMs: number | undefined;
  readonly violations: number[] = [];
  /**
   * Registered slices by `sliceKey` (model, layers, experts), in the order registered: changed
   * only through setSlice, deleteSlice and clearSlices, which keep the count per model.
   */
  readonly slices = new Map<string, SliceInfo>();
  /** Slices per model: a dispatch's model check is one lookup, not a walk of up to 256 slices. */
  readonly #models = new Map<string, number>();
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

  /** Whether a registered slice of this worker is of `model`. */
  servesModel(model: string): boolean {
    return this.#models.has(model);
  }

  /** Adds a slice, or replaces the one of the same key (the same model, layers and experts). */
  setSlice(key: string, slice: SliceInfo): void {
    if (!this.slices.has(key)) this.#models.set(slice.model, (this.#models.get(slice.model) ?? 0) + 1);
    this.slices.set(key, slice);
  }

  deleteSlice(key: string): void {
    const slice = this.slices.get(key);
    if (!slice) return;
    this.slices.delete(key);
    const left = (this.#models.get(slice.model) ?? 1) - 1;
    if (left > 0) this.#models.set(slice.model, left);
    else this.#models.delete(slice.model);
  }

  clearSlices(): void {
    this.slices.clear();
    this.#models.clear();
  }
}

/** One slice of a worker: its model, layers and experts (a register frame's identity). */
export function sliceKey(model: string, layers: readonly number[], experts: readonly number[]): string {
  return `${model}\0${layers.join(",")}\0${experts.join(",")}`;
}

export type RelaySettings = Required<
  Omit<RelayOptions, "onEvent" | "admitRegister" | "admitHello" | "onForward">
> &
  Pick<RelayOptions, "onEvent" | "admitRegister" | "admitHello" | "onForward">;

function num(name: string, value: number | undefined, fallback: number, min: number): number {
  const v = value ?? fallback;
  if (typeof v !== "number" || !Number.isFinite(v) || v < min) {
    throw new InvalidArgumentError(`relay option ${name} must be a number >= ${min}`);
  }
  return v;
}

/** Checks createRelay's options (InvalidArgumentError) and fills in the defaults. */
export function readRelayOptions(options: RelayOptions): RelaySettings {
  if (typeof options !== "object" || options === null) {
    throw new InvalidArgumentError("createRelay needs an options object");
  }
  // fail now on a missing or short secret, not at the first hello
  checkSecret(options.secret);
  const path = options.path ?? "/relay";
  if (typeof path !== "string" || !path.startsWith("/")) {
    throw new InvalidArgumentError('relay path must start with "/"');
  }
  const maxFrameBytes = num("maxFrameBytes", options.maxFrameBytes, 64 * 1024 * 1024, 1024);
  if (maxFrameBytes > 0x7fff_ffff) {
    throw new InvalidArgumentError("maxFrameBytes must be below 2 GiB");
  }
  const heartbeatMs = num("heartbeatMs", options.heartbeatMs, 5000, 5);
  const deadPeerMs = num("deadPeerMs", options.deadPeerMs, Math.max(15_000, 3 * heartbeatMs), 10);
  if (deadPeerMs <= heartbeatMs) {
    throw new InvalidArgumentError("deadPeerMs must be greater than heartbeatMs");
  }
  const ratePerSec = num("ratePerSec", options.ratePerSec, 2000, 1);
  return {
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
    allowUnboundTokens: options.allowUnboundTokens === true,
    admitRegister: options.admitRegister,
    admitHello: options.admitHello,
    onForward: options.onForward,
    onEvent: options.onEvent,
  };
}

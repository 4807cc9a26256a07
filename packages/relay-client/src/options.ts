import {
  InvalidArgumentError,
  isQuantizedActivationDtype,
  quantizedActivationBytes,
  type RegisterFrame,
  registerFrame,
} from "@moeswarm/core";
import { type Backoff, normalizeBackoff } from "./backoff.js";
import type {
  ConnectRelayOptions,
  DispatchHandler,
  DispatchRequest,
  RelayRegistration,
} from "./connection-types.js";
import { RELAY_PEER } from "./heartbeat.js";
import { type DialOptions, dialWebSocket, type FrameDialer } from "./link.js";
import { type Caps, DEFAULT_MAX_FRAME_BYTES, type Role } from "./wire.js";

// Everything a caller hands the connection is checked here, eagerly, with an invalid-argument error.

/** ConnectRelayOptions checked, with their defaults filled in. */
export interface Settings {
  role: Role;
  id: string;
  token: () => string | Promise<string>;
  ca: DialOptions["ca"];
  reconnect: Backoff | undefined;
  heartbeatMs: number;
  deadPeerMs: number;
  connectTimeoutMs: number;
  requestTimeoutMs: number;
  maxFrameBytes: number;
  maxQueueBytes: number;
  maxIncoming: number;
  caps: Caps | undefined;
  onDispatch: DispatchHandler | undefined;
  onDrain: ((reason: string | undefined) => void) | undefined;
  dial: FrameDialer;
  /** What the peer is called in errors ("the relay" unless the caller named it). */
  peerName: string;
}

/** `value` (or `fallback`) when it is a finite number >= `min`. */
export function atLeast(name: string, value: number | undefined, fallback: number, min = 1): number {
  const v = value ?? fallback;
  if (typeof v !== "number" || !Number.isFinite(v) || v < min) {
    throw new InvalidArgumentError(`${name} must be a number >= ${min}`);
  }
  return v;
}

export function checkId(what: string, id: unknown): string {
  if (typeof id !== "string" || id.length === 0 || Buffer.byteLength(id) > 128) {
    throw new InvalidArgumentError(`${what} must be a string of 1..128 bytes`);
  }
  return id;
}

export function settings(options: ConnectRelayOptions): Settings {
  if (typeof options !== "object" || options === null) {
    throw new InvalidArgumentError("connectRelay needs an options object");
  }
  if (options.role !== "worker" && options.role !== "backbone")
    throw new InvalidArgumentError('role must be "worker" or "backbone"');
  const token = options.token;
  if (typeof token !== "string" && typeof token !== "function")
    throw new InvalidArgumentError("token must be a string or a function");
  if (options.onDrain !== undefined && typeof options.onDrain !== "function")
    throw new InvalidArgumentError("onDrain must be a function");
  const heartbeatMs = atLeast("heartbeatMs", options.heartbeatMs, 5000, 5);
  const deadPeerMs = atLeast("deadPeerMs", options.deadPeerMs, Math.max(15_000, 3 * heartbeatMs), 10);
  if (deadPeerMs <= heartbeatMs)
    throw new InvalidArgumentError("deadPeerMs must be greater than heartbeatMs");
  const maxFrameBytes = atLeast("maxFrameBytes", options.maxFrameBytes, DEFAULT_MAX_FRAME_BYTES, 1024);
  const peerName = options.peerName ?? RELAY_PEER;
  if (typeof peerName !== "string" || peerName.length === 0 || peerName.length > 512)
    throw new InvalidArgumentError("peerName must be a string of 1..512 characters");
  return {
    role: options.role,
    id: checkId("id", options.id),
    token: typeof token === "string" ? () => token : token,
    ca: options.ca,
    reconnect:
      options.reconnect === false
        ? undefined
        : normalizeBackoff(options.reconnect === true ? {} : (options.reconnect ?? {})),
    heartbeatMs,
    deadPeerMs,
    connectTimeoutMs: atLeast("connectTimeoutMs", options.connectTimeoutMs, 10_000),
    requestTimeoutMs: atLeast("requestTimeoutMs", options.requestTimeoutMs, 30_000),
    maxFrameBytes,
    maxQueueBytes: atLeast(
      "maxQueueBytes",
      options.maxQueueBytes,
      Math.max(128 * 1024 * 1024, 2 * maxFrameBytes),
      1,
    ),
    maxIncoming: atLeast("maxIncoming", options.maxIncoming, 256),
    caps: options.caps,
    onDispatch: options.onDispatch,
    onDrain: options.onDrain,
    dial: options.dial ?? dialWebSocket,
    peerName,
  };
}

export function checkRegistration(r: RelayRegistration): RegisterFrame {
  if (typeof r !== "object" || r === null)
    throw new InvalidArgumentError("register needs a registration object");
  // the builder checks every field against the protocol's rules (ascending unique experts...)
  return registerFrame({
    model: r.model,
    layers: Array.isArray(r.layers) ? [...r.layers] : (r.layers as never),
    experts: Array.isArray(r.experts) ? [...r.experts] : (r.experts as never),
    capacity: r.capacity,
    backend: r.backend,
  });
}

/** Registrations with the same model, layers and experts are one slice. */
export function registrationKey(f: RegisterFrame): string {
  return `${f.model}\0${f.layers.join(",")}\0${f.experts.join(",")}`;
}

export function checkRequest(req: DispatchRequest): void {
  if (typeof req !== "object" || req === null)
    throw new InvalidArgumentError("request needs a dispatch object");
  const int = (name: string, v: number, min: number, max: number) => {
    if (!Number.isInteger(v) || v < min || v > max)
      throw new InvalidArgumentError(`dispatch.${name} must be an integer in ${min}..${max}`);
  };
  if (typeof req.model !== "string" || req.model.length === 0)
    throw new InvalidArgumentError("dispatch.model must be a non-empty string");
  int("layer", req.layer, 0, 0xffff_ffff);
  int("n", req.n, 1, 65536);
  int("embd", req.embd, 1, 65536);
  int("k", req.k, 1, 256);
  const dtype = req.dtype ?? "f32";
  if (req.mode !== "each" && req.mode !== "sum")
    throw new InvalidArgumentError('dispatch.mode must be "each" or "sum"');
  if (isQuantizedActivationDtype(dtype)) {
    // ggml block rows (dispatch's quantizingTransport): x is their bytes
    const bytes = quantizedActivationBytes(dtype, req.n, req.embd);
    if (!(req.x instanceof Uint8Array) || bytes === 0 || req.x.byteLength !== bytes) {
      throw new InvalidArgumentError(
        `dispatch.x must be a Uint8Array of n rows of embd values as ${dtype} blocks (embd a multiple of the block)`,
      );
    }
  } else if (dtype !== "f32" && dtype !== "f16" && dtype !== "bf16") {
    throw new InvalidArgumentError("dispatch.dtype must be f32, f16, bf16, q8_0 or q8_K");
  } else if (
    !(req.x instanceof Float32Array || req.x instanceof Uint16Array) ||
    req.x.length !== req.n * req.embd
  ) {
    throw new InvalidArgumentError(
      "dispatch.x must be a Float32Array (or Uint16Array of half bits) of n*embd values",
    );
  }
  if (!(req.ids instanceof Int32Array) || req.ids.length !== req.n * req.k) {
    throw new InvalidArgumentError("dispatch.ids must be an Int32Array of n*k ids");
  }
  if (req.w !== undefined && (!(req.w instanceof Float32Array) || req.w.length !== req.n * req.k)) {
    throw new InvalidArgumentError("dispatch.w must be a Float32Array of n*k weights");
  }
  if (req.mode === "sum" && req.w === undefined)
    throw new InvalidArgumentError('dispatch.w is required for mode "sum"');
}

import type { ExpertRequest, MoeswarmError, QuantizedActivationDtype } from "@moeswarm/core";
import type { ReconnectOptions } from "./backoff.js";
import type { FrameDialer } from "./link.js";
import type { Caps, Role, WireDtype } from "./wire.js";

// The public vocabulary of a relay connection: its options, events, requests and answers.

export type RelayState = "connecting" | "connected" | "reconnecting" | "closed";

/** Something that happened to a connection, in order. */
export type RelayEvent =
  | { type: "state"; state: RelayState; attempt?: number; delayMs?: number; error?: Error }
  /** A connection-level `error` frame from the relay, or a frame this side could not decode. */
  | { type: "notice"; error: MoeswarmError }
  /**
   * Worker side: the relay sent `drain` (the hub takes this worker out of service). The relay
   * routes it no new dispatches; the application finishes what it holds, then calls `drain()`
   * (which forgets the registrations) and closes.
   */
  | { type: "drain"; reason?: string };

export interface RelayRegistration {
  model: string;
  layers: readonly number[];
  /** Global expert ids, ascending and unique. */
  experts: readonly number[];
  capacity?: number;
  backend?: string;
}

/**
 * core's ExpertRequest as the relay carries it: activations travel as f32 values or as the raw bits
 * of f16/bf16 (the wire has no f64).
 */
interface WireExpertRequest extends Omit<ExpertRequest, "dtype" | "x"> {
  readonly dtype: WireDtype | QuantizedActivationDtype;
  /**
   * n*embd activations, token-major: f32 values, the raw bits of f16/bf16, or n rows of q8_0/q8_K
   * blocks (bytes).
   */
  readonly x: Float32Array | Uint16Array | Uint8Array;
}

/**
 * One request for a worker's expert compute (the fields of a `dispatch` frame). Its deadline is
 * `RequestOptions.deadlineMs`.
 */
export interface DispatchRequest extends Omit<WireExpertRequest, "dtype" | "deadline"> {
  /**
   * How `x` travels (default f32): f32 values are converted, a Uint16Array is taken as raw bits,
   * q8_0/q8_K need `x` already as their blocks (a Uint8Array).
   */
  readonly dtype?: WireDtype | QuantizedActivationDtype;
}

export interface DispatchReply {
  /** mode "each": n*k*embd, or with `compact` the filled slots' rows only; mode "sum": n*embd. */
  y: Float32Array;
  /** `y` holds the filled slots' rows only. */
  compact?: boolean;
  /** The worker's compute time. */
  ms?: number;
  /** The peer that answered. */
  from: string;
}

export interface RequestOptions {
  signal?: AbortSignal;
  /** How long to wait for the answer (default: the connection's requestTimeoutMs). */
  deadlineMs?: number;
}

/** What a worker answers a dispatch with. */
export interface DispatchAnswer {
  y: Float32Array;
  ms?: number;
}

/**
 * An answer whose `y` is written straight into the outgoing result frame: `fill` gets a view of
 * the frame's memory for the full answer (n*k*embd values for mode "each", n*embd for "sum") and
 * must write every value before it returns. The view is lent for the call: keep no reference to
 * it (the memory is reused by the next frame sent). An exception from `fill` is answered as an
 * `error` frame with its code. A `fill` that computes the answer returns the compute's time: the
 * result's `ms` when `ms` is not given.
 */
export interface DispatchAnswerInto {
  fill(y: Float32Array): unknown;
  ms?: number;
}

/** A dispatch that reached this worker; answer it once with respond() or fail(). */
export interface IncomingDispatch extends WireExpertRequest {
  readonly id: number;
  /** The requesting backbone. */
  readonly from: string;
  readonly w: Float32Array | undefined;
  /** The ms the sender waits, if it said. */
  readonly deadline: number | undefined;
  /**
   * The sender accepts a compact result: `respond` then sends only the filled slots' rows of a
   * full mode-"each" answer.
   */
  readonly compact: boolean;
  /**
   * Aborted when the connection drops or the sender's deadline passes: stop computing. Made when
   * first read (a handler that answers without waiting need not read it); one read after the
   * deadline or the drop is already aborted, with the same reason.
   */
  readonly signal: AbortSignal;
  /**
   * Activations as f32, whatever their wire dtype; q8_0/q8_K rows throw NativeError
   * MOESWARM_NATIVE_WIRE_DTYPE (only a compute that takes them may: read `x` and `dtype`).
   */
  activations(): Float32Array;
  /** Sends the result; false when it can no longer be delivered (connection dropped, answered). */
  respond(answer: DispatchAnswer): boolean;
  /**
   * respond() without an array of its own for `y`: `fill` writes it into the result frame (see
   * DispatchAnswerInto), which saves a copy of the answer. For a compact answer the full answer
   * is filled into an array first (the frame holds the filled slots' rows only).
   */
  respondInto(answer: DispatchAnswerInto): boolean;
  /** Sends an `error` frame with the error's code. */
  fail(error: unknown): boolean;
}

/**
 * Answers a dispatch: with `y`, or with `fill` to write y into the result frame (respondInto).
 * Called while the dispatch frame is handled; an answer returned synchronously is sent at once (no
 * promise jobs), a promise's when it settles. A thrown or rejected error is sent as an `error`
 * frame with its code.
 */
export type DispatchHandler = (
  request: IncomingDispatch,
) => DispatchAnswer | DispatchAnswerInto | Promise<DispatchAnswer | DispatchAnswerInto>;

export interface ConnectRelayOptions {
  role: Role;
  /** This peer's id, 1..128 bytes; workers are addressed by it. */
  id: string;
  /** The auth token, or a function asked again before every (re)connect so it can be refreshed. */
  token: string | (() => string | Promise<string>);
  /** PEM CA certificate(s) to trust for a self-hosted relay. */
  ca?: string | Uint8Array | ReadonlyArray<string | Uint8Array>;
  /** Aborting it closes the connection (and rejects connectRelay while it is connecting). */
  signal?: AbortSignal;
  /** Reconnect after a drop (default true, exponential backoff with jitter). */
  reconnect?: boolean | ReconnectOptions;
  /** Protocol ping interval (default 5000 ms). */
  heartbeatMs?: number;
  /** Silence after which the relay counts as dead and the link is dropped (default 15000 ms). */
  deadPeerMs?: number;
  /** Time for one dial + hello acceptance (default 10000 ms). */
  connectTimeoutMs?: number;
  /** Default deadline of request() (default 30000 ms). */
  requestTimeoutMs?: number;
  /** Largest frame sent or accepted (default 64 MiB). */
  maxFrameBytes?: number;
  /** Bytes that may wait in the send buffer before request() fails with BACKPRESSURE (default 128 MiB). */
  maxQueueBytes?: number;
  /** Dispatches a worker holds at once before answering MOESWARM_TRANSPORT_LIMIT (default 256). */
  maxIncoming?: number;
  caps?: Caps;
  /** Worker side: answers every dispatch (else read them from dispatches()). */
  onDispatch?: DispatchHandler;
  /**
   * Worker side: called when the relay sends `drain` (as is the `drain` event; this option also
   * sees one that arrives right after the hello, before `on()` could be called). Its exceptions
   * are ignored.
   */
  onDrain?: (reason: string | undefined) => void;
  /** The frame transport (default: WebSocket). */
  dial?: FrameDialer;
  /**
   * What the peer is called in this connection's errors (default "the relay"): a backbone's
   * direct link names the worker it dialed, so a silent worker is not reported as a dead relay.
   */
  peerName?: string;
}

export interface RelayConnection extends AsyncDisposable {
  readonly url: string;
  readonly role: Role;
  readonly id: string;
  readonly state: RelayState;
  /** Round-trip time of the last heartbeat, ms. */
  readonly rttMs: number | undefined;
  /** Bytes waiting in the send buffer. */
  readonly bufferedBytes: number;
  /**
   * Announces a slice (one rectangle of layers x experts of a model) this worker serves. Several
   * accumulate, on the relay as here; one with the same model, layers and experts as an earlier
   * one replaces it (idempotent; its capacity and backend are updated). All are replayed after
   * every reconnect, in the order first registered.
   */
  register(registration: RelayRegistration): void;
  /** What this connection has registered (and replays after a reconnect), in order. */
  registrations(): RelayRegistration[];
  /**
   * Stops new dispatches to this worker and withdraws every registration (the relay forgets them
   * at a drain, and so does this connection); replayed after reconnect until the next register().
   */
  drain(reason?: string): void;
  /** Sends a dispatch to peer `to` and waits for its result. */
  request(to: string, request: DispatchRequest, options?: RequestOptions): Promise<DispatchReply>;
  /** Worker side: incoming dispatches, when no onDispatch handler is set. Ends at close(). */
  dispatches(options?: { signal?: AbortSignal }): AsyncIterableIterator<IncomingDispatch>;
  /** Subscribes to events; returns the unsubscribe function. */
  on(listener: (event: RelayEvent) => void): () => void;
  /** Events from now on, as an async iterable. Ends at close(). */
  events(options?: { signal?: AbortSignal }): AsyncIterableIterator<RelayEvent>;
  /** Resolves when the state is `connected` (at once if it is). */
  waitConnected(options?: { signal?: AbortSignal }): Promise<void>;
  close(): Promise<void>;
}

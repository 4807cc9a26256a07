import {
  AuthError,
  abortReason,
  compactSlots,
  type ExpertRequest,
  errorFromCode,
  errorToWire,
  InvalidArgumentError,
  type MoeswarmError,
  ProtocolError,
  registerFrame,
  TransportError,
  traceHop,
} from "@moeswarm/core";
import { type Backoff, backoffDelay, normalizeBackoff, type ReconnectOptions } from "./backoff.js";
import { Channel } from "./channel.js";
import {
  type DialOptions,
  dialWebSocket,
  type FrameDialer,
  type FrameLink,
  type LinkCloseInfo,
} from "./link.js";
import { activationsToF32, activationsToWire } from "./tensors.js";
import {
  type Caps,
  DEFAULT_MAX_FRAME_BYTES,
  type DispatchFrame,
  type DispatchMode,
  decodeFrame,
  type ErrorFrame,
  encodeFrame,
  type Frame,
  PROTOCOL_VERSION,
  type RegisterFrame,
  type ResultFrame,
  type Role,
  type WireDtype,
} from "./wire.js";

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
  readonly dtype: WireDtype;
  /** n*embd activations, token-major: f32 values, or the raw bits of f16/bf16. */
  readonly x: Float32Array | Uint16Array;
}

/**
 * One request for a worker's expert compute (the fields of a `dispatch` frame). Its deadline is
 * `RequestOptions.deadlineMs`.
 */
export interface DispatchRequest extends Omit<WireExpertRequest, "dtype" | "deadline"> {
  /** How `x` travels (default f32): f32 values are converted, a Uint16Array is taken as raw bits. */
  readonly dtype?: WireDtype;
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
  /** Aborted when the connection drops or the sender's deadline passes: stop computing. */
  readonly signal: AbortSignal;
  /** Activations as f32, whatever their wire dtype. */
  activations(): Float32Array;
  /** Sends the result; false when it can no longer be delivered (connection dropped, answered). */
  respond(answer: DispatchAnswer): boolean;
  /** Sends an `error` frame with the error's code. */
  fail(error: unknown): boolean;
}

export type DispatchHandler = (request: IncomingDispatch) => DispatchAnswer | Promise<DispatchAnswer>;

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

// Close codes the relay uses (4000-4999 is the application range of RFC 6455).
export const CLOSE_AUTH = 4001;
export const CLOSE_HOSTILE = 4002;
export const CLOSE_DEAD_PEER = 4003;
export const CLOSE_REPLACED = 4004;
export const CLOSE_SLOW_CONSUMER = 4005;
export const CLOSE_SHUTDOWN = 1001;

interface Settings {
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
}

function invalid(msg: string): never {
  throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", msg);
}

function ms(name: string, value: number | undefined, fallback: number, min = 1): number {
  const v = value ?? fallback;
  if (typeof v !== "number" || !Number.isFinite(v) || v < min) invalid(`${name} must be a number >= ${min}`);
  return v;
}

function checkId(what: string, id: unknown): string {
  if (typeof id !== "string" || id.length === 0 || Buffer.byteLength(id) > 128) {
    invalid(`${what} must be a string of 1..128 bytes`);
  }
  return id;
}

function settings(options: ConnectRelayOptions): Settings {
  if (typeof options !== "object" || options === null) invalid("connectRelay needs an options object");
  if (options.role !== "worker" && options.role !== "backbone")
    invalid('role must be "worker" or "backbone"');
  const token = options.token;
  if (typeof token !== "string" && typeof token !== "function")
    invalid("token must be a string or a function");
  if (options.onDrain !== undefined && typeof options.onDrain !== "function")
    invalid("onDrain must be a function");
  const heartbeatMs = ms("heartbeatMs", options.heartbeatMs, 5000, 5);
  const deadPeerMs = ms("deadPeerMs", options.deadPeerMs, Math.max(15_000, 3 * heartbeatMs), 10);
  if (deadPeerMs <= heartbeatMs) invalid("deadPeerMs must be greater than heartbeatMs");
  const maxFrameBytes = ms("maxFrameBytes", options.maxFrameBytes, DEFAULT_MAX_FRAME_BYTES, 1024);
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
    connectTimeoutMs: ms("connectTimeoutMs", options.connectTimeoutMs, 10_000),
    requestTimeoutMs: ms("requestTimeoutMs", options.requestTimeoutMs, 30_000),
    maxFrameBytes,
    maxQueueBytes: ms(
      "maxQueueBytes",
      options.maxQueueBytes,
      Math.max(128 * 1024 * 1024, 2 * maxFrameBytes),
      1,
    ),
    maxIncoming: ms("maxIncoming", options.maxIncoming, 256),
    caps: options.caps,
    onDispatch: options.onDispatch,
    onDrain: options.onDrain,
    dial: options.dial ?? dialWebSocket,
  };
}

function checkRegistration(r: RelayRegistration): RegisterFrame {
  if (typeof r !== "object" || r === null) invalid("register needs a registration object");
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
function registrationKey(f: RegisterFrame): string {
  return `${f.model}\0${f.layers.join(",")}\0${f.experts.join(",")}`;
}

function checkRequest(req: DispatchRequest): void {
  if (typeof req !== "object" || req === null) invalid("request needs a dispatch object");
  const int = (name: string, v: number, min: number, max: number) => {
    if (!Number.isInteger(v) || v < min || v > max)
      invalid(`dispatch.${name} must be an integer in ${min}..${max}`);
  };
  if (typeof req.model !== "string" || req.model.length === 0)
    invalid("dispatch.model must be a non-empty string");
  int("layer", req.layer, 0, 0xffff_ffff);
  int("n", req.n, 1, 65536);
  int("embd", req.embd, 1, 65536);
  int("k", req.k, 1, 256);
  const dtype = req.dtype ?? "f32";
  if (dtype !== "f32" && dtype !== "f16" && dtype !== "bf16")
    invalid("dispatch.dtype must be f32, f16 or bf16");
  if (req.mode !== "each" && req.mode !== "sum") invalid('dispatch.mode must be "each" or "sum"');
  if (!(req.x instanceof Float32Array || req.x instanceof Uint16Array) || req.x.length !== req.n * req.embd) {
    invalid("dispatch.x must be a Float32Array (or Uint16Array of half bits) of n*embd values");
  }
  if (!(req.ids instanceof Int32Array) || req.ids.length !== req.n * req.k) {
    invalid("dispatch.ids must be an Int32Array of n*k ids");
  }
  if (req.w !== undefined && (!(req.w instanceof Float32Array) || req.w.length !== req.n * req.k)) {
    invalid("dispatch.w must be a Float32Array of n*k weights");
  }
  if (req.mode === "sum" && req.w === undefined) invalid('dispatch.w is required for mode "sum"');
}

interface Pending {
  to: string;
  n: number;
  k: number;
  embd: number;
  mode: DispatchMode;
  resolve(reply: DispatchReply): void;
  reject(error: unknown): void;
}

const now = () => performance.now();

class Incoming implements IncomingDispatch {
  readonly controller = new AbortController();
  readonly id: number;
  readonly from: string;
  readonly model: string;
  readonly layer: number;
  readonly n: number;
  readonly embd: number;
  readonly k: number;
  readonly dtype: WireDtype;
  readonly mode: DispatchMode;
  readonly x: Float32Array | Uint16Array;
  readonly ids: Int32Array;
  readonly w: Float32Array | undefined;
  readonly deadline: number | undefined;
  readonly compact: boolean;
  timer: ReturnType<typeof setTimeout> | undefined;
  done = false;

  constructor(
    frame: DispatchFrame,
    private readonly reply: (self: Incoming, frame: ResultFrame | ErrorFrame | undefined) => boolean,
  ) {
    this.id = frame.id;
    this.from = frame.from ?? "";
    this.model = frame.model;
    this.layer = frame.layer;
    this.n = frame.n;
    this.embd = frame.embd;
    this.k = frame.k;
    this.dtype = frame.dtype;
    this.mode = frame.mode;
    this.x = frame.x;
    this.ids = frame.ids;
    this.w = frame.w;
    this.deadline = frame.deadline;
    this.compact = frame.compact === true && frame.mode === "each";
  }

  get signal(): AbortSignal {
    return this.controller.signal;
  }

  activations(): Float32Array {
    return activationsToF32(this.x, this.dtype);
  }

  respond(answer: DispatchAnswer): boolean {
    const y = answer?.y;
    const expected = (this.mode === "each" ? this.n * this.k : this.n) * this.embd;
    if (!(y instanceof Float32Array) || y.length !== expected) {
      return this.fail(
        new ProtocolError(
          "MOESWARM_PROTOCOL_BAD_LENGTH",
          `result y must be a Float32Array of ${expected} values (mode ${this.mode})`,
        ),
      );
    }
    return this.reply(this, {
      t: "result",
      v: PROTOCOL_VERSION,
      id: this.id,
      to: this.from || undefined,
      mode: this.mode,
      n: this.n,
      k: this.k,
      embd: this.embd,
      y: this.compact ? compactSlots(y, this.ids, this.embd) : y,
      ms: answer.ms,
      ...(this.compact ? { compact: true } : {}),
    });
  }

  fail(error: unknown): boolean {
    const { code, msg } = errorToWire(error);
    return this.reply(this, {
      t: "error",
      v: PROTOCOL_VERSION,
      id: this.id,
      to: this.from || undefined,
      code,
      msg,
    });
  }
}

class Connection implements RelayConnection {
  readonly url: string;
  readonly #s: Settings;
  #state: RelayState = "connecting";
  #link: FrameLink | undefined;
  #hello: { link: FrameLink | undefined; resolve(): void; reject(e: Error): void } | undefined;
  readonly #life = new AbortController();
  readonly #pending = new Map<number, Pending>();
  readonly #incoming = new Map<number, Incoming>();
  readonly #registrations = new Map<string, RegisterFrame>();
  #drain: string | undefined | null = null;
  #nextId = 0;
  #lastSeen = 0;
  #lastPing = 0;
  #pingSeq = 0;
  #rttMs: number | undefined;
  #heartbeat: ReturnType<typeof setInterval> | undefined;
  #closing: Promise<void> | undefined;
  readonly #events = new Channel<RelayEvent>({ broadcast: true, limit: 1024 });
  readonly #listeners = new Set<(event: RelayEvent) => void>();
  readonly #inbox = new Channel<Incoming>({ broadcast: false, limit: 1_000_000 });
  #userSignal: AbortSignal | undefined;
  readonly #onUserAbort = () => {
    void this.close();
  };

  constructor(url: string, s: Settings, signal: AbortSignal | undefined) {
    this.url = url;
    this.#s = s;
    this.#userSignal = signal;
  }

  get role(): Role {
    return this.#s.role;
  }
  get id(): string {
    return this.#s.id;
  }
  get state(): RelayState {
    return this.#state;
  }
  get rttMs(): number | undefined {
    return this.#rttMs;
  }
  get bufferedBytes(): number {
    return this.#link?.bufferedBytes ?? 0;
  }

  async start(): Promise<void> {
    const signal = this.#userSignal;
    if (signal?.aborted) throw abortReason(signal);
    signal?.addEventListener("abort", this.#onUserAbort, { once: true });
    try {
      await this.#connectOnce();
    } catch (error) {
      const reason = signal?.aborted ? abortReason(signal) : error;
      await this.close();
      throw reason;
    }
    this.#accepted();
  }

  // --- events -------------------------------------------------------------------------------

  #emit(event: RelayEvent): void {
    for (const l of this.#listeners) {
      try {
        l(event);
      } catch {
        // a listener's failure is its own; the connection goes on
      }
    }
    this.#events.push(event);
  }

  #setState(state: RelayState, extra: { attempt?: number; delayMs?: number; error?: Error } = {}): void {
    this.#state = state;
    this.#emit({ type: "state", state, ...extra });
  }

  on(listener: (event: RelayEvent) => void): () => void {
    this.#listeners.add(listener);
    return () => this.#listeners.delete(listener);
  }

  events(options: { signal?: AbortSignal } = {}): AsyncIterableIterator<RelayEvent> {
    return this.#events.iterate(options);
  }

  waitConnected(options: { signal?: AbortSignal } = {}): Promise<void> {
    const signal = options.signal;
    if (signal?.aborted) return Promise.reject(abortReason(signal));
    if (this.#state === "connected") return Promise.resolve();
    if (this.#state === "closed") {
      return Promise.reject(
        new TransportError("MOESWARM_TRANSPORT_CLOSED", "the relay connection is closed"),
      );
    }
    return new Promise((resolve, reject) => {
      const done = () => {
        off();
        signal?.removeEventListener("abort", onAbort);
      };
      const onAbort = () => {
        done();
        reject(abortReason(signal as AbortSignal));
      };
      const off = this.on((e) => {
        if (e.type !== "state") return;
        if (e.state === "connected") {
          done();
          resolve();
        } else if (e.state === "closed") {
          done();
          reject(
            e.error ?? new TransportError("MOESWARM_TRANSPORT_CLOSED", "the relay connection is closed"),
          );
        }
      });
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  // --- connecting ---------------------------------------------------------------------------

  /** Dials, says hello and waits for the relay's acceptance; leaves #link set on success. */
  async #connectOnce(): Promise<void> {
    const token = await this.#s.token();
    if (typeof token !== "string") invalid("the token function must return a string");
    const life = this.#life.signal;
    let link: FrameLink | undefined;
    const accepted = new Promise<void>((resolve, reject) => {
      this.#hello = { link: undefined, resolve, reject };
    });
    accepted.catch(() => {});
    const timeout = new AbortController();
    const timer = setTimeout(() => timeout.abort(), this.#s.connectTimeoutMs);
    const signal = AbortSignal.any([life, timeout.signal]);
    try {
      link = await this.#s.dial(this.url, {
        ca: this.#s.ca,
        maxFrameBytes: this.#s.maxFrameBytes,
        connectTimeoutMs: this.#s.connectTimeoutMs,
        signal,
        handlers: {
          frame: (bytes) => this.#onFrame(link as FrameLink, bytes),
          activity: () => {
            if (link === this.#link) this.#lastSeen = now();
          },
          close: (info) => this.#onLinkClose(link as FrameLink, info),
        },
      });
      if (this.#hello) this.#hello.link = link;
      this.#link = link;
      this.#send(link, {
        t: "hello",
        v: PROTOCOL_VERSION,
        role: this.#s.role,
        id: this.#s.id,
        token,
        caps: { maxFrame: this.#s.maxFrameBytes, ...this.#s.caps },
      });
      await new Promise<void>((resolve, reject) => {
        const onAbort = () => reject(life.aborted ? abortReason(life) : timeoutError());
        if (signal.aborted) onAbort();
        signal.addEventListener("abort", onAbort, { once: true });
        accepted.then(resolve, reject).finally(() => signal.removeEventListener("abort", onAbort));
      });
    } catch (error) {
      if (link) {
        if (this.#link === link) this.#link = undefined;
        link.destroy();
      }
      if (timeout.signal.aborted && !life.aborted) throw timeoutError();
      throw error;
    } finally {
      clearTimeout(timer);
      this.#hello = undefined;
    }

    function timeoutError(): TransportError {
      return new TransportError("MOESWARM_TRANSPORT_CONNECT", "the relay did not accept hello in time");
    }
  }

  #accepted(): void {
    const now0 = now();
    this.#lastSeen = now0;
    this.#lastPing = now0;
    this.#setState("connected");
    for (const reg of this.#registrations.values()) this.#send(this.#link, reg);
    if (this.#drain !== null)
      this.#send(this.#link, { t: "drain", v: PROTOCOL_VERSION, reason: this.#drain });
    const tick = Math.max(5, Math.min(this.#s.heartbeatMs, this.#s.deadPeerMs / 4));
    this.#heartbeat = setInterval(() => this.#onTick(), tick);
    this.#heartbeat.unref?.();
  }

  #onTick(): void {
    const link = this.#link;
    if (!link || this.#state !== "connected") return;
    const t = now();
    if (t - this.#lastSeen > this.#s.deadPeerMs) {
      this.#dropLink(
        link,
        new TransportError(
          "MOESWARM_TRANSPORT_TIMEOUT",
          `no frame from the relay for ${Math.round(t - this.#lastSeen)} ms (deadPeerMs ${this.#s.deadPeerMs})`,
        ),
      );
      return;
    }
    if (t - this.#lastPing >= this.#s.heartbeatMs) {
      this.#lastPing = t;
      this.#send(link, { t: "ping", v: PROTOCOL_VERSION, seq: this.#pingSeq++, ts: t });
    }
  }

  /** Gives up on a link now (dead peer): everything in flight fails at once, then the socket goes. */
  #dropLink(link: FrameLink, error: Error): void {
    this.#onLinkClose(link, { code: CLOSE_DEAD_PEER, reason: error.message, error });
    link.destroy();
  }

  #onLinkClose(link: FrameLink, info: LinkCloseInfo): void {
    const waiter = this.#closeWaiters.get(link);
    if (waiter) {
      this.#closeWaiters.delete(link);
      waiter();
      return;
    }
    if (this.#hello && this.#hello.link === link) {
      this.#hello.reject(closeToError(info, true));
      return;
    }
    if (link !== this.#link) return;
    this.#link = undefined;
    clearInterval(this.#heartbeat);
    this.#heartbeat = undefined;
    const error = closeToError(info, false);
    this.#failInFlight(error);
    if (this.#state === "closed" || this.#life.signal.aborted) return;
    if (!this.#s.reconnect || info.code === CLOSE_REPLACED || error instanceof AuthError) {
      this.#finish(error);
      return;
    }
    void this.#reconnect(error);
  }

  #failInFlight(cause: Error): void {
    const pending = [...this.#pending.values()];
    this.#pending.clear();
    for (const p of pending) {
      p.reject(
        new TransportError("MOESWARM_TRANSPORT_CLOSED", `relay connection lost before ${p.to} answered`, {
          cause,
          details: { to: p.to },
        }),
      );
    }
    const incoming = [...this.#incoming.values()];
    this.#incoming.clear();
    for (const inc of incoming) {
      inc.done = true;
      clearTimeout(inc.timer);
      inc.controller.abort(
        new TransportError("MOESWARM_TRANSPORT_CLOSED", "relay connection lost", { cause }),
      );
    }
  }

  async #reconnect(cause: Error): Promise<void> {
    const backoff = this.#s.reconnect as Backoff;
    this.#setState("reconnecting", { error: cause });
    let last: Error = cause;
    for (let attempt = 1; ; attempt++) {
      if (this.#life.signal.aborted) return;
      if (attempt > backoff.maxAttempts) {
        this.#finish(
          new TransportError("MOESWARM_TRANSPORT_CONNECT", `gave up after ${backoff.maxAttempts} attempts`, {
            cause: last,
          }),
        );
        return;
      }
      const delayMs = backoffDelay(attempt, backoff);
      this.#setState("reconnecting", { attempt, delayMs, error: last });
      if (!(await sleep(delayMs, this.#life.signal))) return;
      try {
        await this.#connectOnce();
      } catch (error) {
        if (this.#life.signal.aborted) return;
        last = error instanceof Error ? error : new Error(String(error));
        if (error instanceof AuthError) {
          this.#finish(error);
          return;
        }
        continue;
      }
      if (this.#life.signal.aborted) return;
      this.#accepted();
      return;
    }
  }

  #finish(error: Error | undefined): void {
    if (this.#state === "closed") return;
    this.#life.abort();
    this.#userSignal?.removeEventListener("abort", this.#onUserAbort);
    clearInterval(this.#heartbeat);
    this.#failInFlight(error ?? new TransportError("MOESWARM_TRANSPORT_CLOSED", "closed"));
    this.#setState("closed", error ? { error } : {});
    this.#events.end();
    this.#inbox.end();
  }

  close(): Promise<void> {
    if (this.#closing) return this.#closing;
    const link = this.#link;
    this.#link = undefined;
    this.#finish(undefined);
    this.#closing = new Promise<void>((resolve) => {
      if (!link) {
        resolve();
        return;
      }
      // a clean close waits for the peer's close frame, but never long
      const timer = setTimeout(() => {
        link.destroy();
        resolve();
      }, 1000);
      this.#closeWaiters.set(link, () => {
        clearTimeout(timer);
        resolve();
      });
      link.close(1000, "closed by the client");
    });
    return this.#closing;
  }

  readonly #closeWaiters = new Map<FrameLink, () => void>();

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }

  // --- frames -------------------------------------------------------------------------------

  /** Encodes and queues a frame; throws when the frame is invalid or over maxFrameBytes. */
  #send(link: FrameLink | undefined, frame: Frame): boolean {
    if (!link) return false;
    link.send(encodeFrame(frame, { maxFrameBytes: this.#s.maxFrameBytes }));
    return true;
  }

  #onFrame(link: FrameLink, bytes: Uint8Array): void {
    if (link !== this.#link) return;
    traceHop("rc.in");
    this.#lastSeen = now();
    let frame: Frame;
    try {
      frame = decodeFrame(bytes, { maxFrameBytes: this.#s.maxFrameBytes });
    } catch (error) {
      this.#emit({ type: "notice", error: error as MoeswarmError });
      return;
    }
    if (this.#hello && this.#hello.link === link) {
      if (frame.t === "hello") this.#hello.resolve();
      else if (frame.t === "error" && frame.id === undefined) {
        this.#hello.reject(errorFromCode(frame.code, frame.msg));
      }
      return;
    }
    switch (frame.t) {
      case "result": {
        const p = this.#pending.get(frame.id);
        if (!p) return; // answered late: the request already timed out or was aborted
        if (frame.mode !== p.mode || frame.n !== p.n || frame.k !== p.k || frame.embd !== p.embd) {
          p.reject(
            new ProtocolError(
              "MOESWARM_PROTOCOL_BAD_LENGTH",
              `result from ${frame.from ?? p.to} has shape ${frame.mode} n=${frame.n} k=${frame.k} embd=${frame.embd}, the request ${p.mode} n=${p.n} k=${p.k} embd=${p.embd}`,
            ),
          );
          return;
        }
        p.resolve({
          y: frame.y,
          ms: frame.ms,
          from: frame.from ?? p.to,
          ...(frame.compact === true ? { compact: true } : {}),
        });
        return;
      }
      case "error": {
        if (frame.id === undefined) {
          this.#emit({ type: "notice", error: errorFromCode(frame.code, frame.msg) });
          return;
        }
        const p = this.#pending.get(frame.id);
        p?.reject(errorFromCode(frame.code, frame.msg, { details: { from: frame.from ?? p.to } }));
        return;
      }
      case "dispatch":
        this.#onDispatch(link, frame);
        return;
      case "ping":
        this.#send(link, { t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts });
        return;
      case "pong":
        if (frame.seq === this.#pingSeq - 1) this.#rttMs = now() - frame.ts;
        return;
      case "drain":
        this.#onDrainFrame(frame.reason);
        return;
      default:
        // hello/register from the relay carry nothing for a client
        return;
    }
  }

  #onDrainFrame(reason: string | undefined): void {
    // only a worker is ever drained; a backbone ignores the frame
    if (this.#s.role !== "worker") return;
    try {
      this.#s.onDrain?.(reason);
    } catch {
      // the callback's failure is its own
    }
    this.#emit(reason === undefined ? { type: "drain" } : { type: "drain", reason });
  }

  #onDispatch(link: FrameLink, frame: DispatchFrame): void {
    const refuse = (code: "MOESWARM_TRANSPORT_LIMIT" | "MOESWARM_AUTH_ROLE", msg: string) =>
      this.#send(link, { t: "error", v: PROTOCOL_VERSION, id: frame.id, to: frame.from, code, msg });
    if (this.#s.role !== "worker") {
      refuse("MOESWARM_AUTH_ROLE", "a backbone does not take dispatches");
      return;
    }
    if (this.#incoming.size >= this.#s.maxIncoming || this.#incoming.has(frame.id)) {
      refuse("MOESWARM_TRANSPORT_LIMIT", `worker ${this.#s.id} holds ${this.#incoming.size} dispatches`);
      return;
    }
    const inc = new Incoming(frame, (self, reply) => {
      if (self.done || this.#incoming.get(self.id) !== self || link !== this.#link) return false;
      self.done = true;
      clearTimeout(self.timer);
      this.#incoming.delete(self.id);
      if (!reply) return true;
      try {
        this.#send(link, reply);
        traceHop("rc.answered", self.id);
      } catch (error) {
        // e.g. a result larger than maxFrameBytes: the backbone still gets an answer
        this.#send(link, {
          t: "error",
          v: PROTOCOL_VERSION,
          id: self.id,
          to: reply.to,
          ...errorToWire(error),
        });
      }
      return true;
    });
    this.#incoming.set(frame.id, inc);
    if (frame.deadline !== undefined) {
      inc.timer = setTimeout(() => {
        inc.controller.abort(
          new TransportError("MOESWARM_TRANSPORT_TIMEOUT", `dispatch ${frame.id} outlived its deadline`),
        );
        if (!inc.done) {
          inc.done = true;
          this.#incoming.delete(inc.id);
        }
      }, frame.deadline);
      inc.timer.unref?.();
    }
    const handler = this.#s.onDispatch;
    if (!handler) {
      this.#inbox.push(inc);
      return;
    }
    const t0 = now();
    Promise.resolve()
      .then(() => handler(inc))
      .then(
        (answer) => inc.respond({ y: answer?.y, ms: answer?.ms ?? now() - t0 }),
        (error: unknown) => inc.fail(error),
      )
      .catch(() => {});
  }

  // --- API ----------------------------------------------------------------------------------

  register(registration: RelayRegistration): void {
    if (this.#state === "closed")
      throw new TransportError("MOESWARM_TRANSPORT_CLOSED", "the connection is closed");
    const frame = checkRegistration(registration);
    // a Map keeps the first insertion's place when a key is set again: replays keep their order
    this.#registrations.set(registrationKey(frame), frame);
    this.#drain = null;
    if (this.#state === "connected") this.#send(this.#link, frame);
  }

  drain(reason?: string): void {
    if (this.#state === "closed")
      throw new TransportError("MOESWARM_TRANSPORT_CLOSED", "the connection is closed");
    this.#drain = reason;
    this.#registrations.clear();
    if (this.#state === "connected") this.#send(this.#link, { t: "drain", v: PROTOCOL_VERSION, reason });
  }

  registrations(): RelayRegistration[] {
    return [...this.#registrations.values()].map((f) => ({
      model: f.model,
      layers: [...f.layers],
      experts: [...f.experts],
      ...(f.capacity !== undefined ? { capacity: f.capacity } : {}),
      ...(f.backend !== undefined ? { backend: f.backend } : {}),
    }));
  }

  dispatches(options: { signal?: AbortSignal } = {}): AsyncIterableIterator<IncomingDispatch> {
    return this.#inbox.iterate({ signal: options.signal, filter: (d) => !d.done && !d.signal.aborted });
  }

  request(to: string, req: DispatchRequest, options: RequestOptions = {}): Promise<DispatchReply> {
    const { signal } = options;
    if (signal?.aborted) return Promise.reject(abortReason(signal));
    traceHop("rc.request", req.layer);
    let deadlineMs: number;
    let bytes: Uint8Array;
    let id: number;
    try {
      checkId("to", to);
      checkRequest(req);
      deadlineMs = ms("deadlineMs", options.deadlineMs, this.#s.requestTimeoutMs);
      if (this.#state !== "connected" || !this.#link) {
        throw new TransportError("MOESWARM_TRANSPORT_CLOSED", `not connected to the relay (${this.#state})`, {
          details: { to },
        });
      }
      id = this.#allocateId();
      const dtype = req.dtype ?? "f32";
      const x = activationsToWire(req.x, dtype);
      bytes = encodeFrame(
        {
          t: "dispatch",
          v: PROTOCOL_VERSION,
          id,
          to,
          model: req.model,
          layer: req.layer,
          n: req.n,
          embd: req.embd,
          ...(dtype === "f32" ? { dtype, x: x as Float32Array } : { dtype, x: x as Uint16Array }),
          k: req.k,
          ids: req.ids,
          w: req.w,
          mode: req.mode,
          deadline: Math.min(0xffff_ffff, Math.ceil(deadlineMs)),
          ...(req.compact === true && req.mode === "each" ? { compact: true } : {}),
        },
        { maxFrameBytes: this.#s.maxFrameBytes },
      );
      if (this.#link.bufferedBytes + bytes.byteLength > this.#s.maxQueueBytes) {
        throw new TransportError(
          "MOESWARM_TRANSPORT_BACKPRESSURE",
          `send queue holds ${this.#link.bufferedBytes} bytes; limit ${this.#s.maxQueueBytes}`,
          { details: { to } },
        );
      }
    } catch (error) {
      return Promise.reject(error);
    }
    const link = this.#link;
    return new Promise<DispatchReply>((resolve, reject) => {
      const settle = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        this.#pending.delete(id);
      };
      const onAbort = () => {
        settle();
        reject(abortReason(signal as AbortSignal));
      };
      const timer = setTimeout(() => {
        settle();
        reject(
          new TransportError("MOESWARM_TRANSPORT_TIMEOUT", `${to} did not answer within ${deadlineMs} ms`, {
            details: { to, deadlineMs },
          }),
        );
      }, deadlineMs);
      signal?.addEventListener("abort", onAbort, { once: true });
      this.#pending.set(id, {
        to,
        n: req.n,
        k: req.k,
        embd: req.embd,
        mode: req.mode,
        resolve: (reply) => {
          settle();
          resolve(reply);
        },
        reject: (error) => {
          settle();
          reject(error);
        },
      });
      link.send(bytes);
      traceHop("rc.sent", id);
    });
  }

  #allocateId(): number {
    for (;;) {
      const id = this.#nextId;
      this.#nextId = (this.#nextId + 1) >>> 0;
      if (!this.#pending.has(id)) return id;
    }
  }
}

function closeToError(info: LinkCloseInfo, duringHello: boolean): Error {
  // the relay closes with the code of its refusal as reason, in case its error frame was lost
  if (info.code === CLOSE_AUTH) {
    const code = info.reason.startsWith("MOESWARM_AUTH_")
      ? info.reason.split(/\s/)[0]
      : "MOESWARM_AUTH_INVALID";
    return errorFromCode(code as string, `the relay refused the hello: ${info.reason}`);
  }
  if (info.error) return info.error;
  return new TransportError(
    duringHello ? "MOESWARM_TRANSPORT_CONNECT" : "MOESWARM_TRANSPORT_CLOSED",
    `the relay closed the connection (${info.code}${info.reason ? `: ${info.reason}` : ""})`,
    { details: { closeCode: info.code } },
  );
}

function sleep(ms: number, signal: AbortSignal): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal.aborted) {
      resolve(false);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      resolve(false);
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve(true);
    }, ms);
    signal.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * Connects to a relay (`ws://` or `wss://`), says hello and resolves once the relay accepted it.
 * A refused token rejects with an AuthError and is never retried; a first dial that fails
 * rejects with a TransportError (retrying a misconfigured URL silently would hide it); drops after
 * that reconnect with backoff, say hello again and replay the registrations.
 */
export async function connectRelay(
  url: string | URL,
  options: ConnectRelayOptions,
): Promise<RelayConnection> {
  const href = String(url);
  let parsed: URL;
  try {
    parsed = new URL(href);
  } catch {
    invalid(`relay url ${JSON.stringify(href)} is not a URL`);
  }
  if (parsed.protocol !== "ws:" && parsed.protocol !== "wss:") invalid("relay url must be ws:// or wss://");
  const connection = new Connection(href, settings(options), options.signal);
  await connection.start();
  return connection;
}

import {
  AuthError,
  abortReason,
  errorFromCode,
  InvalidArgumentError,
  type MoeswarmError,
  onAbort,
  type RegisterFrame,
  sleep,
  TransportError,
  traceHop,
} from "@moeswarm/core";
import { type Backoff, backoffDelay } from "./backoff.js";
import { Channel } from "./channel.js";
import { CLOSE_DEAD_PEER, CLOSE_REPLACED, closeToError } from "./close-codes.js";
import type {
  ConnectRelayOptions,
  DispatchReply,
  DispatchRequest,
  IncomingDispatch,
  RelayConnection,
  RelayEvent,
  RelayRegistration,
  RelayState,
  RequestOptions,
} from "./connection-types.js";
import { FrameWriter } from "./frame-writer.js";
import { dialAndHello, type PendingHello } from "./handshake.js";
import { Heartbeat } from "./heartbeat.js";
import type { FrameLink, LinkCloseInfo } from "./link.js";
import {
  atLeast,
  checkId,
  checkRegistration,
  checkRequest,
  registrationKey,
  type Settings,
  settings,
} from "./options.js";
import { RequestTable } from "./requests.js";
import { WorkerServing } from "./serving.js";
import {
  decodeFrame,
  type EncodableFrame,
  type Frame,
  PROTOCOL_VERSION,
  type Role,
  relayHeadroom,
} from "./wire.js";

// One relay connection: its state and events, (re)connecting, the frames in and out, and the API.
// The parts live beside it: options.ts (checks), handshake.ts (dial and hello), heartbeat.ts,
// requests.ts (the backbone's requests in flight, back-pressure), serving.ts (the worker's
// dispatches), close-codes.ts.

class Connection implements RelayConnection {
  readonly url: string;
  readonly #s: Settings;
  #state: RelayState = "connecting";
  #link: FrameLink | undefined;
  #hello: PendingHello | undefined;
  readonly #life = new AbortController();
  readonly #writer: FrameWriter;
  readonly #requests: RequestTable;
  readonly #serving: WorkerServing;
  readonly #heartbeat: Heartbeat;
  readonly #registrations = new Map<string, RegisterFrame>();
  #drain: string | undefined | null = null;
  #closing: Promise<void> | undefined;
  readonly #closeWaiters = new Map<FrameLink, () => void>();
  readonly #events = new Channel<RelayEvent>({ broadcast: true, limit: 1024 });
  readonly #listeners = new Set<(event: RelayEvent) => void>();
  readonly #userSignal: AbortSignal | undefined;
  #userAbort: Disposable | undefined;

  constructor(url: string, s: Settings, signal: AbortSignal | undefined) {
    this.url = url;
    this.#s = s;
    this.#userSignal = signal;
    // (direct links get the relay's headroom too: a few bytes, and one writer for every link)
    this.#writer = new FrameWriter(s.maxFrameBytes, relayHeadroom(s.id));
    this.#requests = new RequestTable(this.#writer, s.peerName);
    this.#serving = new WorkerServing({
      id: s.id,
      maxIncoming: s.maxIncoming,
      onDispatch: s.onDispatch,
      send: (link, frame) => this.#send(link, frame),
      link: () => this.#link,
    });
    this.#heartbeat = new Heartbeat(
      s.heartbeatMs,
      s.deadPeerMs,
      {
        live: () => this.#link !== undefined && this.#state === "connected",
        ping: (seq, ts) => this.#send(this.#link, { t: "ping", v: PROTOCOL_VERSION, seq, ts }),
        dead: (error) => this.#dropLink(this.#link as FrameLink, error),
      },
      s.peerName,
    );
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
    return this.#heartbeat.rttMs;
  }
  get bufferedBytes(): number {
    return this.#link?.bufferedBytes ?? 0;
  }

  async start(): Promise<void> {
    const signal = this.#userSignal;
    if (signal?.aborted) throw abortReason(signal);
    this.#userAbort = onAbort(signal, () => void this.close());
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
        aborted[Symbol.dispose]();
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
      const aborted = onAbort(signal, (reason) => {
        done();
        reject(reason);
      });
    });
  }

  // --- connecting ---------------------------------------------------------------------------

  /** Dials, says hello and waits for the relay's acceptance; leaves #link set on success. */
  async #connectOnce(): Promise<void> {
    const token = await this.#s.token();
    if (typeof token !== "string") throw new InvalidArgumentError("the token function must return a string");
    await dialAndHello(this.url, this.#s, token, this.#life.signal, {
      pending: (hello) => {
        this.#hello = hello;
      },
      handlers: (link) => ({
        frame: (bytes) => this.#onFrame(link(), bytes),
        activity: () => {
          if (link() === this.#link) this.#heartbeat.seen();
        },
        close: (info) => this.#onLinkClose(link(), info),
      }),
      linked: (link) => {
        this.#link = link;
      },
      unlinked: (link) => {
        if (this.#link === link) this.#link = undefined;
      },
      send: (link, frame) => this.#send(link, frame),
    });
  }

  #accepted(): void {
    this.#heartbeat.start();
    this.#setState("connected");
    for (const reg of this.#registrations.values()) this.#send(this.#link, reg);
    if (this.#drain !== null)
      this.#send(this.#link, { t: "drain", v: PROTOCOL_VERSION, reason: this.#drain });
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
    this.#heartbeat.stop();
    const error = closeToError(info, false);
    this.#failInFlight(error);
    if (this.#state === "closed" || this.#life.signal.aborted) return;
    if (!this.#s.reconnect || info.code === CLOSE_REPLACED || error instanceof AuthError) {
      this.#finish(error);
      return;
    }
    void this.#reconnect(this.#s.reconnect, error);
  }

  #failInFlight(cause: Error): void {
    this.#requests.failAll(cause);
    this.#serving.abortAll(cause);
  }

  async #reconnect(backoff: Backoff, cause: Error): Promise<void> {
    const life = this.#life.signal;
    this.#setState("reconnecting", { error: cause });
    let last: Error = cause;
    for (let attempt = 1; ; attempt++) {
      if (life.aborted) return;
      if (attempt > backoff.maxAttempts) {
        const msg = `gave up after ${backoff.maxAttempts} attempts`;
        this.#finish(new TransportError("MOESWARM_TRANSPORT_CONNECT", msg, { cause: last }));
        return;
      }
      const delayMs = backoffDelay(attempt, backoff);
      this.#setState("reconnecting", { attempt, delayMs, error: last });
      try {
        await sleep(delayMs, life);
        await this.#connectOnce();
      } catch (error) {
        if (life.aborted) return;
        last = error instanceof Error ? error : new Error(String(error));
        if (error instanceof AuthError) {
          this.#finish(error);
          return;
        }
        continue;
      }
      if (life.aborted) return;
      this.#accepted();
      return;
    }
  }

  #finish(error: Error | undefined): void {
    if (this.#state === "closed") return;
    this.#life.abort();
    this.#userAbort?.[Symbol.dispose]();
    this.#heartbeat.stop();
    this.#failInFlight(error ?? new TransportError("MOESWARM_TRANSPORT_CLOSED", "closed"));
    this.#setState("closed", error ? { error } : {});
    this.#events.end();
    this.#serving.end();
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

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }

  // --- frames -------------------------------------------------------------------------------

  /** Encodes and queues a frame; throws when the frame is invalid or over maxFrameBytes. */
  #send(link: FrameLink | undefined, frame: EncodableFrame): boolean {
    if (!link) return false;
    this.#writer.send(link, frame);
    return true;
  }

  #onFrame(link: FrameLink, bytes: Uint8Array): void {
    if (link !== this.#link) return;
    traceHop("rc.in");
    this.#heartbeat.seen();
    let frame: Frame;
    try {
      frame = decodeFrame(bytes, { maxFrameBytes: this.#s.maxFrameBytes });
    } catch (error) {
      this.#emit({ type: "notice", error: error as MoeswarmError });
      return;
    }
    if (this.#hello && this.#hello.link === link) {
      this.#hello.frame(frame);
      return;
    }
    switch (frame.t) {
      case "result":
        this.#requests.result(frame);
        return;
      case "error":
        if (frame.id === undefined)
          this.#emit({ type: "notice", error: errorFromCode(frame.code, frame.msg) });
        else this.#requests.error({ ...frame, id: frame.id });
        return;
      case "dispatch":
        if (this.#s.role === "worker") this.#serving.accept(link, frame);
        else {
          const msg = "a backbone does not take dispatches";
          const to = frame.from;
          this.#send(link, {
            t: "error",
            v: PROTOCOL_VERSION,
            id: frame.id,
            to,
            code: "MOESWARM_AUTH_ROLE",
            msg,
          });
        }
        return;
      case "ping":
        this.#send(link, { t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts });
        return;
      case "pong":
        this.#heartbeat.pong(frame.seq, frame.ts);
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
    return this.#serving.dispatches(options);
  }

  request(to: string, req: DispatchRequest, options: RequestOptions = {}): Promise<DispatchReply> {
    const { signal } = options;
    if (signal?.aborted) return Promise.reject(abortReason(signal));
    traceHop("rc.request", req.layer);
    try {
      checkId("to", to);
      checkRequest(req);
      const deadlineMs = atLeast("deadlineMs", options.deadlineMs, this.#s.requestTimeoutMs);
      const link = this.#link;
      if (this.#state !== "connected" || !link) {
        throw new TransportError("MOESWARM_TRANSPORT_CLOSED", `not connected to the relay (${this.#state})`, {
          details: { to },
        });
      }
      return this.#requests.send({
        link,
        to,
        request: req,
        deadlineMs,
        maxQueueBytes: this.#s.maxQueueBytes,
        signal,
      });
    } catch (error) {
      return Promise.reject(error);
    }
  }
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
    throw new InvalidArgumentError(`relay url ${JSON.stringify(href)} is not a URL`);
  }
  if (parsed.protocol !== "ws:" && parsed.protocol !== "wss:")
    throw new InvalidArgumentError("relay url must be ws:// or wss://");
  const connection = new Connection(href, settings(options), options.signal);
  await connection.start();
  return connection;
}

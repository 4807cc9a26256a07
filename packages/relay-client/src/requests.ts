import {
  abortReason,
  EarliestDeadline,
  errorFromCode,
  isQuantizedActivationDtype,
  ProtocolError,
  TransportError,
  traceHop,
} from "@moeswarm/core";
import type { DispatchReply, DispatchRequest } from "./connection-types.js";
import type { FrameWriter } from "./frame-writer.js";
import type { FrameLink } from "./link.js";
import { activationsToWire } from "./tensors.js";
import {
  type DispatchFrame,
  type DispatchMode,
  type ErrorFrame,
  PROTOCOL_VERSION,
  type ResultFrame,
} from "./wire.js";

// The backbone side: requests in flight by id, each with its deadline, its caller's signal and the
// shape its result must have. A request costs no timer and no closure of its own: one timer per
// table, armed for the earliest deadline, sweeps the expired ones (the request it was armed for
// expires when it fires, whatever a clock says, as a timer per request would), the abort listener
// is the request object itself (handleEvent), and the promise's executor is shared.

const ONCE = { once: true } as const;

/** A request in flight: its shape, its promise's settlers, its deadline and its caller's signal. */
class Pending {
  resolve!: (reply: DispatchReply) => void;
  reject!: (error: unknown) => void;

  constructor(
    readonly table: RequestTable,
    readonly id: number,
    readonly to: string,
    readonly n: number,
    readonly k: number,
    readonly embd: number,
    readonly mode: DispatchMode,
    readonly deadlineMs: number,
    /** performance.now() at which it expires. */
    readonly due: number,
    readonly signal: AbortSignal | undefined,
  ) {}

  /** The caller's signal aborted. */
  handleEvent(): void {
    this.table.fail(this, abortReason(this.signal as AbortSignal));
  }
}

// The promise executor of every request (it runs synchronously inside `new Promise`): no closure
// per request.
let executing: Pending | undefined;
function executor(resolve: (reply: DispatchReply) => void, reject: (error: unknown) => void): void {
  const p = executing as Pending;
  p.resolve = resolve;
  p.reject = reject;
}

/** What a request is sent with. */
export interface Outgoing {
  readonly link: FrameLink;
  readonly to: string;
  readonly request: DispatchRequest;
  readonly deadlineMs: number;
  /** Bytes that may wait in the link's send buffer (back-pressure). */
  readonly maxQueueBytes: number;
  readonly signal: AbortSignal | undefined;
}

export class RequestTable {
  readonly #pending = new Map<number, Pending>();
  #nextId = 0;
  readonly #writer: FrameWriter;
  /** What the link's peer is called in errors ("the relay", or a worker on its direct link). */
  readonly #peer: string;
  /** The one deadline timer; it holds the process open while requests wait. */
  readonly #deadline = new EarliestDeadline<Pending>((armedFor, at) => this.#expire(armedFor, at));

  /** `writer` encodes the dispatches (and enforces maxFrameBytes). */
  constructor(writer: FrameWriter, peer = "the relay") {
    this.#writer = writer;
    this.#peer = peer;
  }

  /**
   * Encodes and sends the dispatch and waits for its answer. Throws at once (before anything is
   * sent) for a frame over maxFrameBytes, a send buffer over maxQueueBytes or an aborted signal.
   */
  send(out: Outgoing): Promise<DispatchReply> {
    if (out.signal?.aborted) throw abortReason(out.signal);
    const id = this.#allocateId();
    // the bytes may be lent (memory reused once the link calls `sent`)
    return this.#writer.encode(out.link, dispatchFrameOf(id, out), (bytes, sent) =>
      this.#sendBytes(id, bytes, sent, out),
    );
  }

  #sendBytes(
    id: number,
    bytes: Uint8Array,
    sent: (() => void) | undefined,
    out: Outgoing,
  ): Promise<DispatchReply> {
    const { link, to, request: req, deadlineMs, signal } = out;
    if (link.bufferedBytes + bytes.byteLength > out.maxQueueBytes) {
      throw new TransportError(
        "MOESWARM_TRANSPORT_BACKPRESSURE",
        `send queue holds ${link.bufferedBytes} bytes; limit ${out.maxQueueBytes}`,
        { details: { to } },
      );
    }
    const now = performance.now();
    const p = new Pending(
      this,
      id,
      to,
      req.n,
      req.k,
      req.embd,
      req.mode,
      deadlineMs,
      now + deadlineMs,
      signal,
    );
    executing = p;
    const promise = new Promise<DispatchReply>(executor);
    executing = undefined;
    this.#pending.set(id, p);
    signal?.addEventListener("abort", p, ONCE);
    if (this.#pending.size === 1) this.#deadline.hold(true);
    this.#deadline.offer(p, now);
    try {
      link.send(bytes, sent);
    } catch (error) {
      this.fail(p, error);
      return promise;
    }
    traceHop("rc.sent", id);
    return promise;
  }

  /** The timer fired: its request and every other one past its deadline time out. */
  #expire(armedFor: Pending | undefined, now: number): void {
    let next: Pending | undefined;
    // (deleting the entry being visited is safe in a Map's iteration)
    for (const p of this.#pending.values()) {
      if (p === armedFor || p.due <= now) {
        this.fail(
          p,
          new TransportError(
            "MOESWARM_TRANSPORT_TIMEOUT",
            `${p.to} did not answer within ${p.deadlineMs} ms`,
            {
              details: { to: p.to, deadlineMs: p.deadlineMs },
            },
          ),
        );
      } else if (next === undefined || p.due < next.due) next = p;
    }
    if (next !== undefined) this.#deadline.offer(next, now);
  }

  /** Takes `p` out of the table (its listener too); the timer stops holding the process when none is left. */
  #settle(p: Pending): boolean {
    if (this.#pending.get(p.id) !== p) return false;
    this.#pending.delete(p.id);
    p.signal?.removeEventListener("abort", p);
    this.#deadline.forget(p);
    if (this.#pending.size === 0) this.#deadline.hold(false);
    return true;
  }

  /** Rejects request `p` if it still waits. @internal (Pending's abort listener calls it) */
  fail(p: Pending, error: unknown): void {
    if (this.#settle(p)) p.reject(error);
  }

  /** A `result` frame: resolves its request if it still waits and the shape is the request's. */
  result(frame: ResultFrame): void {
    const p = this.#pending.get(frame.id);
    if (!p) return; // answered late: the request already timed out or was aborted
    if (frame.mode !== p.mode || frame.n !== p.n || frame.k !== p.k || frame.embd !== p.embd) {
      this.fail(
        p,
        new ProtocolError(
          "MOESWARM_PROTOCOL_BAD_LENGTH",
          `result from ${frame.from ?? p.to} has shape ${frame.mode} n=${frame.n} k=${frame.k} embd=${frame.embd}, the request ${p.mode} n=${p.n} k=${p.k} embd=${p.embd}`,
        ),
      );
      return;
    }
    this.#settle(p);
    p.resolve({
      y: frame.y,
      ms: frame.ms,
      from: frame.from ?? p.to,
      ...(frame.compact === true ? { compact: true } : {}),
    });
  }

  /** An `error` frame answering request `frame.id`. */
  error(frame: ErrorFrame & { id: number }): void {
    const p = this.#pending.get(frame.id);
    if (p) this.fail(p, errorFromCode(frame.code, frame.msg, { details: { from: frame.from ?? p.to } }));
  }

  /** The link is gone: every request in flight fails at once. */
  failAll(cause: Error): void {
    for (const p of [...this.#pending.values()]) {
      this.fail(
        p,
        new TransportError(
          "MOESWARM_TRANSPORT_CLOSED",
          `connection to ${this.#peer} lost before ${p.to} answered: ${cause.message}`,
          { cause, details: { to: p.to, peer: this.#peer } },
        ),
      );
    }
  }

  /** Requests waiting for their answer. */
  get size(): number {
    return this.#pending.size;
  }

  #allocateId(): number {
    for (;;) {
      const id = this.#nextId;
      this.#nextId = (this.#nextId + 1) >>> 0;
      if (!this.#pending.has(id)) return id;
    }
  }
}

function dispatchFrameOf(id: number, out: Outgoing): DispatchFrame {
  const { to, request: req, deadlineMs } = out;
  const dtype = req.dtype ?? "f32";
  const x = activationsToWire(req.x, dtype);
  return {
    t: "dispatch",
    v: PROTOCOL_VERSION,
    id,
    to,
    model: req.model,
    layer: req.layer,
    n: req.n,
    embd: req.embd,
    ...(dtype === "f32"
      ? { dtype, x: x as Float32Array }
      : isQuantizedActivationDtype(dtype)
        ? { dtype, x: x as Uint8Array }
        : { dtype, x: x as Uint16Array }),
    k: req.k,
    ids: req.ids,
    w: req.w,
    mode: req.mode,
    deadline: Math.min(0xffff_ffff, Math.ceil(deadlineMs)),
    ...(req.compact === true && req.mode === "each" ? { compact: true } : {}),
  };
}

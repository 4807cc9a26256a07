import {
  EarliestDeadline,
  errorToWire,
  filledSlots,
  type InPlaceTensor,
  InvalidArgumentError,
  ProtocolError,
  type QuantizedActivationDtype,
  TransportError,
  traceHop,
} from "@moeswarm/core";
import { Channel } from "./channel.js";
import type {
  DispatchAnswer,
  DispatchAnswerInto,
  DispatchHandler,
  IncomingDispatch,
} from "./connection-types.js";
import type { FrameLink } from "./link.js";
import { activationsToF32 } from "./tensors.js";
import {
  type DispatchFrame,
  type DispatchMode,
  type EncodableFrame,
  type ErrorFrame,
  PROTOCOL_VERSION,
  type ResultFrame,
  type ResultInPlace,
  type WireDtype,
} from "./wire.js";

// The worker side: dispatches this worker holds, each answered once (by the onDispatch handler or
// by whoever reads dispatches()), with its sender's deadline and the link's life as its signal.
// A dispatch costs no timer, no AbortController and no promise of its own: one timer per serving
// table (one per link), armed for the earliest deadline, sweeps the expired ones (the dispatch it
// was armed for expires when it fires, whatever a clock says, as a timer per dispatch would); the
// controller is made when a handler first reads `signal` (one aborted before that gets a signal
// already aborted with the same reason); a handler that answers synchronously is answered right
// there, without promise jobs (an async one is awaited).

const now = () => performance.now();

/** compactSlots written into `out` (the frame's memory): the filled slots' rows, in slot order. */
function compactSlotsInto(y: Float32Array, ids: Int32Array, embd: number, out: Float32Array): void {
  let row = 0;
  for (let s = 0; s < ids.length; s++) {
    if (ids[s]! < 0) continue;
    out.set(y.subarray(s * embd, (s + 1) * embd), row * embd);
    row++;
  }
}

/**
 * A `{ fill }` answer's y as the encoder takes it. `t0` set (a handler's answer without `ms`): the
 * result's ms is the time a fill that computes returns, else the handler's time up to the end of
 * the fill. One object, no closure.
 */
class FillTensor implements InPlaceTensor {
  constructor(
    readonly values: number,
    readonly answer: DispatchAnswerInto,
    readonly t0: number | undefined,
  ) {}

  fill(y: Float32Array): unknown {
    const ms = this.answer.fill(y);
    if (this.t0 === undefined) return ms;
    return typeof ms === "number" ? ms : now() - this.t0;
  }
}

/** A compact answer's y: the filled slots' rows of the full answer, copied into the frame. */
class CompactTensor implements InPlaceTensor {
  constructor(
    readonly values: number,
    readonly y: Float32Array,
    readonly ids: Int32Array,
    readonly embd: number,
  ) {}

  fill(out: Float32Array): void {
    compactSlotsInto(this.y, this.ids, this.embd, out);
  }
}

const isThenable = (v: unknown): v is PromiseLike<unknown> =>
  typeof (v as PromiseLike<unknown> | undefined)?.then === "function";

export class Incoming implements IncomingDispatch {
  readonly id: number;
  readonly from: string;
  readonly model: string;
  readonly layer: number;
  readonly n: number;
  readonly embd: number;
  readonly k: number;
  readonly dtype: WireDtype | QuantizedActivationDtype;
  readonly mode: DispatchMode;
  readonly x: Float32Array | Uint16Array | Uint8Array;
  readonly ids: Int32Array;
  readonly w: Float32Array | undefined;
  readonly deadline: number | undefined;
  readonly compact: boolean;
  /** performance.now() at which the deadline passes (+Infinity without one). */
  readonly due: number;
  done = false;
  /** Made when `signal` is first read. */
  #controller: AbortController | undefined;
  /** Why it was aborted (deadline, link lost), once it was. */
  #reason: Error | undefined;

  constructor(
    frame: DispatchFrame,
    from: string | undefined,
    /** The table that holds it and the link it came in on (its answer goes out there). */
    readonly table: WorkerServing,
    readonly link: FrameLink,
    at: number,
  ) {
    this.id = frame.id;
    this.from = from ?? "";
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
    this.due = frame.deadline === undefined ? Number.POSITIVE_INFINITY : at + frame.deadline;
  }

  get signal(): AbortSignal {
    if (this.#controller === undefined) {
      this.#controller = new AbortController();
      if (this.#reason !== undefined) this.#controller.abort(this.#reason);
    }
    return this.#controller.signal;
  }

  /** Aborted (its signal is, or will be when read). */
  get aborted(): boolean {
    return this.#reason !== undefined;
  }

  /** Aborts the signal (once), whether or not it was read yet. */
  abort(reason: Error): void {
    if (this.#reason !== undefined) return;
    this.#reason = reason;
    this.#controller?.abort(reason);
  }

  activations(): Float32Array {
    return activationsToF32(this.x, this.dtype);
  }

  /** Values of a full answer: n*k*embd for mode "each", n*embd for "sum". */
  get values(): number {
    return (this.mode === "each" ? this.n * this.k : this.n) * this.embd;
  }

  respond(answer: DispatchAnswer): boolean {
    return this.#respond(answer?.y, answer?.ms);
  }

  #respond(y: unknown, ms: number | undefined): boolean {
    const expected = this.values;
    if (!(y instanceof Float32Array) || y.length !== expected) {
      return this.fail(
        new ProtocolError(
          "MOESWARM_PROTOCOL_BAD_LENGTH",
          `result y must be a Float32Array of ${expected} values (mode ${this.mode})`,
        ),
      );
    }
    if (!this.compact) return this.#result(y, ms, false);
    // the filled slots' rows, copied straight into the frame (no compact array of their own)
    const filled = filledSlots(this.ids);
    if (filled === this.ids.length) return this.#result(y, ms, true);
    return this.#result(new CompactTensor(filled * this.embd, y, this.ids, this.embd), ms, true);
  }

  respondInto(answer: DispatchAnswerInto): boolean {
    return this.#respondInto(answer, undefined);
  }

  /** `t0`: the handler's start, for the ms of a handler's answer that gives none. */
  #respondInto(answer: DispatchAnswerInto, t0: number | undefined): boolean {
    const fill = answer?.fill;
    if (typeof fill !== "function") {
      return this.fail(new InvalidArgumentError("respondInto needs { fill(y), ms? }"));
    }
    if (this.compact) {
      // the full answer first: a compact result is its filled slots' rows
      const y = new Float32Array(this.values);
      let ms: unknown;
      try {
        ms = answer.fill(y);
      } catch (error) {
        return this.fail(error);
      }
      return this.#respond(
        y,
        answer.ms ?? (typeof ms === "number" ? ms : t0 === undefined ? undefined : now() - t0),
      );
    }
    // an exception from fill fails the encoding: the answer goes out as an error frame with its
    // code (as for any result that cannot be encoded); without `ms`, the number fill returns is
    // written as the frame's (after y on the wire: see core's InPlaceTensor)
    return this.#result(
      new FillTensor(this.values, answer, answer.ms === undefined ? t0 : undefined),
      answer.ms,
      false,
    );
  }

  /**
   * The onDispatch handler's answer (or the exception it threw or rejected with), started at
   * `t0`: `{ fill }` goes to respondInto, anything else to respond (whose checks refuse what is
   * not a `y` of the right length). @internal
   */
  answer(answer: DispatchAnswer | DispatchAnswerInto | undefined, t0: number): void {
    try {
      if (typeof (answer as Partial<DispatchAnswerInto> | undefined)?.fill === "function") {
        this.#respondInto(answer as DispatchAnswerInto, t0);
      } else {
        this.#respond((answer as DispatchAnswer | undefined)?.y, answer?.ms ?? now() - t0);
      }
    } catch {
      // not even an error frame could be sent (the link fails as a close): nothing more to do
    }
  }

  /** The handler threw or rejected: its error is the answer. @internal */
  failed(error: unknown): void {
    try {
      this.fail(error);
    } catch {
      // as in answer()
    }
  }

  #result(y: Float32Array | InPlaceTensor, ms: number | undefined, compact: boolean): boolean {
    const frame = {
      t: "result",
      v: PROTOCOL_VERSION,
      id: this.id,
      to: this.from || undefined,
      mode: this.mode,
      n: this.n,
      k: this.k,
      embd: this.embd,
      y,
      ms,
    } as ResultFrame | ResultInPlace;
    if (compact) frame.compact = true;
    return this.table.reply(this, frame);
  }

  fail(error: unknown): boolean {
    const { code, msg } = errorToWire(error);
    return this.table.reply(this, {
      t: "error",
      v: PROTOCOL_VERSION,
      id: this.id,
      to: this.from || undefined,
      code,
      msg,
    });
  }
}

export interface ServingOptions {
  readonly id: string;
  readonly maxIncoming: number;
  readonly onDispatch: DispatchHandler | undefined;
  /** Encodes and queues a frame; throws when it cannot be encoded (e.g. over maxFrameBytes). */
  send(link: FrameLink, frame: EncodableFrame): void;
  /** The connection's current link: an answer goes out only on the link its dispatch came in on. */
  link(): FrameLink | undefined;
}

export class WorkerServing {
  readonly #o: ServingOptions;
  readonly #incoming = new Map<number, Incoming>();
  readonly #inbox = new Channel<Incoming>({ broadcast: false, limit: 1_000_000 });
  /** The one deadline timer (it never holds the process open). */
  readonly #deadline = new EarliestDeadline<Incoming>((armedFor, at) => this.#expire(armedFor, at));

  constructor(options: ServingOptions) {
    this.#o = options;
  }

  /**
   * A `dispatch` frame that reached this worker on `link`, from `from` (default: the frame's
   * `from`; a direct link's sender is the one its ticket names).
   */
  accept(link: FrameLink, frame: DispatchFrame, from = frame.from): void {
    if (this.#incoming.size >= this.#o.maxIncoming || this.#incoming.has(frame.id)) {
      this.#o.send(link, {
        t: "error",
        v: PROTOCOL_VERSION,
        id: frame.id,
        to: from,
        code: "MOESWARM_TRANSPORT_LIMIT",
        msg: `worker ${this.#o.id} holds ${this.#incoming.size} dispatches`,
      });
      return;
    }
    const t0 = now();
    const inc = new Incoming(frame, from, this, link, t0);
    this.#incoming.set(frame.id, inc);
    this.#deadline.offer(inc, t0);
    const handler = this.#o.onDispatch;
    if (!handler) {
      this.#inbox.push(inc);
      return;
    }
    let answer: ReturnType<DispatchHandler>;
    try {
      answer = handler(inc);
    } catch (error) {
      inc.failed(error);
      return;
    }
    if (isThenable(answer)) {
      answer.then(
        (a) => inc.answer(a, t0),
        (error: unknown) => inc.failed(error),
      );
    } else inc.answer(answer, t0);
  }

  /** The timer fired: its dispatch and every other one past its deadline are aborted and dropped. */
  #expire(armedFor: Incoming | undefined, at: number): void {
    let next: Incoming | undefined;
    // (deleting the entry being visited is safe in a Map's iteration)
    for (const inc of this.#incoming.values()) {
      if (inc === armedFor || inc.due <= at) {
        inc.abort(
          new TransportError("MOESWARM_TRANSPORT_TIMEOUT", `dispatch ${inc.id} outlived its deadline`),
        );
        // (an abort listener may have answered it)
        if (!inc.done) {
          inc.done = true;
          this.#incoming.delete(inc.id);
        }
      } else if (inc.due < (next?.due ?? Number.POSITIVE_INFINITY)) next = inc;
    }
    if (next !== undefined) this.#deadline.offer(next, at);
  }

  /**
   * Sends a dispatch's answer once, on the link it came in on, while that link lives.
   * @internal (Incoming calls it)
   */
  reply(self: Incoming, reply: ResultFrame | ResultInPlace | ErrorFrame | undefined): boolean {
    const link = self.link;
    if (self.done || this.#incoming.get(self.id) !== self || link !== this.#o.link()) return false;
    self.done = true;
    this.#incoming.delete(self.id);
    // the timer stays armed (re-arming it per answer would cost a timer per dispatch again): when
    // it fires it sweeps whatever is due then; it keeps no answered dispatch (and its frame) alive
    this.#deadline.forget(self);
    if (!reply) return true;
    try {
      this.#o.send(link, reply);
      traceHop("rc.answered", self.id);
    } catch (error) {
      // e.g. a result larger than maxFrameBytes: the backbone still gets an answer
      this.#o.send(link, {
        t: "error",
        v: PROTOCOL_VERSION,
        id: self.id,
        to: reply.to,
        ...errorToWire(error),
      });
    }
    return true;
  }

  /** The link is gone: every dispatch held is aborted (its answer could not be delivered). */
  abortAll(cause: Error): void {
    const incoming = [...this.#incoming.values()];
    this.#incoming.clear();
    this.#deadline.stop();
    for (const inc of incoming) {
      inc.done = true;
      inc.abort(new TransportError("MOESWARM_TRANSPORT_CLOSED", "relay connection lost", { cause }));
    }
  }

  /** Dispatches held (received, not yet answered, aborted or timed out). */
  get size(): number {
    return this.#incoming.size;
  }

  /** Incoming dispatches, when no onDispatch handler is set. Ends at end(). */
  dispatches(options: { signal?: AbortSignal } = {}): AsyncIterableIterator<IncomingDispatch> {
    return this.#inbox.iterate({ signal: options.signal, filter: (d) => !d.done && !d.aborted });
  }

  end(): void {
    this.#inbox.end();
  }
}

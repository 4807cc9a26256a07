import {
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
 * A handler's `{ fill }` answer with its `ms`: the one given; else the time a fill that computes
 * returns; else the handler's time up to the end of the fill.
 */
function answerInto(answer: DispatchAnswerInto, t0: number): DispatchAnswerInto {
  if (answer.ms !== undefined) return answer;
  const fill = answer.fill;
  return {
    fill: (y) => {
      const ms = fill(y);
      return typeof ms === "number" ? ms : now() - t0;
    },
  };
}

export class Incoming implements IncomingDispatch {
  readonly controller = new AbortController();
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
  timer: ReturnType<typeof setTimeout> | undefined;
  done = false;

  constructor(
    frame: DispatchFrame,
    private readonly reply: (
      self: Incoming,
      frame: ResultFrame | ResultInPlace | ErrorFrame | undefined,
    ) => boolean,
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

  /** Values of a full answer: n*k*embd for mode "each", n*embd for "sum". */
  get values(): number {
    return (this.mode === "each" ? this.n * this.k : this.n) * this.embd;
  }

  respond(answer: DispatchAnswer): boolean {
    const y = answer?.y;
    const expected = this.values;
    if (!(y instanceof Float32Array) || y.length !== expected) {
      return this.fail(
        new ProtocolError(
          "MOESWARM_PROTOCOL_BAD_LENGTH",
          `result y must be a Float32Array of ${expected} values (mode ${this.mode})`,
        ),
      );
    }
    if (!this.compact) return this.#result(y, answer.ms);
    // the filled slots' rows, copied straight into the frame (no compact array of their own)
    const filled = filledSlots(this.ids);
    if (filled === this.ids.length) return this.#result(y, answer.ms, true);
    return this.#result(
      {
        values: filled * this.embd,
        fill: (out: Float32Array) => compactSlotsInto(y, this.ids, this.embd, out),
      },
      answer.ms,
      true,
    );
  }

  respondInto(answer: DispatchAnswerInto): boolean {
    const fill = answer?.fill;
    if (typeof fill !== "function") {
      return this.fail(new InvalidArgumentError("respondInto needs { fill(y), ms? }"));
    }
    if (this.compact) {
      // the full answer first: a compact result is its filled slots' rows
      const y = new Float32Array(this.values);
      let ms: unknown;
      try {
        ms = fill(y);
      } catch (error) {
        return this.fail(error);
      }
      return this.respond({ y, ms: answer.ms ?? (typeof ms === "number" ? ms : undefined) });
    }
    // an exception from fill fails the encoding: the answer goes out as an error frame with its
    // code (as for any result that cannot be encoded); without `ms`, the number fill returns is
    // written as the frame's (after y on the wire: see core's InPlaceTensor)
    return this.#result({ values: this.values, fill }, answer.ms);
  }

  #result(y: Float32Array | InPlaceTensor, ms: number | undefined, compact = false): boolean {
    return this.reply(this, {
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
      ...(compact ? { compact: true } : {}),
    } as ResultFrame | ResultInPlace);
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

  constructor(options: ServingOptions) {
    this.#o = options;
  }

  /** A `dispatch` frame that reached this worker on `link`. */
  accept(link: FrameLink, frame: DispatchFrame): void {
    if (this.#incoming.size >= this.#o.maxIncoming || this.#incoming.has(frame.id)) {
      this.#o.send(link, {
        t: "error",
        v: PROTOCOL_VERSION,
        id: frame.id,
        to: frame.from,
        code: "MOESWARM_TRANSPORT_LIMIT",
        msg: `worker ${this.#o.id} holds ${this.#incoming.size} dispatches`,
      });
      return;
    }
    const inc = new Incoming(frame, (self, reply) => this.#reply(link, self, reply));
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
    const handler = this.#o.onDispatch;
    if (!handler) {
      this.#inbox.push(inc);
      return;
    }
    const t0 = now();
    Promise.resolve()
      .then(() => handler(inc))
      .then(
        (answer) =>
          typeof (answer as Partial<DispatchAnswerInto> | undefined)?.fill === "function"
            ? inc.respondInto(answerInto(answer as DispatchAnswerInto, t0))
            : inc.respond({
                y: (answer as DispatchAnswer | undefined)?.y as Float32Array,
                ms: answer?.ms ?? now() - t0,
              }),
        (error: unknown) => inc.fail(error),
      )
      .catch(() => {});
  }

  /** Sends a dispatch's answer once, on the link it came in on, while that link lives. */
  #reply(
    link: FrameLink,
    self: Incoming,
    reply: ResultFrame | ResultInPlace | ErrorFrame | undefined,
  ): boolean {
    if (self.done || this.#incoming.get(self.id) !== self || link !== this.#o.link()) return false;
    self.done = true;
    clearTimeout(self.timer);
    this.#incoming.delete(self.id);
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
    for (const inc of incoming) {
      inc.done = true;
      clearTimeout(inc.timer);
      inc.controller.abort(
        new TransportError("MOESWARM_TRANSPORT_CLOSED", "relay connection lost", { cause }),
      );
    }
  }

  /** Incoming dispatches, when no onDispatch handler is set. Ends at end(). */
  dispatches(options: { signal?: AbortSignal } = {}): AsyncIterableIterator<IncomingDispatch> {
    return this.#inbox.iterate({ signal: options.signal, filter: (d) => !d.done && !d.signal.aborted });
  }

  end(): void {
    this.#inbox.end();
  }
}

import {
  errorFromCode,
  isQuantizedActivationDtype,
  onAbort,
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
// shape its result must have.

interface Pending {
  to: string;
  n: number;
  k: number;
  embd: number;
  mode: DispatchMode;
  resolve(reply: DispatchReply): void;
  reject(error: unknown): void;
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

  /** `writer` encodes the dispatches (and enforces maxFrameBytes). */
  constructor(writer: FrameWriter, peer = "the relay") {
    this.#writer = writer;
    this.#peer = peer;
  }

  /**
   * Encodes and sends the dispatch and waits for its answer. Throws at once (before anything is
   * sent) for a frame over maxFrameBytes or a send buffer over maxQueueBytes.
   */
  send(out: Outgoing): Promise<DispatchReply> {
    const id = this.#allocateId();
    // the bytes may be lent (memory reused by the next frame): sent before `send` returns
    return this.#writer.encode(out.link, dispatchFrameOf(id, out), (bytes) =>
      this.#sendBytes(id, bytes, out),
    );
  }

  #sendBytes(id: number, bytes: Uint8Array, out: Outgoing): Promise<DispatchReply> {
    const { link, to, request: req, deadlineMs, signal } = out;
    // (the Promise executor runs at once: the bytes reach link.send while still lent)
    if (link.bufferedBytes + bytes.byteLength > out.maxQueueBytes) {
      throw new TransportError(
        "MOESWARM_TRANSPORT_BACKPRESSURE",
        `send queue holds ${link.bufferedBytes} bytes; limit ${out.maxQueueBytes}`,
        { details: { to } },
      );
    }
    return new Promise<DispatchReply>((resolve, reject) => {
      const settle = () => {
        clearTimeout(timer);
        aborted[Symbol.dispose]();
        this.#pending.delete(id);
      };
      const timer = setTimeout(() => {
        settle();
        reject(
          new TransportError("MOESWARM_TRANSPORT_TIMEOUT", `${to} did not answer within ${deadlineMs} ms`, {
            details: { to, deadlineMs },
          }),
        );
      }, deadlineMs);
      const aborted = onAbort(signal, (reason) => {
        settle();
        reject(reason);
      });
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

  /** A `result` frame: resolves its request if it still waits and the shape is the request's. */
  result(frame: ResultFrame): void {
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
  }

  /** An `error` frame answering request `frame.id`. */
  error(frame: ErrorFrame & { id: number }): void {
    const p = this.#pending.get(frame.id);
    p?.reject(errorFromCode(frame.code, frame.msg, { details: { from: frame.from ?? p.to } }));
  }

  /** The link is gone: every request in flight fails at once. */
  failAll(cause: Error): void {
    const pending = [...this.#pending.values()];
    this.#pending.clear();
    for (const p of pending) {
      p.reject(
        new TransportError(
          "MOESWARM_TRANSPORT_CLOSED",
          `connection to ${this.#peer} lost before ${p.to} answered: ${cause.message}`,
          { cause, details: { to: p.to, peer: this.#peer } },
        ),
      );
    }
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

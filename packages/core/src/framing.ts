import type { Writable } from "node:stream";
import { onAbort } from "./abort.js";
import { encodeFrameWithPrefixSpace } from "./codec.js";
import { InvalidArgumentError, ProtocolError, TransportError, throwIfAborted } from "./errors.js";
import { DEFAULT_MAX_FRAME_BYTES, type Frame } from "./frames.js";
import { firstLargeBinOffset } from "./msgpack-read.js";
import { Slab } from "./slab.js";

const frames = new Slab();

// Byte streams (stdio, TCP) carry frames as a u32 little-endian payload length followed by the
// msgpack payload. The length is checked against the maximum before anything is allocated for it.

/** Bytes of the length prefix. */
export const LENGTH_PREFIX_BYTES = 4;

export interface FramingOptions {
  /** Largest payload accepted or produced, in bytes (default 64 MiB, at most 2^32 - 1). */
  maxFrameBytes?: number;
}

function maxFrameBytesOf(options: FramingOptions): number {
  const max = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
  if (!Number.isSafeInteger(max) || max < 1 || max > 0xffff_ffff) {
    throw new InvalidArgumentError(`maxFrameBytes must be an integer in 1..2^32-1, got ${String(max)}`);
  }
  return max;
}

function tooLarge(size: number, max: number): ProtocolError {
  return new ProtocolError(
    "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
    `frame of ${size} bytes exceeds the maximum of ${max}`,
    { details: { size, max } },
  );
}

/**
 * A frame (encoded canonically) or an already encoded payload, with its length prefix, as one
 * buffer. Frames are encoded straight behind the prefix; raw payloads are copied once.
 */
export function encodeLengthPrefixed(input: Frame | Uint8Array, options: FramingOptions = {}): Uint8Array {
  const max = maxFrameBytesOf(options);
  if (input instanceof Uint8Array) {
    if (input.byteLength > max) throw tooLarge(input.byteLength, max);
    const out = new Uint8Array(LENGTH_PREFIX_BYTES + input.byteLength);
    new DataView(out.buffer).setUint32(0, input.byteLength, true);
    out.set(input, LENGTH_PREFIX_BYTES);
    return out;
  }
  const out = encodeFrameWithPrefixSpace(input, { maxFrameBytes: max });
  const size = out.byteLength - LENGTH_PREFIX_BYTES;
  new DataView(out.buffer, out.byteOffset, LENGTH_PREFIX_BYTES).setUint32(0, size, true);
  return out;
}

/**
 * Reassembles length-prefixed frames from arbitrary chunks. `push` returns the payloads that the
 * chunk completes; `end` says the stream is over and throws if it stopped inside a frame. A
 * payload that lies within one chunk is returned as a view of that chunk (no copy), so chunks
 * must not be reused by their producer; a payload spread over chunks is copied into one buffer,
 * allocated when its length prefix has been checked and placed so that the frame's main tensor
 * is aligned (then `decodeFrame` need not copy it). After an error the reader stays failed.
 */
export class FrameReader {
  readonly maxFrameBytes: number;
  private readonly prefix = new Uint8Array(LENGTH_PREFIX_BYTES);
  private prefixFill = 0;
  private frame: Uint8Array | undefined;
  private frameFill = 0;
  private failure: ProtocolError | undefined;

  constructor(options: FramingOptions = {}) {
    this.maxFrameBytes = maxFrameBytesOf(options);
  }

  /** Bytes received that belong to a frame not yet complete. */
  get bufferedBytes(): number {
    return this.frame ? LENGTH_PREFIX_BYTES + this.frameFill : this.prefixFill;
  }

  push(chunk: Uint8Array): Uint8Array[] {
    if (this.failure) throw this.failure;
    if (!(chunk instanceof Uint8Array)) {
      throw new InvalidArgumentError(
        "FrameReader needs binary chunks (Uint8Array/Buffer), not strings: do not set an encoding on the stream",
      );
    }
    const out: Uint8Array[] = [];
    let pos = 0;
    const end = chunk.byteLength;
    while (pos < end) {
      if (this.frame) {
        const take = Math.min(end - pos, this.frame.byteLength - this.frameFill);
        this.frame.set(chunk.subarray(pos, pos + take), this.frameFill);
        this.frameFill += take;
        pos += take;
        if (this.frameFill === this.frame.byteLength) {
          out.push(this.frame);
          this.frame = undefined;
          this.frameFill = 0;
        }
        continue;
      }
      let size: number;
      if (this.prefixFill === 0 && end - pos >= LENGTH_PREFIX_BYTES) {
        size = readU32(chunk, pos);
        pos += LENGTH_PREFIX_BYTES;
      } else {
        const take = Math.min(end - pos, LENGTH_PREFIX_BYTES - this.prefixFill);
        this.prefix.set(chunk.subarray(pos, pos + take), this.prefixFill);
        this.prefixFill += take;
        pos += take;
        if (this.prefixFill < LENGTH_PREFIX_BYTES) break;
        this.prefixFill = 0;
        size = readU32(this.prefix, 0);
      }
      if (size > this.maxFrameBytes) {
        this.failure = tooLarge(size, this.maxFrameBytes);
        throw this.failure;
      }
      if (end - pos >= size) {
        out.push(chunk.subarray(pos, pos + size));
        pos += size;
      } else {
        // place the payload so that its first large tensor starts 8-byte aligned: decodeFrame
        // then returns it as a view instead of copying it once more
        const at = size >= 256 ? firstLargeBinOffset(chunk.subarray(pos, Math.min(end, pos + 1024))) : -1;
        const shift = at < 0 ? 0 : (8 - (at % 8)) % 8;
        this.frame = frames.alloc(size + shift).subarray(shift);
        this.frameFill = 0;
      }
    }
    return out;
  }

  /** Declares the end of the stream; throws MOESWARM_PROTOCOL_TRUNCATED inside a frame. */
  end(): void {
    if (this.failure) throw this.failure;
    if (this.frame || this.prefixFill > 0) {
      const expected = this.frame ? LENGTH_PREFIX_BYTES + this.frame.byteLength : LENGTH_PREFIX_BYTES;
      this.failure = new ProtocolError(
        "MOESWARM_PROTOCOL_TRUNCATED",
        `stream ended after ${this.bufferedBytes} of ${expected} bytes of a frame`,
        { details: { received: this.bufferedBytes, expected } },
      );
      throw this.failure;
    }
  }
}

function readU32(bytes: Uint8Array, pos: number): number {
  return (bytes[pos]! | (bytes[pos + 1]! << 8) | (bytes[pos + 2]! << 16) | (bytes[pos + 3]! << 24)) >>> 0;
}

export interface ReadFramesOptions extends FramingOptions {
  signal?: AbortSignal;
}

/**
 * The payloads of the length-prefixed frames of a byte stream (a Node Readable or any async
 * iterable of byte chunks), in order. Decode each with `decodeFrame`: a bad payload does not
 * break the framing, so a peer can answer it with an `error` frame and read on. Throws
 * ProtocolError for an oversized length prefix (MOESWARM_PROTOCOL_FRAME_TOO_LARGE, before any
 * allocation) or a stream that ends inside a frame (MOESWARM_PROTOCOL_TRUNCATED). Aborting the
 * signal rejects with its reason. Ending the iteration early, by error or abort, ends the source
 * (a Node Readable is destroyed).
 */
export async function* readFrames(
  source: AsyncIterable<Uint8Array>,
  options: ReadFramesOptions = {},
): AsyncGenerator<Uint8Array, void, undefined> {
  const { signal } = options;
  const reader = new FrameReader(options);
  throwIfAborted(signal);
  const it = source[Symbol.asyncIterator]();
  let registration: Disposable | undefined;
  const aborted =
    signal &&
    new Promise<never>((_, reject) => {
      registration = onAbort(signal, reject);
    });
  // the race below observes it; this keeps an abort after the loop from being unhandled
  aborted?.catch(() => {});
  let done = false;
  let pending = false;
  try {
    for (;;) {
      const next = it.next();
      let result: IteratorResult<Uint8Array>;
      if (aborted) {
        next.catch(() => {});
        pending = true;
        result = await Promise.race([next, aborted]);
        pending = false;
      } else {
        result = await next;
      }
      if (result.done) {
        done = true;
        reader.end();
        return;
      }
      for (const payload of reader.push(result.value)) {
        throwIfAborted(signal);
        yield payload;
      }
    }
  } finally {
    registration?.[Symbol.dispose]();
    if (!done) {
      if (pending) {
        // an async generator (a Node Readable's iterator is one) queues return() behind the
        // pending next(), which may never settle: destroy a stream directly, don't wait
        (source as { destroy?: () => void }).destroy?.();
        Promise.resolve(it.return?.()).catch(() => {});
      } else {
        await it.return?.();
      }
    }
  }
}

export interface WriteFrameOptions extends FramingOptions {
  signal?: AbortSignal;
}

/**
 * Writes one frame (or an encoded payload) with its length prefix to a Node Writable and
 * resolves once the stream can take more: when `write` reports a full buffer it waits for
 * `drain`. Rejects with TransportError MOESWARM_TRANSPORT_CLOSED when the stream is closed or
 * fails first, and with the signal's reason when aborted (the frame itself was already handed to
 * the stream). Concurrent calls keep their order.
 */
export async function writeFrame(
  stream: Writable,
  input: Frame | Uint8Array,
  options: WriteFrameOptions = {},
): Promise<void> {
  const { signal } = options;
  throwIfAborted(signal);
  if (stream.destroyed || stream.writableEnded) {
    throw new TransportError("MOESWARM_TRANSPORT_CLOSED", "cannot write a frame: the stream is closed");
  }
  let ok: boolean;
  if (input instanceof Uint8Array) {
    const max = maxFrameBytesOf(options);
    if (input.byteLength > max) throw tooLarge(input.byteLength, max);
    const prefix = new Uint8Array(LENGTH_PREFIX_BYTES);
    new DataView(prefix.buffer).setUint32(0, input.byteLength, true);
    // two writes in one cork: one syscall (writev), no copy of the payload
    stream.cork();
    stream.write(prefix);
    ok = stream.write(input);
    stream.uncork();
  } else {
    ok = stream.write(encodeLengthPrefixed(input, options));
  }
  if (ok) return;
  await new Promise<void>((resolve, reject) => {
    const cleanup = () => {
      stream.off("drain", onDrain);
      stream.off("close", onClose);
      stream.off("error", onError);
      aborted[Symbol.dispose]();
    };
    const onDrain = () => {
      cleanup();
      resolve();
    };
    const onClose = () => {
      cleanup();
      reject(new TransportError("MOESWARM_TRANSPORT_CLOSED", "the stream closed before it drained"));
    };
    const onError = (cause: unknown) => {
      cleanup();
      reject(
        new TransportError("MOESWARM_TRANSPORT_CLOSED", "the stream failed before it drained", { cause }),
      );
    };
    stream.on("drain", onDrain);
    stream.on("close", onClose);
    stream.on("error", onError);
    const aborted = onAbort(signal, (reason) => {
      cleanup();
      reject(reason);
    });
  });
}

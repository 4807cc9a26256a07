import { PassThrough, Readable, Writable } from "node:stream";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  encodeLengthPrefixed,
  FrameReader,
  InvalidArgumentError,
  ProtocolError,
  pingFrame,
  readFrames,
  TransportError,
  writeFrame,
} from "../src/index.js";

const u32le = (n: number) => {
  const b = new Uint8Array(4);
  new DataView(b.buffer).setUint32(0, n, true);
  return b;
};
const concat = (parts: Uint8Array[]) => Uint8Array.from(parts.flatMap((p) => [...p]));

async function* chunksOf(parts: Uint8Array[]): AsyncGenerator<Uint8Array> {
  for (const p of parts) yield p;
}

async function collect(it: AsyncIterable<Uint8Array>): Promise<number[][]> {
  const out: number[][] = [];
  for await (const p of it) out.push([...p]);
  return out;
}

/** Splits `bytes` at the given cut points (sorted, deduplicated). */
function split(bytes: Uint8Array, cuts: number[]): Uint8Array[] {
  const points = [...new Set(cuts.map((c) => c % (bytes.length + 1)))].sort((a, b) => a - b);
  const parts: Uint8Array[] = [];
  let last = 0;
  for (const p of [...points, bytes.length]) {
    parts.push(bytes.subarray(last, p));
    last = p;
  }
  return parts;
}

describe("encodeLengthPrefixed", () => {
  it("prefixes the payload with its u32 little-endian length", () => {
    const payload = encodeFrame(pingFrame({ seq: 1, ts: 2 }));
    const framed = encodeLengthPrefixed(pingFrame({ seq: 1, ts: 2 }));
    expect([...framed.subarray(0, 4)]).toEqual([payload.length, 0, 0, 0]);
    expect([...framed.subarray(4)]).toEqual([...payload]);
    expect([...encodeLengthPrefixed(payload)]).toEqual([...framed]);
    const big = new Uint8Array(0x01020304 & 0xffff);
    expect([...encodeLengthPrefixed(big).subarray(0, 4)]).toEqual([0x04, 0x03, 0, 0]);
  });

  it("refuses payloads above maxFrameBytes", () => {
    expect(() => encodeLengthPrefixed(new Uint8Array(11), { maxFrameBytes: 10 })).toThrow(ProtocolError);
    expect(() => encodeLengthPrefixed(pingFrame({ seq: 1, ts: 2 }), { maxFrameBytes: 10 })).toThrow(
      ProtocolError,
    );
    expect(() => encodeLengthPrefixed(new Uint8Array(1), { maxFrameBytes: -1 })).toThrow(
      InvalidArgumentError,
    );
  });
});

describe("FrameReader", () => {
  it("reassembles frames across any chunking (property)", () => {
    fc.assert(
      fc.property(
        fc.array(fc.uint8Array({ maxLength: 70 }), { maxLength: 8 }),
        fc.array(fc.nat(), { maxLength: 12 }),
        (payloads, cuts) => {
          const stream = concat(payloads.map((p) => encodeLengthPrefixed(p)));
          const reader = new FrameReader({ maxFrameBytes: 1000 });
          const got: number[][] = [];
          for (const chunk of split(stream, cuts)) for (const p of reader.push(chunk)) got.push([...p]);
          reader.end();
          expect(got).toEqual(payloads.map((p) => [...p]));
          expect(reader.bufferedBytes).toBe(0);
        },
      ),
      { numRuns: 1000 },
    );
  });

  it("returns a payload inside one chunk as a view, and copies one split across chunks", () => {
    const a = encodeLengthPrefixed(Uint8Array.of(1, 2, 3));
    const chunk = concat([a, a]);
    const reader = new FrameReader();
    const [p1, p2] = reader.push(chunk);
    expect(p1!.buffer).toBe(chunk.buffer);
    expect(p2!.byteOffset).toBe(chunk.byteOffset + 11);
    const [q] = [...reader.push(a.subarray(0, 5)), ...reader.push(a.subarray(5))];
    expect([...q!]).toEqual([1, 2, 3]);
    expect(q!.buffer).not.toBe(a.buffer);
  });

  it("places a frame split across chunks so that its main tensor decodes as a view", () => {
    const n = 8;
    const frame = dispatchFrame({
      id: 1,
      model: "qwen3-30b-a3b",
      layer: 2,
      n,
      embd: 100,
      dtype: "f32",
      x: new Float32Array(n * 100).map((_, i) => i),
      k: 2,
      ids: new Int32Array(n * 2),
      mode: "each",
    });
    const stream = encodeLengthPrefixed(frame);
    for (const first of [3, 4, 10, 37, 64, 200, 1000]) {
      const reader = new FrameReader();
      const got = [
        ...reader.push(stream.subarray(0, first)),
        ...reader.push(stream.subarray(first, first + 999)),
        ...reader.push(stream.subarray(first + 999)),
      ];
      expect(got.length).toBe(1);
      const decoded = decodeFrame(got[0]!) as typeof frame;
      expect(Array.from(decoded.x)).toEqual(Array.from(frame.x));
      // once the chunk that starts the payload holds the header up to x, x needs no copy
      if (first >= 80) expect(decoded.x.buffer === got[0]!.buffer, `first chunk ${first}`).toBe(true);
    }
  });

  it("rejects an oversized length prefix before allocating, even before the payload arrives", () => {
    const reader = new FrameReader({ maxFrameBytes: 100 });
    expect(reader.push(u32le(100).subarray(0, 2))).toEqual([]);
    const ok = reader.push(Uint8Array.from([...u32le(100).subarray(2), ...new Uint8Array(100)]));
    expect(ok.length).toBe(1);
    let error: unknown;
    try {
      reader.push(u32le(0xffffffff)); // 4 GiB: would fail if allocated
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(ProtocolError);
    expect((error as ProtocolError).code).toBe("MOESWARM_PROTOCOL_FRAME_TOO_LARGE");
    expect((error as ProtocolError).details).toMatchObject({ size: 0xffffffff, max: 100 });
    // the reader stays failed: the stream cannot be resynchronised
    expect(() => reader.push(u32le(1))).toThrow(ProtocolError);
  });

  it("reports a stream that ends inside a frame", () => {
    for (const cut of [1, 3, 4, 6]) {
      const reader = new FrameReader();
      reader.push(encodeLengthPrefixed(Uint8Array.of(1, 2, 3)).subarray(0, cut));
      let error: unknown;
      try {
        reader.end();
      } catch (e) {
        error = e;
      }
      expect((error as ProtocolError).code, `cut ${cut}`).toBe("MOESWARM_PROTOCOL_TRUNCATED");
    }
    const whole = new FrameReader();
    whole.push(encodeLengthPrefixed(new Uint8Array(0)));
    expect(() => whole.end()).not.toThrow();
  });

  it("refuses string chunks", () => {
    expect(() => new FrameReader().push("abc" as unknown as Uint8Array)).toThrow(InvalidArgumentError);
  });
});

describe("readFrames", () => {
  it("yields payloads from a Node Readable in order", async () => {
    const frames = [pingFrame({ seq: 1, ts: 1 }), pingFrame({ seq: 2, ts: 2.5 })];
    const stream = concat(frames.map((f) => encodeLengthPrefixed(f)));
    const readable = Readable.from(split(stream, [1, 2, 7, 20, 33]).map((c) => Buffer.from(c)));
    const got = [];
    for await (const payload of readFrames(readable)) got.push(decodeFrame(payload));
    expect(got).toEqual(frames);
  });

  it("reassembles over random chunkings of an async iterable (property)", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.uint8Array({ maxLength: 40 }), { maxLength: 6 }),
        fc.array(fc.nat(), { maxLength: 10 }),
        async (payloads, cuts) => {
          const stream = concat(payloads.map((p) => encodeLengthPrefixed(p)));
          expect(await collect(readFrames(chunksOf(split(stream, cuts))))).toEqual(
            payloads.map((p) => [...p]),
          );
        },
      ),
      { numRuns: 300 },
    );
  });

  it("throws TRUNCATED at the end of a stream cut inside a frame, after the complete frames", async () => {
    const stream = concat([
      encodeLengthPrefixed(Uint8Array.of(9)),
      encodeLengthPrefixed(Uint8Array.of(1, 2)),
    ]);
    const got: number[][] = [];
    await expect(
      (async () => {
        for await (const p of readFrames(chunksOf([stream.subarray(0, stream.length - 1)]))) got.push([...p]);
      })(),
    ).rejects.toMatchObject({ code: "MOESWARM_PROTOCOL_TRUNCATED" });
    expect(got).toEqual([[9]]);
  });

  it("throws FRAME_TOO_LARGE and destroys the source", async () => {
    const source = new PassThrough();
    source.write(u32le(1 << 20));
    await expect(collect(readFrames(source, { maxFrameBytes: 1000 }))).rejects.toMatchObject({
      code: "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
    });
    expect(source.destroyed).toBe(true);
  });

  it("rejects at once when the signal is already aborted", async () => {
    const reason = new Error("stop");
    const it = readFrames(chunksOf([]), { signal: AbortSignal.abort(reason) });
    await expect(it.next()).rejects.toBe(reason);
  });

  it("rejects with the signal's reason when aborted while waiting, and cleans up", async () => {
    const source = new PassThrough();
    const controller = new AbortController();
    const reason = new Error("bye");
    let added = 0;
    let removed = 0;
    const signal = controller.signal;
    const add = signal.addEventListener.bind(signal);
    const remove = signal.removeEventListener.bind(signal);
    signal.addEventListener = ((...args: Parameters<typeof add>) => {
      added++;
      add(...args);
    }) as typeof signal.addEventListener;
    signal.removeEventListener = ((...args: Parameters<typeof remove>) => {
      removed++;
      remove(...args);
    }) as typeof signal.removeEventListener;
    const it = readFrames(source, { signal });
    source.write(encodeLengthPrefixed(Uint8Array.of(5)));
    expect([...(await it.next()).value!]).toEqual([5]);
    const pending = it.next();
    setTimeout(() => controller.abort(reason), 5);
    await expect(pending).rejects.toBe(reason);
    expect(added).toBe(1);
    expect(removed).toBe(1);
    expect(source.destroyed).toBe(true);
  });

  it("does not hang on abort when a generic source never answers", async () => {
    const never: AsyncIterable<Uint8Array> = {
      [Symbol.asyncIterator]: () => ({ next: () => new Promise<IteratorResult<Uint8Array>>(() => {}) }),
    };
    const controller = new AbortController();
    const reason = new Error("gone");
    const pending = readFrames(never, { signal: controller.signal }).next();
    controller.abort(reason);
    await expect(pending).rejects.toBe(reason);
  });

  it("leaves no listener behind when the consumer stops early", async () => {
    const controller = new AbortController();
    const stream = concat([1, 2, 3].map((n) => encodeLengthPrefixed(Uint8Array.of(n))));
    for await (const p of readFrames(chunksOf([stream]), { signal: controller.signal })) {
      expect([...p]).toEqual([1]);
      break;
    }
    // aborting afterwards must not surface as an unhandled rejection
    controller.abort(new Error("late"));
    await new Promise((r) => setTimeout(r, 5));
  });
});

describe("writeFrame", () => {
  /** A writable that accepts `highWaterMark` bytes, then holds everything until released. */
  function slowSink(highWaterMark: number) {
    const received: Buffer[] = [];
    let release: (() => void) | undefined;
    const sink = new Writable({
      highWaterMark,
      write(chunk: Buffer, _enc, cb) {
        received.push(chunk);
        release = cb;
      },
    });
    return { sink, received, release: () => release?.() };
  }

  it("writes prefix and payload, and waits for drain when the buffer is full", async () => {
    const { sink, received, release } = slowSink(16);
    let resolved = false;
    const p = writeFrame(sink, new Uint8Array(100).fill(7)).then(() => {
      resolved = true;
    });
    await new Promise((r) => setTimeout(r, 10));
    expect(resolved).toBe(false);
    // release the writes one by one until the sink drains
    for (let i = 0; i < 4 && !resolved; i++) {
      release();
      await new Promise((r) => setTimeout(r, 5));
    }
    await p;
    expect(resolved).toBe(true);
    const all = Buffer.concat(received);
    expect([...all.subarray(0, 4)]).toEqual([100, 0, 0, 0]);
    expect(all.length).toBe(104);
    expect(sink.listenerCount("drain")).toBe(0);
    expect(sink.listenerCount("close")).toBe(0);
  });

  it("writes frames that a FrameReader reads back, in order", async () => {
    const sink = new PassThrough();
    const frames = Array.from({ length: 5 }, (_, i) => pingFrame({ seq: i, ts: i / 2 }));
    await Promise.all(frames.map((f) => writeFrame(sink, f)));
    sink.end();
    const got = [];
    for await (const p of readFrames(sink)) got.push(decodeFrame(p));
    expect(got).toEqual(frames);
  });

  it("rejects with TransportError when the stream closes before draining, and on a closed stream", async () => {
    const { sink } = slowSink(4);
    const p = writeFrame(sink, new Uint8Array(64));
    sink.destroy();
    await expect(p).rejects.toBeInstanceOf(TransportError);
    await expect(writeFrame(sink, new Uint8Array(1))).rejects.toMatchObject({
      code: "MOESWARM_TRANSPORT_CLOSED",
    });
  });

  it("honours AbortSignal: already aborted, and aborted while waiting for drain", async () => {
    const { sink } = slowSink(4);
    const reason = new Error("abort");
    await expect(writeFrame(sink, new Uint8Array(1), { signal: AbortSignal.abort(reason) })).rejects.toBe(
      reason,
    );
    const controller = new AbortController();
    const p = writeFrame(sink, new Uint8Array(64), { signal: controller.signal });
    controller.abort(reason);
    await expect(p).rejects.toBe(reason);
    expect(sink.listenerCount("drain")).toBe(0);
  });
});

import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  type DispatchFrame,
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  errorFrame,
  FrameEncoder,
  InvalidArgumentError,
  ProtocolError,
  type ResultFrame,
  resultFrame,
} from "../src/index.js";
import { hex, msgpackHex } from "./codec-helpers.js";

// The writer of frames with tensors (codec-write.ts) against @msgpack/msgpack, an independent
// encoder, at the boundaries of every header it chooses: ints at each width's edges, non-integer
// and large numbers, strings at the fixstr/str8/str16 edges in ASCII and multi-byte UTF-8. And
// the caches of decoding and validation (the last accepted string per field): a different
// string of the same length, or an invalid one, must never pass for the cached one.

const EDGES = [
  0,
  1,
  0x7f,
  0x80,
  0xff,
  0x100,
  0xffff,
  0x1_0000,
  0xffff_ffff,
  0x1_0000_0000,
  2 ** 40 + 3,
  Number.MAX_SAFE_INTEGER,
];
const uintEdge = (max: number) =>
  fc.oneof(fc.constantFrom(...EDGES.filter((e) => e <= max)), fc.integer({ min: 0, max }));
const msValue = fc.oneof(
  fc.constantFrom(...EDGES, -0, 0.5, 1e300, 2 ** 53, 2 ** 64, Number.MIN_VALUE),
  fc.double({ min: 0, noNaN: true, noDefaultInfinity: true }),
);
// ASCII and multi-byte strings around the header edges (31/32 and 255/256 bytes)
const text = (minBytes: number, maxBytes: number) =>
  fc
    .tuple(
      fc.constantFrom(1, 30, 31, 32, 33, 85, 254, 255, 256, 257),
      fc.constantFrom("a", "é", "€", "😀", "-"),
    )
    .map(([n, unit]) => {
      let s = "";
      while (Buffer.byteLength(s + unit) <= n) s += unit;
      return s.length === 0 ? "m" : s;
    })
    .filter((s) => Buffer.byteLength(s) >= minBytes && Buffer.byteLength(s) <= maxBytes);

const dispatches = fc
  .record({
    id: uintEdge(0xffff_ffff),
    to: fc.option(text(1, 128), { nil: undefined }),
    model: text(1, 256),
    layer: uintEdge(65535),
    n: fc.integer({ min: 1, max: 3 }),
    embd: fc.constantFrom(1, 15, 16, 17, 64),
    k: fc.integer({ min: 1, max: 3 }),
    deadline: fc.option(uintEdge(0xffff_ffff), { nil: undefined }),
    compact: fc.option(fc.boolean(), { nil: undefined }),
  })
  .map(({ n, embd, k, compact, ...rest }) =>
    dispatchFrame({
      ...rest,
      n,
      embd,
      k,
      dtype: "f32",
      x: Float32Array.from({ length: n * embd }, (_, i) => i - 0.5),
      ids: Int32Array.from({ length: n * k }, (_, i) => (i % 3) - 1),
      mode: "each",
      ...(compact === undefined ? {} : { compact }),
    }),
  );

const results = fc
  .record({
    id: uintEdge(0xffff_ffff),
    from: fc.option(text(1, 128), { nil: undefined }),
    n: fc.integer({ min: 1, max: 3 }),
    embd: fc.constantFrom(1, 8, 16, 40),
    ms: fc.option(msValue, { nil: undefined }),
  })
  .map(({ n, embd, ms, ...rest }) =>
    resultFrame({
      ...rest,
      mode: "sum",
      n,
      k: 2,
      embd,
      y: Float32Array.from({ length: n * embd }, (_, i) => i * 0.25),
      ...(ms === undefined ? {} : { ms }),
    }),
  );

describe("the writer of frames with tensors", () => {
  it("writes what @msgpack/msgpack writes at every header edge, fresh and through a reused encoder", () => {
    const encoder = new FrameEncoder();
    fc.assert(
      fc.property(fc.oneof(dispatches, results), (frame) => {
        const expected = msgpackHex(frame);
        expect(hex(encodeFrame(frame))).toBe(expected);
        expect(encoder.encode(frame, hex)).toBe(expected);
        const back = decodeFrame(encodeFrame(frame));
        expect(back).toEqual({ ...frame, ...("ms" in frame && Object.is(frame.ms, -0) ? { ms: 0 } : {}) });
      }),
      { numRuns: 400 },
    );
  });

  it("aligns the main tensor to 8 bytes in memory whatever the strings before it", () => {
    fc.assert(
      fc.property(dispatches, (frame) => {
        const bytes = encodeFrame(frame);
        const x = (decodeFrame(bytes) as DispatchFrame).x;
        if (x.byteLength >= 64) {
          expect(x.buffer).toBe(bytes.buffer);
          expect(x.byteOffset % 8).toBe(0);
        }
      }),
      { numRuns: 100 },
    );
  });
});

describe("the last-string caches", () => {
  const frame = (model: string, to = "w1") =>
    dispatchFrame({
      id: 1,
      to,
      model,
      layer: 0,
      n: 1,
      embd: 2,
      dtype: "f32",
      x: new Float32Array(2),
      k: 1,
      ids: new Int32Array(1),
      mode: "each",
    });

  it("decodes each frame's own strings, however alike the last one's", () => {
    for (const model of ["model-a", "model-b", "model-a", "Model-a", "model-a "]) {
      expect((decodeFrame(encodeFrame(frame(model))) as DispatchFrame).model).toBe(model);
    }
    // the same string under another field is that field's
    const a = decodeFrame(encodeFrame(frame("same", "same"))) as DispatchFrame;
    expect([a.model, a.to]).toEqual(["same", "same"]);
  });

  it("reads each frame's strings from its own bytes when a Buffer is reused or rewritten in place", () => {
    // what is remembered must be a copy: a Buffer's slice() is a view, which a reused Buffer (or
    // one the relay reroutes in place) would change under it, answering the older frame's string
    const first = encodeFrame(frame("model-a", "worker-a"));
    const second = encodeFrame(frame("model-b", "worker-b"));
    expect(second.byteLength).toBe(first.byteLength);
    const memory = Buffer.from(first);
    expect(decodeFrame(memory)).toMatchObject({ model: "model-a", to: "worker-a" });
    memory.set(second);
    expect(decodeFrame(memory)).toMatchObject({ model: "model-b", to: "worker-b" });
    const error = (code: string) => encodeFrame(errorFrame({ id: 1, code, msg: "m" }));
    const errors = Buffer.from(error("MOESWARM_X_AAAA"));
    expect(decodeFrame(errors)).toMatchObject({ code: "MOESWARM_X_AAAA" });
    errors.set(error("MOESWARM_X_BBBB"));
    expect(decodeFrame(errors)).toMatchObject({ code: "MOESWARM_X_BBBB" });
  });

  it("still refuses what the rules refuse after the same field accepted a string", () => {
    const ok = encodeFrame(frame("m")) as Uint8Array;
    decodeFrame(ok);
    // a mode outside its oneOf, written with the accepted mode's header length
    const bytes = Buffer.from(ok);
    const at = bytes.indexOf(Buffer.from("a46d6f6465a465616368", "hex"));
    expect(at).toBeGreaterThan(0);
    bytes.write("eaxh", at + 6, "latin1");
    expect(() => decodeFrame(bytes)).toThrow(ProtocolError);
    decodeFrame(ok);
    expect(() => decodeFrame(bytes)).toThrow(ProtocolError);
    // validation: a valid peer id accepted, then an invalid one (a lone surrogate) in its place
    encodeFrame(frame("m", "peer"));
    expect(() => encodeFrame(frame("m", "\uD800"))).toThrow(InvalidArgumentError);
    expect(() => encodeFrame(frame("x".repeat(257)))).toThrow(InvalidArgumentError);
    encodeFrame(frame("x".repeat(256)));
    expect(() => encodeFrame(frame("x".repeat(257)))).toThrow(InvalidArgumentError);
  });

  it("leaves the writer ready for the next frame after refusing one too large", () => {
    const big = resultFrame({ id: 1, mode: "sum", n: 1, k: 1, embd: 64, y: new Float32Array(64) });
    expect(() => encodeFrame(big, { maxFrameBytes: 100 })).toThrow(/maximum/);
    const small: ResultFrame = resultFrame({
      id: 2,
      mode: "sum",
      n: 1,
      k: 1,
      embd: 1,
      y: Float32Array.of(3),
    });
    expect((decodeFrame(encodeFrame(small)) as ResultFrame).y).toEqual(Float32Array.of(3));
  });
});

describe("a result's y written in place", () => {
  const header = (embd: number, n = 2) =>
    ({ t: "result", v: 1, id: 9, to: "bb", mode: "sum", n, k: 2, embd, ms: 1.5 }) as const;
  const yOf = (values: number, seed: number) =>
    Float32Array.from({ length: values }, (_, i) => seed + i * 0.5);

  it("gives encodeFrame's bytes for the computed y, fresh and in reused memory that held other frames", () => {
    const encoder = new FrameEncoder();
    for (const [embd, seed] of [
      [64, 1],
      [3, 2],
      [1000, 3],
      [5, 4],
      [64, 5],
    ] as const) {
      const y = yOf(2 * embd, seed);
      const expected = hex(encodeFrame(resultFrame({ ...header(embd), y })));
      let seen: Float32Array | undefined;
      const fill = (view: Float32Array) => {
        seen = view;
        view.set(y);
      };
      expect(hex(encodeFrame({ ...header(embd), y: { values: y.length, fill } }))).toBe(expected);
      expect(seen!.length).toBe(y.length);
      expect(seen!.byteOffset % 8).toBe(0);
      expect(encoder.encode({ ...header(embd), y: { values: y.length, fill } }, hex)).toBe(expected);
      // a larger frame between: the memory holds its bytes where the next y goes
      encoder.encode(resultFrame({ ...header(2048), y: yOf(4096, 99) }), hex);
    }
  });

  it("is refused like the frame it stands for, and a fill that throws fails the encoding", () => {
    const encoder = new FrameEncoder();
    const never = () => {
      throw new Error("fill must not be called for a refused frame");
    };
    // sum mode: y is n*embd values
    expect(() => encodeFrame({ ...header(4), y: { values: 7, fill: never } })).toThrow(InvalidArgumentError);
    expect(() => encodeFrame({ ...header(4), y: { values: -1, fill: never } })).toThrow(InvalidArgumentError);
    expect(() =>
      encodeFrame({ ...header(64), y: { values: 128, fill: never } }, { maxFrameBytes: 100 }),
    ).toThrow(/maximum/);
    const boom = new Error("compute failed");
    expect(() =>
      encoder.encode(
        {
          ...header(4),
          y: {
            values: 8,
            fill: () => {
              throw boom;
            },
          },
        },
        hex,
      ),
    ).toThrow(boom);
    const y = yOf(8, 7);
    expect(encoder.encode(resultFrame({ ...header(4), y }), hex)).toBe(
      hex(encodeFrame(resultFrame({ ...header(4), y }))),
    );
  });

  it("never lends the memory being filled to an encode from inside fill", () => {
    const encoder = new FrameEncoder();
    const y = yOf(128, 3);
    const inner = yOf(128, 50);
    const bytes = encoder.encode(
      {
        ...header(64),
        y: {
          values: 128,
          fill: (view: Float32Array) => {
            view.set(y);
            // a nested send while the outer frame is being filled
            encoder.encode(resultFrame({ ...header(64), y: inner }), (b) => b[0]);
          },
        },
      },
      hex,
    );
    expect(bytes).toBe(hex(encodeFrame(resultFrame({ ...header(64), y }))));
  });
});

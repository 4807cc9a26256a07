import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  decodeFrame,
  encodeFrame,
  FrameEncoder,
  InvalidArgumentError,
  type ResultFrame,
  resultFrame,
} from "../src/index.js";

// A result whose y is computed by its fill, which returns the compute's time: the frame then
// carries that time as its `ms` (written after y, in the 9 bytes held for it, then shortened to its
// canonical form). The bytes must be exactly those of the frame with an array y and that ms, as
// the worker sent before (encodeFrame of a plain result frame, itself checked against
// @msgpack/msgpack in codec-write.test.ts), fresh and in reused memory, with `compact` after it.

const hex = (b: Uint8Array) => Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString("hex");
const yOf = (values: number, seed: number) =>
  Float32Array.from({ length: values }, (_, i) => seed + i * 0.25);

// every canonical width an ms can take: fixint, uint8, uint16, uint32, uint64 and float64
const MS_EDGES = [
  0,
  -0,
  1,
  0x7f,
  0x80,
  0xff,
  0x100,
  0xffff,
  0x1_0000,
  0xffff_ffff,
  0x1_0000_0000,
  2 ** 53 - 1,
];
const MS_FLOATS = [0.5, 1e-300, 0.0123, 1.5, 2 ** 53, 1e300, Number.MIN_VALUE];

function header(mode: "each" | "sum", embd: number, compact: boolean) {
  return {
    t: "result",
    v: 1,
    id: 77,
    to: "backbone-1",
    mode,
    n: 2,
    k: 2,
    embd,
    ...(compact ? { compact: true } : {}),
  } as const;
}

describe("an in-place y whose fill returns the frame's ms", () => {
  const encoder = new FrameEncoder();

  function check(ms: number, mode: "each" | "sum", embd: number, compact: boolean): void {
    const values = (mode === "each" ? 4 : 2) * embd;
    const y = yOf(values, ms % 7);
    const expected = hex(encodeFrame(resultFrame({ ...header(mode, embd, compact), y, ms })));
    const fill = (view: Float32Array) => {
      view.set(y);
      return ms;
    };
    const frame = { ...header(mode, embd, compact), y: { values, fill } };
    expect(hex(encodeFrame(frame)), `ms ${ms} ${mode} embd ${embd} compact ${compact}`).toBe(expected);
    expect(encoder.encode(frame, hex)).toBe(expected);
    // and a frame in the reused memory after it starts clean
    encoder.encode(resultFrame({ ...header("sum", 512, false), y: yOf(1024, 3), ms: 1.25 }), hex);
  }

  it("gives the bytes of the frame with that ms, at every width of its canonical form", () => {
    for (const ms of [...MS_EDGES, ...MS_FLOATS]) {
      for (const [mode, embd, compact] of [
        ["sum", 64, false],
        ["each", 3, true],
        ["each", 1000, false],
      ] as const) {
        check(ms, mode, embd, compact);
      }
    }
  });

  it("for any ms >= 0 (property)", () => {
    fc.assert(
      fc.property(
        fc.oneof(fc.double({ min: 0, max: 1e6, noNaN: true }), fc.nat(), fc.maxSafeNat()),
        fc.constantFrom("each" as const, "sum" as const),
        fc.integer({ min: 1, max: 80 }),
        fc.boolean(),
        // (compact answers are mode "each" only)
        (ms, mode, embd, compact) => check(ms, mode, embd, compact && mode === "each"),
      ),
      { numRuns: 300 },
    );
  });

  it("decodes to the computed y and the ms fill returned", () => {
    const y = yOf(128, 1);
    const bytes = encodeFrame({
      ...header("sum", 64, false),
      y: {
        values: 128,
        fill: (view: Float32Array) => {
          view.set(y);
          return 0.731;
        },
      },
    });
    const frame = decodeFrame(bytes) as ResultFrame;
    expect(frame.ms).toBe(0.731);
    expect(frame.y).toEqual(y);
    expect(frame.compact).toBeUndefined();
  });

  it("without a number from fill the frame has no ms; an ms given wins over fill's", () => {
    for (const compact of [false, true]) {
      const y = yOf(4 * 8, 2);
      const plain = hex(encodeFrame(resultFrame({ ...header("each", 8, compact), y })));
      const fill = (view: Float32Array) => {
        view.set(y);
      };
      expect(hex(encodeFrame({ ...header("each", 8, compact), y: { values: y.length, fill } }))).toBe(plain);
      expect(encoder.encode({ ...header("each", 8, compact), y: { values: y.length, fill } }, hex)).toBe(
        plain,
      );
      const given = hex(encodeFrame(resultFrame({ ...header("each", 8, compact), y, ms: 4.5 })));
      const timed = (view: Float32Array) => {
        view.set(y);
        return 99;
      };
      expect(
        hex(encodeFrame({ ...header("each", 8, compact), ms: 4.5, y: { values: y.length, fill: timed } })),
      ).toBe(given);
    }
  });

  it("refuses an ms that is negative or not finite, after the fill (its error is the answer)", () => {
    for (const ms of [-1, Number.NaN, Number.POSITIVE_INFINITY]) {
      const fill = (view: Float32Array) => {
        view.fill(1);
        return ms;
      };
      expect(() => encodeFrame({ ...header("sum", 4, false), y: { values: 8, fill } })).toThrow(
        InvalidArgumentError,
      );
      expect(() => encoder.encode({ ...header("sum", 4, false), y: { values: 8, fill } }, hex)).toThrow(
        InvalidArgumentError,
      );
    }
    // the encoder is still usable after a refused fill
    const y = yOf(8, 5);
    expect(encoder.encode(resultFrame({ ...header("sum", 4, false), y, ms: 2 }), hex)).toBe(
      hex(encodeFrame(resultFrame({ ...header("sum", 4, false), y, ms: 2 }))),
    );
  });
});

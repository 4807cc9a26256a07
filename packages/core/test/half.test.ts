import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  bf16BitsToF32,
  decodeBf16,
  decodeF16,
  encodeBf16,
  encodeF16,
  f16BitsToF32,
  f32ToBf16Bits,
  f32ToF16Bits,
} from "../src/index.js";

// Known bit patterns (IEEE 754-2008 binary16), values as exact JS numbers.
const F16_TABLE: Array<[number, number]> = [
  [0, 0x0000],
  [-0, 0x8000],
  [1, 0x3c00],
  [-2, 0xc000],
  [0.5, 0x3800],
  [65504, 0x7bff], // max normal
  [2 ** -14, 0x0400], // min normal
  [2 ** -24, 0x0001], // min subnormal
  [2 ** -14 - 2 ** -24, 0x03ff], // max subnormal
  [1 / 3, 0x3555],
  [Number.POSITIVE_INFINITY, 0x7c00],
  [Number.NEGATIVE_INFINITY, 0xfc00],
  [65520, 0x7c00], // rounds up to infinity (halfway to the next binade, even rounds up)
  [65519, 0x7bff],
  [1 + 2 ** -11, 0x3c00], // tie -> even (down)
  [1 + 3 * 2 ** -11, 0x3c02], // tie -> even (up)
  [2 ** -25, 0x0000], // tie between 0 and min subnormal -> even (0)
  [2 ** -25 + 2 ** -40, 0x0001],
  [3 * 2 ** -25, 0x0002], // tie between subnormals 1 and 2 -> even (2)
  [1e-10, 0x0000],
];

describe("f16", () => {
  it.each(F16_TABLE)("encodes %s as 0x%s", (value, bits) => {
    expect(f32ToF16Bits(value)).toBe(bits);
  });

  it("NaN becomes ggml's canonical quiet NaN with the sign", () => {
    expect(f32ToF16Bits(Number.NaN)).toBe(0x7e00);
    expect(Number.isNaN(f16BitsToF32(0x7e00))).toBe(true);
    expect(Number.isNaN(f16BitsToF32(0x7c01))).toBe(true);
  });

  it("decodes every finite pattern exactly and re-encodes it to the same bits", () => {
    for (let h = 0; h < 65536; h++) {
      const v = f16BitsToF32(h);
      if (Number.isNaN(v)) continue;
      expect(f32ToF16Bits(v)).toBe(h);
    }
    expect(f16BitsToF32(0x3555)).toBe(0.333251953125);
    expect(Object.is(f16BitsToF32(0x8000), -0)).toBe(true);
  });

  it("rounds to the nearest representable value (the error is at most half an ulp)", () => {
    fc.assert(
      fc.property(fc.float({ min: -65000, max: 65000, noNaN: true }), (x) => {
        const h = f32ToF16Bits(x);
        const y = f16BitsToF32(h);
        const up = f16BitsToF32(h + 1);
        const down = f16BitsToF32(h === 0 ? 0 : h - 1);
        if (Number.isFinite(up)) expect(Math.abs(x - y)).toBeLessThanOrEqual(Math.abs(x - up));
        if ((h & 0x7fff) !== 0) expect(Math.abs(x - y)).toBeLessThanOrEqual(Math.abs(x - down));
      }),
    );
  });

  it("array helpers match the scalar ones", () => {
    const xs = Float32Array.from([1, -2.5, 1e-6, 70000, 2.5]);
    const bits = encodeF16(xs);
    expect([...bits]).toEqual([...xs].map(f32ToF16Bits));
    expect([...decodeF16(bits)]).toEqual([...bits].map(f16BitsToF32));
  });
});

describe("bf16", () => {
  it.each([
    [1, 0x3f80],
    [-1, 0xbf80],
    [0, 0],
    [-0, 0x8000],
    [3.140625, 0x4049],
    [1 + 2 ** -8, 0x3f80], // tie -> even (down)
    [1 + 3 * 2 ** -8, 0x3f82], // tie -> even (up)
    [Number.POSITIVE_INFINITY, 0x7f80],
    [3.4028234663852886e38, 0x7f80], // f32 max rounds to infinity
    [1e-40, 0x0001], // f32 subnormal kept (ggml does not flush)
  ])("encodes %s as %s", (value, bits) => {
    expect(f32ToBf16Bits(value)).toBe(bits);
  });

  it("NaN keeps its top bits and is forced quiet", () => {
    expect(f32ToBf16Bits(Number.NaN)).toBe(0x7fc0);
    expect(Number.isNaN(bf16BitsToF32(0x7fc0))).toBe(true);
  });

  it("round-trips every non-NaN pattern", () => {
    for (let h = 0; h < 65536; h++) {
      const v = bf16BitsToF32(h);
      if (Number.isNaN(v)) continue;
      expect(f32ToBf16Bits(v)).toBe(h);
    }
    const bits = encodeBf16([1.5, -7, 1e30]);
    expect([...decodeBf16(bits)]).toEqual([...bits].map(bf16BitsToF32));
  });
});

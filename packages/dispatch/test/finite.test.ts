import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { nonFinite } from "../src/accept.js";

// The acceptance step's finite check (four branch-free sums, then a search of a bad row) against
// the plain definition: the first index in the range whose value is NaN or ±Infinity.

function naive(y: Float32Array | Float64Array, from: number, count: number): number {
  for (let i = from; i < from + count; i++) if (!Number.isFinite(y[i]!)) return i;
  return -1;
}

const value = fc.oneof(
  { weight: 8, arbitrary: fc.float({ noNaN: true, noDefaultInfinity: true }) },
  {
    weight: 1,
    arbitrary: fc.constantFrom(
      Number.NaN,
      Number.POSITIVE_INFINITY,
      Number.NEGATIVE_INFINITY,
      -0,
      3.4028234663852886e38,
    ),
  },
);

describe("nonFinite", () => {
  it("finds the first NaN or ±Infinity of the range, and nothing outside it", () => {
    fc.assert(
      fc.property(
        fc.array(value, { maxLength: 40 }),
        fc.nat(40),
        fc.nat(40),
        fc.boolean(),
        (values, a, b, f64) => {
          const y = f64 ? Float64Array.from(values) : Float32Array.from(values);
          const from = Math.min(a, y.length);
          const count = Math.min(b, y.length - from);
          expect(nonFinite(y, from, count)).toBe(naive(y, from, count));
        },
      ),
      { numRuns: 2000 },
    );
  });

  it("is not fooled by finite values whose sum overflows", () => {
    const y = Float32Array.from([3e38, 3e38, 3e38, 3e38, 3e38]);
    expect(nonFinite(y, 0, y.length)).toBe(-1);
    y[4] = Number.NEGATIVE_INFINITY;
    expect(nonFinite(y, 0, 5)).toBe(4);
    expect(nonFinite(y, 0, 4)).toBe(-1);
  });
});

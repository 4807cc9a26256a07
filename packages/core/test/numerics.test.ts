import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { cosine, InvalidArgumentError, isMoeswarmError, maxAbsDiff, relL2 } from "../src/index.js";

describe("numerics", () => {
  it("computes known values", () => {
    expect(cosine([1, 0], [0, 1])).toBe(0);
    expect(cosine([1, 2, 3], [2, 4, 6])).toBe(1);
    expect(cosine([1, 2], [-1, -2])).toBeCloseTo(-1, 15);
    expect(cosine([3, 4], [4, 3])).toBeCloseTo(24 / 25, 15);
    expect(maxAbsDiff([1, 2, 3], [1, 2.5, 1])).toBe(2);
    expect(relL2([3, 4], [0, 0]) === Number.POSITIVE_INFINITY).toBe(true);
    expect(relL2([1, 1], [1, 1])).toBe(0);
    expect(relL2([4, 0], [3, 4])).toBeCloseTo(Math.sqrt(1 + 16) / 5, 15);
  });

  it("accumulates in f64 even for f32 inputs", () => {
    // 2^24 + 1 is not an f32; an f32 accumulator would lose the 1s
    const a = new Float32Array(1 + 1000).fill(1);
    a[0] = 2 ** 12;
    const b = new Float32Array(a.length).fill(0);
    b[0] = 2 ** 12;
    const b2 = Float32Array.from(b);
    b2[1] = 1;
    expect(relL2(a, b)).toBeCloseTo(Math.sqrt(1000) / 2 ** 12, 14);
    expect(maxAbsDiff(a, b2)).toBe(1);
  });

  it("does not overflow for huge f64 values", () => {
    const big = [1e300, -1e300, 1e300];
    expect(cosine(big, big)).toBe(1);
    expect(relL2(big, big)).toBe(0);
    expect(relL2([2e300, 0], [1e300, 0])).toBeCloseTo(1, 14);
    expect(cosine([1e-300, 0], [1e-300, 1e-300])).toBeCloseTo(Math.SQRT1_2, 14);
  });

  it("matches an f64 oracle on random vectors (property)", () => {
    fc.assert(
      fc.property(
        fc.array(
          fc.tuple(
            fc.float({ noNaN: true, noDefaultInfinity: true, min: -1e6, max: 1e6 }),
            fc.float({ noNaN: true, noDefaultInfinity: true, min: -1e6, max: 1e6 }),
          ),
          { minLength: 1, maxLength: 50 },
        ),
        (pairs) => {
          const a = Float32Array.from(pairs.map((p) => p[0]));
          const b = Float32Array.from(pairs.map((p) => p[1]));
          let dot = 0;
          let na = 0;
          let nb = 0;
          let nd = 0;
          let m = 0;
          for (let i = 0; i < a.length; i++) {
            dot += a[i]! * b[i]!;
            na += a[i]! ** 2;
            nb += b[i]! ** 2;
            nd += (a[i]! - b[i]!) ** 2;
            m = Math.max(m, Math.abs(a[i]! - b[i]!));
          }
          expect(maxAbsDiff(a, b)).toBe(m);
          if (na > 1e-30 && nb > 1e-30) {
            const c = Math.min(1, Math.max(-1, dot / Math.sqrt(na * nb)));
            expect(Math.abs(cosine(a, b) - c)).toBeLessThan(1e-12);
            expect(Math.abs(relL2(a, b) - Math.sqrt(nd / nb)) / Math.max(1, Math.sqrt(nd / nb))).toBeLessThan(
              1e-12,
            );
          }
        },
      ),
      { numRuns: 500 },
    );
  });

  it("defines zero vectors: two zeros are identical, zero against non-zero is orthogonal", () => {
    expect(cosine([0, 0], [0, -0])).toBe(1);
    expect(cosine([], [])).toBe(1);
    expect(cosine([0, 0], [1, 0])).toBe(0);
    expect(cosine([1, 0], [0, 0])).toBe(0);
    expect(relL2([0, 0], [0, 0])).toBe(0);
    expect(relL2([], [])).toBe(0);
    expect(maxAbsDiff([], [])).toBe(0);
  });

  it("returns NaN whenever an input holds NaN or an infinity", () => {
    for (const bad of [Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY]) {
      for (const [a, b] of [
        [
          [1, bad],
          [1, 2],
        ],
        [
          [1, 2],
          [1, bad],
        ],
        [[bad], [bad]],
      ] as Array<[number[], number[]]>) {
        expect(cosine(a, b)).toBeNaN();
        expect(maxAbsDiff(a, b)).toBeNaN();
        expect(relL2(a, b)).toBeNaN();
      }
    }
    expect(maxAbsDiff([0, 0], [0, Number.NaN])).toBeNaN();
  });

  it("rejects inputs of different lengths with MOESWARM_NUMERIC", () => {
    for (const fn of [cosine, maxAbsDiff, relL2]) {
      expect(() => fn([1, 2], [1])).toThrow(InvalidArgumentError);
      try {
        fn(new Float32Array(3), new Float32Array(2));
      } catch (error) {
        expect(isMoeswarmError(error, "MOESWARM_NUMERIC")).toBe(true);
      }
      expect(() => fn(null as unknown as number[], [1])).toThrow(InvalidArgumentError);
    }
  });
});

describe("mulberry32", () => {
  it("replays from its seed and matches the reference sequence", async () => {
    const { mulberry32 } = await import("../src/index.js");
    const a = mulberry32(42);
    const b = mulberry32(42);
    const first = [a(), a(), a()];
    expect([b(), b(), b()]).toEqual(first);
    // pinned: a change to the generator would silently reseed every seeded test and spot check
    expect(first[0]).toBeCloseTo(0.6011037519201636, 15);
    for (const v of first) expect(v >= 0 && v < 1).toBe(true);
    expect(mulberry32(43)()).not.toBe(first[0]);
  });
});

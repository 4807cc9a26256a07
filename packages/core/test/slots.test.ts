import { describe, expect, it } from "vitest";
import { compactSlots, expandSlots, filledSlots, InvalidArgumentError, sumSlots } from "../src/index.js";

describe("sumSlots", () => {
  it("rounds every product to f32 and adds in slot order", () => {
    // In f32, (2^24 + 1) is not representable: the order of additions decides the result.
    // token 0: slots [2^24, 1, 1]: ((2^24 + 1) -> 2^24) + 1 -> 2^24 in f32; f64 would give 2^24 + 2
    // token 1: slots [1, 1, 2^24]: (1 + 1) + 2^24 = 2^24 + 2 exactly representable
    const y = new Float32Array([2 ** 24, 1, 1, 1, 1, 2 ** 24]);
    const w = new Float32Array([1, 1, 1, 1, 1, 1]);
    const ids = new Int32Array([0, 1, 2, 0, 1, 2]);
    expect(Array.from(sumSlots(y, w, ids, { n: 2, k: 3, embd: 1 }))).toEqual([2 ** 24, 2 ** 24 + 2]);
    // a product that is not an f32: 0.1f * 3 rounded to f32 before adding
    const p = sumSlots(new Float32Array([3, 0]), new Float32Array([0.1, 0]), new Int32Array([0, 1]), {
      n: 1,
      k: 2,
      embd: 1,
    });
    expect(p[0]).toBe(Math.fround(Math.fround(0.1) * 3));
  });

  it("skips empty slots, starts from the first non-empty one, and gives +0 for a token with none", () => {
    const y = new Float32Array([-0, 5, 1, 2]);
    const w = new Float32Array([1, 9, 1, 1]);
    // token 0: slot 1 empty: the sum is the product of slot 0, -0 (not -0 + 0 = +0)
    // token 1: both empty
    const out = sumSlots(y, w, new Int32Array([0, -1, -1, -1]), { n: 2, k: 2, embd: 1 });
    expect(Object.is(out[0], -0)).toBe(true);
    expect(Object.is(out[1], 0)).toBe(true);
    const reused = new Float32Array([7, 7]);
    sumSlots(y, w, new Int32Array([-1, -1, -1, -1]), { n: 2, k: 2, embd: 1 }, reused);
    expect(Array.from(reused)).toEqual([0, 0]);
  });

  it("rejects mismatched lengths", () => {
    expect(() =>
      sumSlots(new Float32Array(3), new Float32Array(2), new Int32Array(2), { n: 1, k: 2, embd: 2 }),
    ).toThrow(InvalidArgumentError);
  });
});

describe("compactSlots / expandSlots", () => {
  it("keep the filled slots' rows in slot order, and lay them out again with zeros", () => {
    const ids = Int32Array.from([4, -1, 0, -1, 7, -1]);
    const y = Float32Array.from({ length: 12 }, (_, i) => (ids[i >> 1]! >= 0 ? i + 1 : 0));
    const rows = compactSlots(y, ids, 2);
    expect(Array.from(rows)).toEqual([1, 2, 5, 6, 9, 10]);
    expect(filledSlots(ids)).toBe(3);
    expect(Array.from(expandSlots(rows, ids, 2))).toEqual(Array.from(y));
    // every slot filled: the full layout is already compact
    const all = Int32Array.from([1, 2]);
    const full = Float32Array.from([1, 2, 3, 4]);
    expect(compactSlots(full, all, 2)).toBe(full);
    expect(() => expandSlots(new Float32Array(5), ids, 2)).toThrow(InvalidArgumentError);
    expect(() => compactSlots(new Float32Array(5), ids, 2)).toThrow(InvalidArgumentError);
  });
});

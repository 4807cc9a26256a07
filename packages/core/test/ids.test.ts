import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  checkRange,
  expertKey,
  formatRange,
  InvalidArgumentError,
  parseRange,
  rangeValues,
  toRanges,
} from "../src/index.js";

describe("parseRange", () => {
  it("parses half-open ranges and single indices", () => {
    expect(parseRange("0:8")).toEqual({ start: 0, end: 8 });
    expect(parseRange(" 3:4 ")).toEqual({ start: 3, end: 4 });
    expect(parseRange("7")).toEqual({ start: 7, end: 8 });
    expect(parseRange("0:256", { max: 256 })).toEqual({ start: 0, end: 256 });
  });

  it.each([
    "",
    "0:",
    ":3",
    "3:1",
    "2:2",
    "-1:3",
    "1.5:3",
    "0x1:2",
    "1e3:2000",
    "a:b",
    "1:2:3",
    "01:3",
    "0:99999999999",
    "0: 3",
  ])("rejects %j with a typed error", (bad) => {
    let err: unknown;
    try {
      parseRange(bad);
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(InvalidArgumentError);
    expect((err as InvalidArgumentError).code).toBe("MOESWARM_INVALID_RANGE");
  });

  it("enforces max", () => {
    expect(() => parseRange("0:257", { max: 256 })).toThrow(/exceeds the limit 256/);
  });

  it("round-trips formatRange for any valid range", () => {
    fc.assert(
      fc.property(fc.nat(1_000_000), fc.integer({ min: 1, max: 1_000_000 }), (a, n) => {
        const r = { start: a, end: a + n };
        expect(parseRange(formatRange(r))).toEqual(r);
      }),
    );
  });

  it("never throws anything but InvalidArgumentError on arbitrary strings", () => {
    fc.assert(
      fc.property(fc.string(), (s) => {
        try {
          const r = parseRange(s);
          expect(r.end).toBeGreaterThan(r.start);
        } catch (e) {
          expect(e).toBeInstanceOf(InvalidArgumentError);
        }
      }),
    );
  });
});

describe("range helpers", () => {
  it("checkRange validates numeric ranges", () => {
    expect(checkRange({ start: 1, end: 2 })).toEqual({ start: 1, end: 2 });
    expect(() => checkRange({ start: 2, end: 1 })).toThrow(InvalidArgumentError);
    expect(() => checkRange({ start: 0.5, end: 1 })).toThrow(InvalidArgumentError);
    expect(() => checkRange({ start: 0, end: 9 }, { max: 8 })).toThrow(InvalidArgumentError);
  });

  it("toRanges compresses and rangeValues expands", () => {
    expect(toRanges([5, 1, 2, 3, 9, 8, 2])).toEqual([
      { start: 1, end: 4 },
      { start: 5, end: 6 },
      { start: 8, end: 10 },
    ]);
    expect([...rangeValues({ start: 2, end: 5 })]).toEqual([2, 3, 4]);
    expect(expertKey({ layer: 3, expert: 17 })).toBe("3:17");
  });
});

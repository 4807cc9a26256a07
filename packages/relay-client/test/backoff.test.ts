import { describe, expect, it } from "vitest";
import { backoffDelay } from "../src/index.js";

const b = {
  initialDelayMs: 100,
  maxDelayMs: 1000,
  factor: 2,
  jitter: 0.5,
  maxAttempts: Number.POSITIVE_INFINITY,
};

describe("backoffDelay", () => {
  it("grows exponentially up to the ceiling", () => {
    expect([1, 2, 3, 4, 5, 6, 50].map((a) => backoffDelay(a, b, () => 0))).toEqual([
      100, 200, 400, 800, 1000, 1000, 1000,
    ]);
  });

  it("takes away up to `jitter` of each delay at random", () => {
    expect(backoffDelay(3, b, () => 1)).toBe(200);
    expect(backoffDelay(3, b, () => 0.5)).toBe(300);
    expect(backoffDelay(3, { ...b, jitter: 0 }, () => 0.9)).toBe(400);
    const seen = new Set(Array.from({ length: 200 }, () => backoffDelay(2, b)));
    expect(Math.min(...seen)).toBeGreaterThanOrEqual(100);
    expect(Math.max(...seen)).toBeLessThanOrEqual(200);
    expect(seen.size).toBeGreaterThan(10);
  });
});

// The native path's figures from moeswarm-native-ping's JSON line: percentiles of the round trips
// and of each round trip less its own compute (not the difference of two medians).
import { describe, expect, it } from "vitest";
import { nativeSample } from "../src/benchmarks/roundtrip-native.js";

describe("nativeSample", () => {
  it("p10/p50/p90 of the round trips, p50 of (round trip - that trip's compute) and of the compute", () => {
    const rtUs = [500, 100, 300, 200, 400];
    const workerMs = [0.45, 0.02, 0.2, 0.15, 0.3]; // above compute: 50, 80, 100, 50, 100
    expect(nativeSample(rtUs, workerMs)).toEqual({
      p10: 100,
      p50: 300,
      p90: 500,
      aboveComputeP50: 80,
      computeP50: 200,
    });
    expect(rtUs).toEqual([500, 100, 300, 200, 400]); // the caller's arrays are left as they were
  });

  it("refuses an empty or mismatched line", () => {
    expect(() => nativeSample([], [])).toThrow(/measured nothing/);
    expect(() => nativeSample([1, 2], [0.001])).toThrow(/measured nothing/);
  });
});

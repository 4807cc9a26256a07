// The roundtrip bench's goal lines: each goal's ratio per token count, against its bound.
import { describe, expect, it } from "vitest";
import { goalLines, ROUNDTRIP_GOALS } from "../src/benchmarks/roundtrip-goals.js";

describe("goalLines", () => {
  it("gives each token count's figure and whether it is within the goal's bound", () => {
    const ratios = {
      "relay (TLS)/blind relay (TLS) floor, interleaved, 1 tok": 1.205,
      "relay (TLS)/blind relay (TLS) floor, interleaved, 8 tok": 1.2,
      "relay (TLS)/blind relay (TLS) floor, 1 tok": 0.5, // the block ratio is not the goal's
      "native above compute/0.1 ms goal, 1 tok": 0.55,
      "native above compute/0.1 ms goal, 8 tok": 3.75,
    };
    const lines = goalLines(ratios, [1, 8], ROUNDTRIP_GOALS);
    expect(lines[0]).toBe(
      "goal: relay over TLS (as deployed) <= 1.2x the blind TLS relay: 1 tok 1.205 (not met), 8 tok 1.200 (met)",
    );
    expect(lines[4]).toBe(
      "goal: native <= 0.1 ms above the worker's compute: 1 tok 0.550 (met), 8 tok 3.750 (not met)",
    );
  });

  it("says when a goal's path was not measured", () => {
    const lines = goalLines({}, [1], [{ name: "x <= 1", ratio: "x/y", atMost: 1 }]);
    expect(lines).toEqual(["goal: x <= 1: not measured in this run"]);
  });
});

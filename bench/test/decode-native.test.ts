// The decode benchmark's native row: its figures from the plugin's stats (medians over rounds, the
// per-layer p50s times the remote layers), the token check that fails the bench, and the placement
// note that says whether the table has ranged entries.
import type { HubPlacement, LogitsHarnessResult, PluginStats } from "@moeswarm/backbone";
import { Placement } from "@moeswarm/dispatch";
import { describe, expect, it } from "vitest";
import { describePlacement } from "../src/benchmarks/decode-native.js";
import {
  checkSameTokens,
  type NativeRound,
  nativeRound,
  nativeRow,
} from "../src/benchmarks/decode-native-row.js";

function run(o: Partial<LogitsHarnessResult> & { plugin?: PluginStats | null }): LogitsHarnessResult {
  return {
    ok: true,
    exitCode: 0,
    prompt: [1, 2],
    tokens: [5, 6, 7],
    margins: [],
    text: "",
    nVocab: 10,
    loadMs: 0,
    promptMs: 0,
    decodeMs: 64,
    plugin: null,
    stderr: "the log",
    rssLoadKiB: 0,
    maxRssKiB: 0,
    ...o,
  };
}

const layer = (p50Us: number) => ({ count: 65, failures: 0, tokens: 80, meanUs: 900, p50Us, p99Us: 2000 });

function stats(native: Partial<NonNullable<PluginStats["native"]>> | undefined): PluginStats {
  return {
    splits: 130,
    failures: 0,
    bytesOut: 0,
    bytesIn: 0,
    graphCacheHits: 0,
    graphCacheMisses: 0,
    weightsDroppedBytes: 0,
    weightsDroppedTensors: 0,
    layers: { "0": layer(400), "1": layer(600) },
    ...(native
      ? {
          native: {
            splits: 128,
            fallbacks: 2,
            roundTripP50Us: 450,
            overheadP50Us: 150,
            receipts: 3,
            receiptsDeferred: 0,
            failures: {},
            ...native,
          },
        }
      : {}),
  };
}

describe("nativeRound", () => {
  it("ms per token, the plugin's per-layer p50s summed, the native p50s per layer, the split counts", () => {
    expect(nativeRound(run({ plugin: stats({}) }), 32)).toEqual({
      msPerToken: 2,
      pluginMs: 1,
      roundTripMs: 0.45,
      aboveComputeMs: 0.15,
      splits: 130,
      nativeSplits: 128,
      fallbacks: 2,
    });
  });

  it("fails loudly on a failed decode or a decode with no native split", () => {
    expect(() => nativeRound(run({ ok: false, plugin: stats({}) }), 32)).toThrow(/decode failed:\nthe log/);
    expect(() => nativeRound(run({ plugin: stats(undefined) }), 32)).toThrow(/no split went native/);
    expect(() => nativeRound(run({ plugin: stats({ splits: 0 }) }), 32)).toThrow(/no split went native/);
  });
});

describe("nativeRow", () => {
  const round = (msPerToken: number, roundTripMs: number, aboveComputeMs: number): NativeRound => ({
    msPerToken,
    pluginMs: msPerToken / 2,
    roundTripMs,
    aboveComputeMs,
    splits: 520,
    nativeSplits: 519,
    fallbacks: 1,
  });

  it("medians over the rounds, per-layer figures times the layers, counts summed, ratios against plain, bridge and the goal", () => {
    const rounds = [round(5, 0.4, 0.2), round(8, 0.6, 0.3), round(6, 0.5, 0.25)];
    const { row, ratios, notes } = nativeRow("native", rounds, { layers: 8, plainMsTok: 4, bridgeMsTok: 12 });
    expect(row).toEqual({
      mode: "native",
      "tok/s": 1000 / 6,
      "ms/token": 6,
      backbone: 3,
      "native round trip": 0.5 * 8,
      "native above compute": 0.25 * 8,
      "native/all splits": "1557/1560",
      "fell back": 3,
    });
    expect(ratios.native_vs_plain_tokens_per_s).toBeCloseTo(4 / 6, 12);
    expect(ratios.native_vs_bridge_tokens_per_s).toBeCloseTo(2, 12);
    expect(ratios.native_above_compute_per_layer_vs_goal).toBeCloseTo(2.5, 12);
    expect(notes.join("\n")).toContain("p50 0.500 ms round trip, 0.250 ms above the worker's compute");
    expect(notes.join("\n")).toContain("0.400-0.600 and 0.200-0.300 ms, ms/token 5.00-8.00");
  });
});

describe("checkSameTokens", () => {
  const plain = run({ tokens: [5, 6, 7, 8] });

  it("passes the same tokens and throws at the first difference or a different length", () => {
    expect(() => checkSameTokens(plain, run({ tokens: [5, 6, 7, 8] }), "native")).not.toThrow();
    expect(() => checkSameTokens(plain, run({ tokens: [5, 6, 9, 8] }), "native, round 2")).toThrow(
      "native, round 2: tokens differ from the plain run's at 2 (plain 7,8, swarm 9,8)",
    );
    expect(() => checkSameTokens(plain, run({ tokens: [5, 6, 7] }), "native")).toThrow(/at 3 /);
    expect(() => checkSameTokens(plain, run({ tokens: [5, 6, 7, 8, 1] }), "native")).toThrow(/at 4 /);
  });
});

describe("describePlacement", () => {
  function hubPlacement(regs: Array<{ id: string; layers: number[]; experts: number[] }>): HubPlacement {
    const placement = new Placement({ model: "m" });
    for (const r of regs) placement.register({ ...r, model: "m" });
    return { placement, layers: [0, 1], nExpert: 4 } as unknown as HubPlacement;
  }
  const all = [0, 1, 2, 3];

  it("every layer split between the workers, one owner per expert: ranged", () => {
    const p = hubPlacement([
      { id: "w0", layers: [0, 1], experts: [0, 1] },
      { id: "w1", layers: [0, 1], experts: [2, 3] },
    ]);
    expect(describePlacement(p)).toEqual({ text: "w0 0:2 + w1 2:4 of layers 0,1", ranged: true });
  });

  it("whole layers, two owners of an expert or a gap: not ranged", () => {
    const whole = hubPlacement([
      { id: "w0", layers: [0], experts: all },
      { id: "w1", layers: [1], experts: all },
    ]);
    expect(describePlacement(whole)).toEqual({ text: "w0 0:4 of layer 0; w1 0:4 of layer 1", ranged: false });
    const twice = hubPlacement([
      { id: "w0", layers: [0, 1], experts: all },
      { id: "w1", layers: [0, 1], experts: [2, 3] },
    ]);
    expect(describePlacement(twice)).toEqual({ text: "w0 0:2 + w0+w1 2:4 of layers 0,1", ranged: false });
    const gap = hubPlacement([{ id: "w0", layers: [0, 1], experts: [0, 1] }]);
    expect(describePlacement(gap).ranged).toBe(false);
  });
});

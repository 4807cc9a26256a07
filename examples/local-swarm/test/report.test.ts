// The report's verification lines: under --trust own nothing is verified or audited, and the
// report says so in one line instead of printing zero counters that read like checks that passed.
import type { BridgeMetrics, LogitsHarnessResult } from "@moeswarm/backbone";
import { emptyVerificationStats } from "@moeswarm/dispatch";
import { describe, expect, it } from "vitest";
import { type DemoReport, printReport } from "../src/report.js";

const run = { tokens: [1, 2], text: " a b", nVocab: 8, rssLoadKiB: 1024 } as unknown as LogitsHarnessResult;
const bridge = {
  requests: 4,
  failovers: 0,
  fallbacks: 0,
  audits: 0,
  layers: [],
  dispatch: { owners: {}, bytesOut: 0, bytesIn: 0 },
  // the bridge keeps verification counters under trust "own" too: all zero
  verification: emptyVerificationStats(),
} as unknown as BridgeMetrics;

function lines(trust: DemoReport["trust"], metrics = bridge): string[] {
  const out: string[] = [];
  printReport((l = "") => out.push(l), {
    prompt: "p",
    plain: run,
    swarm: run,
    identical: 2,
    logitsIdentical: true,
    tokPerSecond: { plain: 10, swarm: 5 },
    bridge: metrics,
    workers: [],
    ...(trust ? { trust } : {}),
  });
  return out;
}

describe("printReport: verification lines", () => {
  it("--trust own: one 'verify off' line, no verify or audit counters", () => {
    const out = lines("own");
    expect(out.filter((l) => /^ {2}(verify|audit) /.test(l))).toEqual([
      "  verify    off (--trust own: answers used as they come; no second opinion, no audit)",
    ]);
  });

  it("verify (the default): the counters and the audit line", () => {
    const out = lines(undefined);
    expect(out.some((l) => /^ {2}verify +0 parts answered by two workers/.test(l))).toBe(true);
    expect(out.some((l) => /^ {2}audit +0 agreed parts re-computed/.test(l))).toBe(true);
    // the backbone line counts audits apart from fallbacks
    const audited = lines(undefined, { ...bridge, audits: 3 } as BridgeMetrics);
    expect(audited.some((l) => / 0 failovers, 0 local fallbacks, 3 local audits$/.test(l))).toBe(true);
  });
});

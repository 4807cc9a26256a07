// The hub's HTTP bodies: what the parsers accept and what they refuse, with the code and the field.
import { describe, expect, it } from "vitest";
import {
  isHubId,
  isMoeswarmError,
  isNativeAddress,
  manifestUrl,
  parseDemandJson,
  parseLeaseJson,
  parseStatsReport,
  placementUrl,
  shardUrl,
} from "../src/index.js";

const MODEL = {
  id: "m",
  layers: [
    { layer: 0, nExpert: 4 },
    { layer: 2, nExpert: 2 },
  ],
};

function refused(run: () => unknown, message: RegExp): void {
  let error: unknown;
  try {
    run();
  } catch (e) {
    error = e;
  }
  expect(isMoeswarmError(error, "MOESWARM_HUB_BAD_REQUEST")).toBe(true);
  expect((error as Error).message).toMatch(message);
}

describe("hub-api", () => {
  it("builds the API's paths", () => {
    expect(shardUrl("a b", "0:1", "2:4")).toBe("/api/models/a%20b/expert-shard?layers=0:1&experts=2:4");
    expect(manifestUrl("m")).toBe("/api/models/m/manifest");
    expect(placementUrl("m")).toBe("/api/models/m/placement");
    expect(placementUrl("m", 7, 30)).toBe("/api/models/m/placement?since=7&wait=30");
  });

  it("checks leases and demand", () => {
    const lease = {
      leaseId: "l",
      worker: "w",
      model: "m",
      layers: "0:1",
      experts: "0:4",
      bytes: 1,
      grantedAt: 0,
      expiresAt: 1,
      ttlMs: 1,
      url: "/u",
      manifest: "/m",
      capacity: {},
    };
    expect(parseLeaseJson(lease)).toBe(lease);
    refused(() => parseLeaseJson({ ...lease, ttlMs: "1" }), /a lease/);
    refused(() => parseLeaseJson(null), /a lease/);
    expect(parseDemandJson({ time: 1, ranges: [] })).toEqual({ time: 1, ranges: [] });
    refused(() => parseDemandJson({ time: 1 }), /a demand/);
  });

  it("parses a stats report: counts as arrays or base64, receipts", () => {
    const b64 = Buffer.from(new Uint32Array([5, 6]).buffer).toString("base64");
    const r = parseStatsReport(
      {
        backbone: "bb",
        seq: 3,
        tokens: 10,
        ms: 500,
        counts: { "0": [1, 2, 3, 4], "2": b64 },
        receipts: { w1: { expertTokens: 7, ms: 1.5 } },
      },
      MODEL,
    );
    expect(r.backbone).toBe("bb");
    expect(r.seq).toBe(3);
    expect([...r.counts.get(0)!]).toEqual([1, 2, 3, 4]);
    expect([...r.counts.get(2)!]).toEqual([5, 6]);
    expect(r.receipts.get("w1")).toEqual({ expertTokens: 7, ms: 1.5 });
  });

  it("refuses reports that do not fit the model", () => {
    refused(() => parseStatsReport([], MODEL), /JSON object/);
    refused(() => parseStatsReport({ counts: { "1": [1] } }, MODEL), /not a MoE layer of m/);
    refused(() => parseStatsReport({ counts: { "0": [1, 2] } }, MODEL), /must have 4 entries/);
    refused(() => parseStatsReport({ counts: { "0": [1, 2, 3, -1] } }, MODEL), /counts\[0\]\[3\]/);
    refused(() => parseStatsReport({ tokens: 5 }, MODEL), /ms \(the span/);
    refused(() => parseStatsReport({ receipts: { "": { expertTokens: 1 } } }, MODEL), /1\.\.128 bytes/);
    expect(isHubId("x".repeat(128))).toBe(true);
    expect(isHubId("x".repeat(129))).toBe(false);
  });
});

describe("isNativeAddress (DirectEndpointJson.native)", () => {
  it("takes host:port, IPv4:port and [v6]:port with a port in 1..65535", () => {
    for (const ok of [
      "w1:7444",
      "w1.example.org:1",
      "10.0.0.2:65535",
      "[::1]:7444",
      "[fe80::1:2]:80",
      "a_b-c:9",
    ]) {
      expect(isNativeAddress(ok), ok).toBe(true);
    }
  });

  it("refuses URLs, bare hosts, bad ports, unbracketed IPv6, spaces, non-strings and long ones", () => {
    for (const bad of [
      "w1",
      "w1:",
      "w1:0",
      "w1:65536",
      "w1:07444",
      "wss://w1:7444",
      "::1:7444",
      "[::1]",
      "w 1:7444",
      ":7444",
      `${"a".repeat(296)}:7444`, // 301 characters
      7444,
      undefined,
    ]) {
      expect(isNativeAddress(bad), String(bad)).toBe(false);
    }
    expect(isNativeAddress(`${"a".repeat(295)}:7444`)).toBe(true); // 300 characters
  });
});

import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { formatTable, measure, runBenchmark } from "../src/harness.js";

describe("bench harness", () => {
  it("measure counts every call and orders its statistics", async () => {
    let calls = 0;
    const t = await measure("noop", () => calls++, { minTimeMs: 1, minSamples: 20, batch: 5, warmup: 2 });
    expect(t.iterations).toBe(calls - 2);
    expect(t.iterations % 5).toBe(0);
    expect(t.minNs).toBeLessThanOrEqual(t.medianNs);
    expect(t.medianNs).toBeLessThanOrEqual(t.p99Ns);
  });

  it("formatTable aligns columns", () => {
    const s = formatTable([
      { a: "x", b: 1.23456 },
      { a: "long", b: 2 },
    ]);
    const lines = s.split("\n");
    expect(lines).toHaveLength(4);
    expect(new Set(lines.map((l) => l.length)).size).toBe(1);
    expect(s).toContain("1.235");
  });

  it("runBenchmark writes <name>.json with the ratios", async () => {
    const dir = mkdtempSync(join(tmpdir(), "bench-"));
    await runBenchmark(
      { name: "t", description: "test", run: async () => ({ rows: [{ x: 1 }], ratios: { r: 2 } }) },
      dir,
    );
    const json = JSON.parse(readFileSync(join(dir, "t.json"), "utf8"));
    expect(json.name).toBe("t");
    expect(json.ratios).toEqual({ r: 2 });
    expect(json.rows).toEqual([{ x: 1 }]);
  });
});

// The cross-backend matrix command in its short mode, as CI runs it: every backend this machine has
// computes the same frames; each agrees with the f64 oracle and with the others.
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import type { MatrixResult } from "../src/matrix.js";

// the root's tsx (the bench scripts run with it)
const tsx = join(import.meta.dirname, "..", "..", "node_modules", ".bin", "tsx");
const script = join(import.meta.dirname, "..", "src", "matrix.ts");

describe("bench matrix --short", () => {
  it("prints the matrix; every available backend is within 0.999 cosine of the oracle and of the others", () => {
    const t0 = performance.now();
    const r = spawnSync(tsx, [script, "--short", "--json"], { encoding: "utf8", timeout: 400_000 });
    expect(r.status, r.stderr).toBe(0);
    const m = JSON.parse(r.stdout) as MatrixResult;
    console.log(
      `matrix --short in ${((performance.now() - t0) / 1000).toFixed(1)} s: ${JSON.stringify(m, null, 1)}`,
    );
    // TypeScript runs everywhere; the addon wherever the package is built (CI builds it)
    expect(m.backends).toContain("ts");
    if (process.env.CI) {
      expect(m.backends).toEqual(
        expect.arrayContaining(["x86 addon", "llama-cpu", "aarch64 (qemu)", "vulkan"]),
      );
    }
    expect(Object.keys(m.oracle)).toEqual(["f32", "q8_0", "q4_K"]);
    for (const rows of Object.values(m.oracle)) {
      for (const row of Object.values(rows)) {
        for (const b of m.backends) expect(row[b]!.cos, b).toBeGreaterThan(0.999);
      }
    }
    for (const pairs of Object.values(m.pairs))
      for (const c of Object.values(pairs)) expect(c.cos).toBeGreaterThan(0.999);
    const text = spawnSync(tsx, [script, "--help"], { encoding: "utf8" });
    expect(text.stdout).toMatch(/usage: .*matrix/);
  });
});

// scripts/gpu-check.py is what a session lent a GPU machine runs (no Node there), so it must not
// rot between such sessions: here it drives the CPU executable (`--device cpu`) through the same
// checks, with its own msgpack codec, gguf-py models and f64 oracle. On the CPU the slice path is
// the monolithic graph's bits, so the script's strictest checks apply.

import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { tempDir } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";
import { expertWorkerPath } from "../src/index.js";

const here = dirname(fileURLToPath(import.meta.url));

async function llamaSourceDir(): Promise<string> {
  // a URL string keeps the type checker away from the untyped .mjs
  const url = pathToFileURL(join(here, "..", "..", "..", "tools", "llama-source.mjs")).href;
  return ((await import(url)) as { llamaSourceDir(): string }).llamaSourceDir();
}

interface CheckReport {
  ok: boolean;
  checks: Record<
    string,
    { cos_slot: number; ref_bit_identical: boolean; sum_rel_l2: number; backend: string }
  >;
}

describe("scripts/gpu-check.py against the CPU executable", () => {
  it("every type passes: oracle cosine, bits of the monolithic graph, sum = f32 sum of each", async () => {
    const tmp = tempDir("moeswarm-gpu-check-");
    try {
      const fixtures = join(tmp.dir, "fx");
      const fx = spawnSync(process.execPath, [join(here, "..", "scripts", "gpu-fixtures.mjs"), fixtures], {
        encoding: "utf8",
      });
      expect(fx.status, fx.stderr).toBe(0);
      const json = join(tmp.dir, "report.json");
      const r = spawnSync(
        "python3",
        [
          join(here, "..", "scripts", "gpu-check.py"),
          "--exe",
          expertWorkerPath(),
          "--device",
          "cpu",
          "--cpu-threads",
          "2",
          "--types",
          "F32,F16,Q8_0",
          "--model-files",
          join(fixtures, "check-q4_k.gguf"),
          join(fixtures, "check-mxfp4.gguf"),
          "--work",
          join(tmp.dir, "work"),
          "--json",
          json,
        ],
        {
          encoding: "utf8",
          env: { ...process.env, PYTHONPATH: join(await llamaSourceDir(), "gguf-py") },
        },
      );
      expect(r.status, `${r.stdout}\n${r.stderr}`).toBe(0);
      const report = JSON.parse(readFileSync(json, "utf8")) as CheckReport;
      expect(report.ok).toBe(true);
      expect(Object.keys(report.checks).sort()).toEqual(["F16", "F32", "MXFP4", "Q4_K", "Q8_0"]);
      for (const [name, c] of Object.entries(report.checks)) {
        expect(c.backend, name).toBe("cpu");
        expect(c.ref_bit_identical, name).toBe(true);
        expect(c.sum_rel_l2, name).toBe(0);
        expect(c.cos_slot, name).toBeGreaterThan(name === "F32" ? 0.99999 : 0.999);
      }
    } finally {
      tmp.remove();
    }
  }, 120_000);
});

import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { readGguf, toGiB } from "@moeswarm/shard";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { compareWithReference, planModel, REFERENCE } from "../src/compare.js";
import { QWEN35_122B_A10B, writeQwen35Header } from "../src/qwen35-122b.js";

const dir = mkdtempSync(join(tmpdir(), "offload-plan-test-"));
const path = join(dir, "qwen35-122b.gguf");

beforeAll(async () => {
  await writeQwen35Header(path);
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("the Qwen3.5-122B-A10B-shaped header", () => {
  it("has the size of a Q4_K_M file of the model: 74.2 GB of tensors", async () => {
    const header = await readGguf(path);
    const bytes = header.tensors.reduce((s, t) => s + t.nbytes, 0n);
    expect(bytes).toBe(74_201_739_264n);
    // Parameters: about 122B in all.
    const params = header.tensors.reduce((s, t) => s + t.nElements, 0);
    expect(params / 1e9).toBeGreaterThan(121);
    expect(params / 1e9).toBeLessThan(123);
  });

  it("keeps all but the last 6 expert layers on a 64 GB GPU at an 8192-token context", async () => {
    const plan = await planModel(path, { ctx: 8192 });
    expect(plan.fits).toBe(true);
    expect(plan.ramLayers).toEqual([42, 43, 44, 45, 46, 47]);
    expect(plan.overrideTensor).toBe("^blk\\.4[2-7]\\.ffn_(up|down|gate)_exps\\.weight$=CPU");
  });

  it("matches the reference at the full context: the same 10 layers and 14.2 GiB in RAM", async () => {
    const plan = await planModel(path, { ctx: QWEN35_122B_A10B.maxPositionEmbeddings });
    const rows = Object.fromEntries(compareWithReference(plan).map((r) => [r.what, r]));
    expect(rows["expert layers in RAM"]!.ours).toBe(String(REFERENCE.ramLayers));
    expect(rows["RAM: offloaded expert layers (GiB)"]!.ours).toBe(REFERENCE.ramGiB);
    const vram = Number(rows["VRAM in use, margin aside (GiB)"]!.ours);
    expect(Math.abs(vram - Number(REFERENCE.vramGiB))).toBeLessThan(0.5);
    expect(toGiB(plan.vram.total)).toBe("63.9");
  });

  it("runs as `pnpm start`", () => {
    const root = fileURLToPath(new URL("..", import.meta.url));
    const r = spawnSync(process.execPath, ["--import", "tsx", "src/main.ts"], {
      cwd: root,
      encoding: "utf8",
    });
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toContain("expert layers in RAM:   42-47 (6 layers");
    expect(r.stdout).toMatch(/expert layers in RAM\s+10\s+10/);
  });
});

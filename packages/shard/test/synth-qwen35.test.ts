// qwen35moe synthesis: the shape-true preset holds Qwen3.5-122B-A10B's layers in Q4_K_M types,
// its header-only output with the real layer count and vocabulary is the hand-made 122B fixture
// tensor for tensor and gives the seeds' planner figures, and a header written by llama.cpp's own
// gguf-py (test/fixtures/qwen35moe-header.py) gives the same plan.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import {
  GgmlType,
  type GgufHeader,
  getInteger,
  modelHparams,
  planOffload,
  planSyntheticModel,
  readGguf,
  type SyntheticMoeOptions,
  synthesizeMoeModel,
  syntheticPreset,
  toGiB,
  writeGguf,
  writeSyntheticHeader,
} from "../src/index.js";
import { runGgufPy } from "./gguf-fixtures.js";
import { QWEN35_122B, qwen35moeModel } from "./plan-fixtures.js";

const tmp = tempDir("moeswarm-synth35-");
afterAll(() => tmp.remove());

/** The shape-true preset with all 48 layers and the real vocabulary: the 122B model's header. */
const FULL_122B: SyntheticMoeOptions = {
  ...syntheticPreset("shape", "qwen35moe"),
  nLayer: 48,
  vocab: 248320,
};

/** The seeds' figure: 64 GiB of VRAM, 128 GiB of RAM, the model's full context. */
function checkSeedsPlan(header: GgufHeader): void {
  const plan = planOffload(header, { vram: "64GiB", ram: "128GiB", ctx: QWEN35_122B.contextLength });
  expect(plan.fits).toBe(true);
  expect(plan.ramLayers).toEqual([38, 39, 40, 41, 42, 43, 44, 45, 46, 47]);
  const ramExperts = plan.layers.filter((l) => l.device === "ram").reduce((s, l) => s + l.bytes, 0n);
  expect(toGiB(ramExperts)).toBe("14.2");
  // As plan.test.ts: 62.9 GiB in use against the reference's 62.6 (the free margin aside).
  expect(toGiB(plan.vram.total - plan.vram.margin)).toBe("62.9");
}

describe("qwen35moe synthesis", () => {
  it("the shape-true preset: Qwen3.5-122B-A10B's layer dimensions in Q4_K_M types", () => {
    const { spec, plan } = planSyntheticModel(syntheticPreset("shape", "qwen35moe"));
    const type = (name: string) => spec.tensors.find((t) => t.name === name)!.type;
    const shape = (name: string) => spec.tensors.find((t) => t.name === name)!.shape;
    expect(shape("blk.0.ffn_up_exps.weight")).toEqual([3072, 1024, 256]);
    expect(shape("blk.0.ffn_down_shexp.weight")).toEqual([1024, 3072]);
    expect(shape("blk.0.attn_qkv.weight")).toEqual([3072, 2 * 16 * 128 + 64 * 128]);
    expect(shape("blk.3.attn_q.weight")).toEqual([3072, 2 * 32 * 256]);
    expect(spec.tensors.some((t) => t.name === "blk.2.attn_q.weight")).toBe(false);
    expect(type("blk.0.ffn_up_exps.weight")).toBe(GgmlType.Q4_K);
    // use_more_bits(i, 4): layers 2 and 3 get Q6_K ffn_down
    expect(type("blk.1.ffn_down_exps.weight")).toBe(GgmlType.Q4_K);
    expect(type("blk.2.ffn_down_exps.weight")).toBe(GgmlType.Q6_K);
    expect(type("output.weight")).toBe(GgmlType.Q6_K);
    expect(type("blk.0.ssm_conv1d.weight")).toBe(GgmlType.F32);
    const gb = Number(plan.totalSize) / 1e9;
    expect(gb).toBeGreaterThan(5.5);
    expect(gb).toBeLessThan(6.5);
  });

  it("the 122B header it writes is the hand-made fixture, tensor for tensor, and plans as the seeds did", async () => {
    const path = join(tmp.dir, "synth-122b.gguf");
    const t0 = performance.now();
    await writeSyntheticHeader(FULL_122B, path);
    const header = await readGguf(path);
    console.log(`122B header written and read in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    const fixturePath = join(tmp.dir, "fixture-122b.gguf");
    await writeGguf(qwen35moeModel(QWEN35_122B), fixturePath, { headerOnly: true });
    const fixture = await readGguf(fixturePath);
    const list = (h: GgufHeader) => h.tensors.map((t) => [t.name, t.shape.map(Number), t.type, t.nbytes]);
    expect(list(header)).toEqual(list(fixture));
    expect(header.tensors.reduce((s, t) => s + t.nbytes, 0n)).toBe(74_201_739_264n);
    expect(getInteger(header, "general.file_type")).toBe(15);
    const hp = modelHparams(header);
    expect(hp.nLayerAll).toBe(48);
    expect(hp.recurrent.filter((r) => !r).length).toBe(12);
    checkSeedsPlan(header);
  });

  it("a 122B header written by llama.cpp's gguf-py plans the same", async () => {
    const path = join(tmp.dir, "gguf-py-122b.gguf");
    const script = readFileSync(join(import.meta.dirname, "fixtures", "qwen35moe-header.py"), "utf8");
    await runGgufPy(script, [path]);
    const header = await readGguf(path);
    expect(modelHparams(header).arch).toBe("qwen35moe");
    expect(header.tensors.reduce((s, t) => s + t.nbytes, 0n)).toBe(74_201_739_264n);
    checkSeedsPlan(header);
  });

  it("writes a Q4_K_M mix with data, and the types survive the round trip", async () => {
    const path = join(tmp.dir, "mix.gguf");
    const options: SyntheticMoeOptions = {
      ...syntheticPreset("tiny", "qwen35moe"),
      nEmbd: 256,
      nFfExp: 256,
      nFfShared: 256,
      nExpert: 2,
      nExpertUsed: 1,
      mix: "Q4_K_M",
    };
    const result = await synthesizeMoeModel(options, path);
    const h = await readGguf(path);
    expect(BigInt(result.size)).toBe(planSyntheticModel(options).plan.totalSize);
    const type = (n: string) => h.tensors.find((t) => t.name === n)!.type;
    expect(type("blk.0.ffn_gate_exps.weight")).toBe(GgmlType.Q4_K);
    expect(type("blk.3.ffn_down_exps.weight")).toBe(GgmlType.Q6_K);
    // ssm_out's rows hold 64 values: Q4_K falls back to Q5_0 as llama-quantize does
    expect(type("blk.0.ssm_out.weight")).toBe(GgmlType.Q5_0);
  }, 120_000);
});

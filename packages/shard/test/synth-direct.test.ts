// `weights: "direct"`: random valid Q4_K / Q6_K / Q8_0 blocks written without a quantiser decode
// (with the shard's transcription of ggml's dequantisers) to values of mean 0 and the requested
// spread, deterministically from the seed, and a model written that way differs from the
// quantised one only in its routed experts. llama-text.test.ts runs such a model through llama.cpp and
// checks that a wrong expert still changes its tokens.
import { createHash } from "node:crypto";
import { Writable } from "node:stream";
import { describe, expect, it } from "vitest";
import {
  dequantize,
  GgmlType,
  ggmlTypeName,
  planSyntheticModel,
  readGguf,
  type SyntheticMoeOptions,
  synthesizeMoeModel,
  syntheticPreset,
} from "../src/index.js";
import { directBlocks, hasDirectBlocks } from "../src/synth/direct-blocks.js";
import { streamFor } from "../src/synth/prng.js";

function moments(values: Float32Array): { mean: number; std: number } {
  let s = 0;
  let s2 = 0;
  for (const v of values) {
    s += v;
    s2 += v * v;
  }
  const mean = s / values.length;
  return { mean, std: Math.sqrt(s2 / values.length - mean * mean) };
}

const sha = (b: Uint8Array) => createHash("sha256").update(b).digest("hex");

describe("direct quantised blocks", () => {
  const cases: Array<[GgmlType, number]> = [
    // 0.018: a 3072-wide expert; 0.002: small enough that Q4_K and Q6_K narrow their sub-scales
    ...[0.018, 0.002, 0.5].map((std): [GgmlType, number] => [GgmlType.Q4_K, std]),
    ...[0.018, 0.002, 0.5].map((std): [GgmlType, number] => [GgmlType.Q6_K, std]),
    ...[0.018, 0.5].map((std): [GgmlType, number] => [GgmlType.Q8_0, std]),
  ];
  for (const [type, std] of cases) {
    it(`${ggmlTypeName(type)} at std ${std}: mean 0, the requested spread, every block finite`, () => {
      expect(hasDirectBlocks(type, std)).toBe(true);
      const n = 256 * 1024;
      const bytes = directBlocks(type, n, std, streamFor(7, "t", 0));
      const values = dequantize(type, bytes, n);
      expect(values.every(Number.isFinite)).toBe(true);
      const m = moments(values);
      expect(Math.abs(m.mean)).toBeLessThan(0.01 * std);
      expect(m.std / std).toBeGreaterThan(0.97);
      expect(m.std / std).toBeLessThan(1.03);
      // the blocks vary: no two of the first 64 decode alike
      const block = 256;
      const firsts = new Set<string>();
      for (let b = 0; b < 64; b++) firsts.add(values.subarray(b * block, (b + 1) * block).join());
      expect(firsts.size).toBe(64);
    });
  }

  it("the same stream gives the same bytes; another stream other bytes", () => {
    const a = directBlocks(GgmlType.Q4_K, 4096, 0.02, streamFor(1, "x", 0));
    const b = directBlocks(GgmlType.Q4_K, 4096, 0.02, streamFor(1, "x", 0));
    const c = directBlocks(GgmlType.Q4_K, 4096, 0.02, streamFor(1, "x", 1));
    expect(sha(a)).toBe(sha(b));
    expect(sha(c)).not.toBe(sha(a));
  });

  it("refuses a type without a direct writer and a spread f16 cannot scale (the synthesiser quantises those)", () => {
    expect(hasDirectBlocks(GgmlType.Q4_0, 0.02)).toBe(false);
    expect(() => directBlocks(GgmlType.Q4_0, 256, 0.02, streamFor(1, "x"))).toThrow(/direct blocks/);
    // Q8_0 has no sub-scales to narrow: d = 0.002 / 73.9 is below f16's normal range
    expect(hasDirectBlocks(GgmlType.Q8_0, 0.002)).toBe(false);
    expect(() => directBlocks(GgmlType.Q8_0, 256, 0.002, streamFor(1, "x"))).toThrow(/quantised/);
  });
});

describe("a model with direct weights", () => {
  // tiny: its Q8_0 routed experts are written directly, the rest as before
  const base: SyntheticMoeOptions = syntheticPreset("tiny", "qwen35moe");

  async function synth(options: SyntheticMoeOptions): Promise<Buffer> {
    const parts: Buffer[] = [];
    const sink = new Writable({
      write(chunk, _enc, cb) {
        parts.push(chunk as Buffer);
        cb();
      },
    });
    await synthesizeMoeModel(options, sink);
    return Buffer.concat(parts);
  }

  it("is deterministic, records the choice, and differs from the quantised model only in its routed experts", async () => {
    const direct = { ...base, weights: "direct" as const };
    const [a, b, q] = [await synth(direct), await synth(direct), await synth(base)];
    expect(sha(a)).toBe(sha(b));
    const { spec, plan } = planSyntheticModel(direct);
    expect(spec.options.weights).toBe("direct");
    expect(planSyntheticModel(base).spec.options).not.toHaveProperty("weights");
    const path = `${process.env.TMPDIR ?? "/tmp"}/synth-direct-${process.pid}.gguf`;
    await synthesizeMoeModel(direct, path);
    const header = await readGguf(path);
    expect(header.metadata.get("moeswarm.synthetic.weights")?.value).toBe("direct");
    const qPlan = planSyntheticModel(base).plan;
    let directTensors = 0;
    for (const [i, t] of plan.tensors.entries()) {
      const qt = qPlan.tensors[i]!;
      expect(t.nbytes).toBe(qt.nbytes);
      const at = (buf: Buffer, p: typeof t) =>
        buf.subarray(Number(p.absoluteOffset), Number(p.absoluteOffset + p.nbytes));
      const same = at(a, t).equals(at(q, qt));
      const s = spec.tensors[i]!;
      const lm = s.name === "token_embd.weight" || s.name === "output.weight";
      expect(same, s.name).toBe(!(s.perExpert && hasDirectBlocks(s.type, s.std) && !lm && s.mean === 0));
      if (!same) directTensors++;
    }
    // each layer's three routed expert tensors
    expect(directTensors).toBe(4 * 3);
  }, 120_000);
});

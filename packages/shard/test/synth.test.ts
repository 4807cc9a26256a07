// Synthetic MoE models: determinism, layout (read back by gguf-py, an independent reader), the
// statistics of the drawn weights, presets, caching and bad options.

import { createHash } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { PassThrough } from "node:stream";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import {
  dequantize,
  ensureSyntheticModel,
  findTensor,
  GgmlType,
  getInteger,
  getString,
  planSyntheticModel,
  readGguf,
  SYNTHETIC_ARCHS,
  type SyntheticMoeOptions,
  synthesizeMoeModel,
  syntheticModelKey,
  syntheticPreset,
} from "../src/index.js";
import { buildTokenizer } from "../src/synth/tokenizer.js";
import { runGgufPy } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-synth-");
afterAll(() => tmp.remove());

const sha256 = (bytes: Uint8Array) => createHash("sha256").update(bytes).digest("hex");

function stats(values: Float32Array): { mean: number; std: number } {
  let s = 0;
  let s2 = 0;
  for (const v of values) {
    s += v;
    s2 += v * v;
  }
  const mean = s / values.length;
  return { mean, std: Math.sqrt(s2 / values.length - mean * mean) };
}

describe("synthesizeMoeModel", () => {
  const tiny = syntheticPreset("tiny");

  it("writes the same bytes for the same seed, to a path or a stream", async () => {
    const a = join(tmp.dir, "a.gguf");
    const b = join(tmp.dir, "b.gguf");
    const ra = await synthesizeMoeModel(tiny, a);
    const rb = await synthesizeMoeModel({ ...tiny }, b);
    const sink = new PassThrough();
    const parts: Buffer[] = [];
    sink.on("data", (c: Buffer) => parts.push(c));
    const rs = await synthesizeMoeModel(tiny, sink);
    const fa = readFileSync(a);
    expect(sha256(fa)).toBe(ra.sha256);
    expect(sha256(readFileSync(b))).toBe(ra.sha256);
    expect(sha256(Buffer.concat(parts))).toBe(ra.sha256);
    expect(rb.sha256).toBe(ra.sha256);
    expect(rs.sha256).toBe(ra.sha256);
    expect(fa.byteLength).toBe(ra.size);
    expect(BigInt(ra.size)).toBe(planSyntheticModel(tiny).plan.totalSize);
    // No temporary file left beside the outputs.
    expect(readdirSync(tmp.dir).filter((f) => f.endsWith(".tmp"))).toEqual([]);
  });

  it("writes different weights for a different seed, and only the weights and the seed key differ", async () => {
    const a = await synthesizeMoeModel(tiny, join(tmp.dir, "s1.gguf"));
    const b = await synthesizeMoeModel({ ...tiny, seed: 2 }, join(tmp.dir, "s2.gguf"));
    expect(b.sha256).not.toBe(a.sha256);
    expect(b.size).toBe(a.size);
    const ha = await readGguf(join(tmp.dir, "s1.gguf"));
    const hb = await readGguf(join(tmp.dir, "s2.gguf"));
    expect(hb.tensors.map((t) => [t.name, t.absoluteOffset])).toEqual(
      ha.tensors.map((t) => [t.name, t.absoluteOffset]),
    );
    const fa = readFileSync(join(tmp.dir, "s1.gguf"));
    const fb = readFileSync(join(tmp.dir, "s2.gguf"));
    for (const name of ["blk.0.ffn_up_exps.weight", "token_embd.weight", "blk.1.attn_q.weight"]) {
      const t = findTensor(ha, name)!;
      const range = [Number(t.absoluteOffset), Number(t.absoluteOffset + t.nbytes)] as const;
      expect(sha256(fb.subarray(...range)), name).not.toBe(sha256(fa.subarray(...range)));
    }
    expect(getInteger(hb, "moeswarm.synthetic.seed")).toBe(2);
  });

  it("draws each expert's slab from its own stream: fewer experts keep the same first slabs", async () => {
    const eight = { ...tiny, nExpert: 8 };
    const four = { ...tiny, nExpert: 4 };
    await synthesizeMoeModel(eight, join(tmp.dir, "e8.gguf"));
    await synthesizeMoeModel(four, join(tmp.dir, "e4.gguf"));
    const h8 = await readGguf(join(tmp.dir, "e8.gguf"));
    const h4 = await readGguf(join(tmp.dir, "e4.gguf"));
    const f8 = readFileSync(join(tmp.dir, "e8.gguf"));
    const f4 = readFileSync(join(tmp.dir, "e4.gguf"));
    const t8 = findTensor(h8, "blk.1.ffn_down_exps.weight")!;
    const t4 = findTensor(h4, "blk.1.ffn_down_exps.weight")!;
    expect(t4.shape).toEqual([128, 64, 4]);
    const o8 = Number(t8.absoluteOffset);
    const o4 = Number(t4.absoluteOffset);
    expect(
      Buffer.compare(f8.subarray(o8, o8 + Number(t4.nbytes)), f4.subarray(o4, o4 + Number(t4.nbytes))),
    ).toBe(0);
  });

  it("draws weights with the documented scales", async () => {
    const opts: SyntheticMoeOptions = { ...tiny, types: { experts: "F32", attention: "F32" } };
    const path = join(tmp.dir, "f32.gguf");
    await synthesizeMoeModel(opts, path);
    const header = await readGguf(path);
    const file = readFileSync(path);
    const values = (name: string) => {
      const t = findTensor(header, name)!;
      const start = Number(t.absoluteOffset);
      return dequantize(t.type, file.subarray(start, start + Number(t.nbytes)), t.nElements);
    };
    const nEmbd = 64;
    const router = stats(values("blk.0.ffn_gate_inp.weight"));
    expect(Math.abs(router.mean)).toBeLessThan(0.05);
    // 512 values: the sample deviation is within ~3% (1 sigma) of the drawn one.
    expect(router.std / (2 / Math.sqrt(nEmbd))).toBeGreaterThan(0.9);
    expect(router.std / (2 / Math.sqrt(nEmbd))).toBeLessThan(1.1);
    const up = stats(values("blk.1.ffn_up_exps.weight"));
    expect(up.std / (1 / Math.sqrt(nEmbd))).toBeGreaterThan(0.97);
    expect(up.std / (1 / Math.sqrt(nEmbd))).toBeLessThan(1.03);
    const down = stats(values("blk.1.ffn_down_exps.weight"));
    expect(down.std / (1 / Math.sqrt(128))).toBeGreaterThan(0.97);
    expect(down.std / (1 / Math.sqrt(128))).toBeLessThan(1.03);
    const norm = stats(values("output_norm.weight"));
    expect(norm.mean).toBeGreaterThan(0.95);
    expect(norm.mean).toBeLessThan(1.05);
    // token_embd and output carry the language model (language-model.test.ts): every embedding
    // has the same constant component, which a never-generated token's output row alone reads,
    // more than 1000 logits below (before the output norm's weights, 1 +- 0.25).
    const embd = values("token_embd.weight");
    const out = values("output.weight");
    const row = (m: Float32Array, t: number) => m.subarray(t * nEmbd, (t + 1) * nEmbd);
    const byte = row(out, 0xc3);
    const constDim = byte.findIndex((v) => v !== 0);
    expect(byte.filter((v) => v !== 0)).toHaveLength(1);
    for (let t = 0; t < 512; t++) {
      const e = row(embd, t);
      expect(e[constDim]).toBe(embd[constDim]);
      const rms = Math.sqrt(e.reduce((a, v) => a + v * v, 0) / nEmbd);
      expect((byte[constDim]! * e[constDim]!) / rms).toBeLessThan(-1000 / 0.75);
    }
  });

  it("writes the keys and tensors llama.cpp requires, as gguf-py reads them", {
    timeout: 120_000,
  }, async () => {
    const expected: Record<string, { keys: string[]; tensors: Record<string, number[]> }> = {
      qwen3moe: {
        keys: ["qwen3moe.attention.key_length", "qwen3moe.expert_feed_forward_length"],
        tensors: {
          "blk.0.attn_q.weight": [64, 128],
          "blk.0.attn_k.weight": [64, 64],
          "blk.0.attn_output.weight": [128, 64],
          "blk.0.attn_q_norm.weight": [32],
          "blk.0.ffn_gate_inp.weight": [64, 8],
          "blk.0.ffn_gate_exps.weight": [64, 128, 8],
          "blk.0.ffn_down_exps.weight": [128, 64, 8],
          "output.weight": [64, 512],
        },
      },
      qwen2moe: {
        keys: ["qwen2moe.expert_shared_feed_forward_length", "qwen2moe.expert_feed_forward_length"],
        tensors: {
          "blk.1.attn_q.bias": [64],
          "blk.1.ffn_gate_inp_shexp.weight": [64],
          "blk.1.ffn_up_shexp.weight": [64, 256],
          "blk.1.ffn_down_shexp.weight": [256, 64],
          "blk.1.ffn_up_exps.weight": [64, 128, 8],
        },
      },
      mixtral: {
        keys: ["llama.rope.dimension_count", "llama.vocab_size"],
        tensors: { "blk.0.attn_k.weight": [64, 32], "blk.0.ffn_gate_exps.weight": [64, 128, 8] },
      },
      // qwen35moe.cpp load_arch_hparams/load_arch_tensors: layers 0-2 Gated DeltaNet (2 key heads
      // and 4 value heads of 16: conv channels 2*32 + 64), layer 3 gated attention (q and gate).
      qwen35moe: {
        keys: [
          "qwen35moe.ssm.conv_kernel",
          "qwen35moe.ssm.inner_size",
          "qwen35moe.ssm.state_size",
          "qwen35moe.ssm.time_step_rank",
          "qwen35moe.ssm.group_count",
          "qwen35moe.full_attention_interval",
          "qwen35moe.rope.dimension_sections",
          "qwen35moe.expert_shared_feed_forward_length",
        ],
        tensors: {
          "blk.0.attn_qkv.weight": [64, 128],
          "blk.0.attn_gate.weight": [64, 64],
          "blk.0.ssm_conv1d.weight": [4, 128],
          "blk.0.ssm_a": [4],
          "blk.0.ssm_dt.bias": [4],
          "blk.2.ssm_beta.weight": [64, 4],
          "blk.2.ssm_out.weight": [64, 64],
          "blk.2.ssm_norm.weight": [16],
          "blk.3.attn_q.weight": [64, 256],
          "blk.3.attn_output.weight": [128, 64],
          "blk.3.attn_k_norm.weight": [32],
          "blk.3.post_attention_norm.weight": [64],
          "blk.3.ffn_gate_inp_shexp.weight": [64],
          "blk.3.ffn_down_shexp.weight": [128, 64],
          "blk.3.ffn_down_exps.weight": [128, 64, 8],
        },
      },
      // openai-moe.cpp: attention biases and sinks, a biased router, biased experts
      "gpt-oss": {
        keys: ["gpt-oss.attention.sliding_window", "gpt-oss.expert_feed_forward_length"],
        tensors: {
          "blk.1.attn_sinks.weight": [4],
          "blk.1.attn_output.bias": [64],
          "blk.1.ffn_gate_inp.bias": [8],
          "blk.1.ffn_gate_exps.bias": [128, 8],
          "blk.1.ffn_down_exps.bias": [64, 8],
          "blk.1.ffn_up_exps.weight": [64, 128, 8],
        },
      },
      // glm4-moe.cpp: layer 0 dense, then routed experts with a selection bias and a shared expert
      glm4moe: {
        keys: [
          "glm4moe.expert_shared_count",
          "glm4moe.leading_dense_block_count",
          "glm4moe.expert_gating_func",
          "glm4moe.expert_weights_scale",
        ],
        tensors: {
          "blk.0.ffn_up.weight": [64, 256],
          "blk.1.exp_probs_b.bias": [8],
          "blk.1.attn_q.bias": [128],
          "blk.2.ffn_gate_shexp.weight": [64, 128],
          "blk.2.ffn_down_exps.weight": [128, 64, 8],
        },
      },
      // deepseek2.cpp, MLA form: latent q/kv projections, split k_b/v_b heads, grouped experts
      deepseek2: {
        keys: [
          "deepseek2.attention.kv_lora_rank",
          "deepseek2.attention.key_length_mla",
          "deepseek2.expert_group_count",
          "deepseek2.expert_group_used_count",
          "deepseek2.expert_shared_count",
        ],
        tensors: {
          "blk.0.ffn_gate.weight": [64, 256],
          "blk.1.attn_q_b.weight": [32, 4 * 48],
          "blk.1.attn_kv_a_mqa.weight": [64, 32 + 16],
          "blk.1.attn_k_b.weight": [32, 32, 4],
          "blk.1.attn_v_b.weight": [32, 32, 4],
          "blk.2.exp_probs_b.bias": [8],
          "blk.2.ffn_up_exps.weight": [64, 128, 8],
        },
      },
      // llama4.cpp with interleave_moe_layer_step 2: layers 1 and 3 MoE with a shared expert
      llama4: {
        keys: ["llama4.interleave_moe_layer_step", "llama4.expert_feed_forward_length"],
        tensors: {
          "blk.0.ffn_gate.weight": [64, 128],
          "blk.1.ffn_gate_inp.weight": [64, 8],
          "blk.1.ffn_up_shexp.weight": [64, 128],
          "blk.3.ffn_down_exps.weight": [128, 64, 8],
        },
      },
      // minimax-m2.cpp: QK norms over the whole query/key widths, a selection bias, no shared expert
      "minimax-m2": {
        keys: [
          "minimax-m2.expert_gating_func",
          "minimax-m2.expert_feed_forward_length",
          "minimax-m2.rope.dimension_count",
          "minimax-m2.attention.key_length",
        ],
        tensors: {
          "blk.0.attn_q_norm.weight": [256],
          "blk.0.attn_k_norm.weight": [128],
          "blk.1.exp_probs_b.bias": [4],
          "blk.1.ffn_gate_exps.weight": [256, 256, 4],
          "blk.1.ffn_down_exps.weight": [256, 256, 4],
        },
      },
    };
    const paths = SYNTHETIC_ARCHS.map((arch) => join(tmp.dir, `layout-${arch}.gguf`));
    for (const [i, arch] of SYNTHETIC_ARCHS.entries())
      await synthesizeMoeModel(syntheticPreset("tiny", arch), paths[i]!);
    const read = JSON.parse(
      await runGgufPy(
        `
import sys, json
from gguf import GGUFReader
out = []
for path in sys.argv[1:]:
    r = GGUFReader(path)
    out.append({
        "arch": r.fields["general.architecture"].contents(),
        "keys": list(r.fields.keys()),
        "tensors": {t.name: [int(x) for x in t.shape] for t in r.tensors},
        "tokens": len(r.fields["tokenizer.ggml.tokens"].contents()),
    })
print(json.dumps(out))`,
        paths,
      ),
    ) as Array<{ arch: string; keys: string[]; tensors: Record<string, number[]>; tokens: number }>;
    for (const [i, arch] of SYNTHETIC_ARCHS.entries()) {
      const out = read[i]!;
      const ggufArch = arch === "mixtral" ? "llama" : arch;
      expect(out.arch).toBe(ggufArch);
      expect(out.tokens).toBe(512);
      for (const suffix of [
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "attention.layer_norm_rms_epsilon",
        "expert_count",
        "expert_used_count",
      ]) {
        // Qwen3.5 has no dense FFN width: its loader reads the expert widths only.
        if (arch === "qwen35moe" && suffix === "feed_forward_length") continue;
        expect(out.keys, `${arch} ${suffix}`).toContain(`${ggufArch}.${suffix}`);
      }
      for (const key of expected[arch]!.keys) expect(out.keys).toContain(key);
      for (const [name, shape] of Object.entries(expected[arch]!.tensors))
        expect(out.tensors[name], `${arch} ${name}`).toEqual(shape);
    }
  });

  it("writes quantised types with the shard quantisers", { timeout: 120_000 }, async () => {
    const path = join(tmp.dir, "quant.gguf");
    await synthesizeMoeModel(
      {
        ...tiny,
        nEmbd: 256,
        nHead: 4,
        headDim: 64,
        nFfExp: 256,
        nExpert: 2,
        nExpertUsed: 1,
        nLayer: 1,
        types: { experts: "Q4_K", attention: "Q4_0", embeddings: "BF16", output: "Q8_0" },
      },
      path,
    );
    const h = await readGguf(path);
    expect(findTensor(h, "blk.0.ffn_up_exps.weight")!.type).toBe(GgmlType.Q4_K);
    expect(findTensor(h, "blk.0.attn_v.weight")!.type).toBe(GgmlType.Q4_0);
    expect(findTensor(h, "token_embd.weight")!.type).toBe(GgmlType.BF16);
    expect(findTensor(h, "output.weight")!.type).toBe(GgmlType.Q8_0);
    expect(findTensor(h, "blk.0.ffn_norm.weight")!.type).toBe(GgmlType.F32);
  });

  it("rejects options that cannot make a model, with typed errors", async () => {
    const bad: Array<[Partial<SyntheticMoeOptions>, RegExp]> = [
      [{ arch: "gpt5" as never }, /arch must be one of/],
      [{ seed: -1 }, /seed must be a uint32/],
      [{ nHeadKv: 3 }, /multiple of nHeadKv|nHeadKv must be/],
      [{ nExpertUsed: 9 }, /nExpertUsed must be an integer in \[1, 8\]/],
      [{ vocab: 100 }, /vocab must be an integer/],
      [{ types: { experts: "Q4_K" } }, /block size 256/],
      [{ types: { experts: "Q5_K" as never } }, /types.experts must be one of/],
      [{ nLayer: 1e9 }, /nLayer must be an integer/],
    ];
    for (const [patch, message] of bad) {
      const err = await synthesizeMoeModel({ ...tiny, ...patch }, join(tmp.dir, "bad.gguf")).catch(
        (e: unknown) => e,
      );
      expect(err, JSON.stringify(patch)).toMatchObject({
        name: "InvalidArgumentError",
        code: "MOESWARM_INVALID_ARGUMENT",
      });
      expect((err as Error).message).toMatch(message);
    }
    expect(() => planSyntheticModel({ ...tiny, arch: "mixtral", headDim: 32 })).toThrow(
      /headDim \* nHead = nEmbd/,
    );
  });

  it("stops when aborted, leaving no file", async () => {
    const controller = new AbortController();
    const path = join(tmp.dir, "aborted.gguf");
    const err = await synthesizeMoeModel(tiny, path, {
      signal: controller.signal,
      onProgress: (p) => {
        if (p.bytesWritten > 100_000) controller.abort(new Error("stop"));
      },
    }).catch((e: unknown) => e);
    expect((err as Error).message).toBe("stop");
    expect(readdirSync(tmp.dir).filter((f) => f.startsWith("aborted"))).toEqual([]);
    const already = await synthesizeMoeModel(tiny, path, { signal: AbortSignal.abort() }).catch(
      (e: unknown) => e,
    );
    expect(already).toMatchObject({ name: "AbortError" });
  });
});

describe("byte-level BPE tokenizer", () => {
  it("learns merges of common English and keeps tokens unique", () => {
    const tok = buildTokenizer(1024);
    expect(tok.tokens.length).toBe(1024);
    expect(new Set(tok.tokens).size).toBe(1024);
    expect(tok.merges.slice(0, 4)).toEqual(["Ġ t", "h e", "Ġ a", "Ġt he"]);
    expect(tok.tokens).toContain("Ġthe");
    expect(tok.tokens).toContain("Ġriver");
    expect(tok.tokens[tok.eosId]).toBe("<|endoftext|>");
    // Every merge's halves and result are tokens.
    const known = new Set(tok.tokens);
    for (const m of tok.merges) {
      const [l, r] = m.split(" ");
      expect(known.has(l!) && known.has(r!) && known.has(l! + r!), m).toBe(true);
    }
    // Beyond what the corpus teaches, rare merges fill a larger vocabulary.
    expect(buildTokenizer(4096).tokens.length).toBe(4096);
  });
});

describe("presets and ensureSyntheticModel", () => {
  it("has tiny/small/medium presets of the documented sizes", () => {
    const size = (p: "tiny" | "small" | "medium", a: (typeof SYNTHETIC_ARCHS)[number]) =>
      Number(planSyntheticModel(syntheticPreset(p, a)).plan.totalSize) / 2 ** 20;
    for (const arch of SYNTHETIC_ARCHS) {
      expect(size("tiny", arch)).toBeLessThan(1.5);
      if (!["qwen3moe", "qwen2moe", "mixtral", "qwen35moe"].includes(arch)) continue; // tiny only
      expect(size("small", arch)).toBeGreaterThan(30);
      expect(size("small", arch)).toBeLessThan(80);
    }
    expect(size("medium", "qwen3moe")).toBeGreaterThan(350);
    expect(size("medium", "qwen3moe")).toBeLessThan(700);
    expect(() => syntheticPreset("medium", "mixtral")).toThrow(/exists for qwen3moe/);
  });

  it("has draft presets that share their target's tokenizer and language model at a fraction of its size", () => {
    for (const target of ["small", "medium"] as const) {
      const t = syntheticPreset(target);
      const d = syntheticPreset(`${target}-draft`);
      // the tokenizer is a function of vocab, the language model (token_embd, output) of vocab,
      // nEmbd, seed and logitStd: llama-server accepts the draft, and its logits track the target's
      for (const key of ["arch", "seed", "vocab", "nEmbd", "logitStd", "types"] as const) {
        expect(d[key], `${target}-draft ${key}`).toEqual(t[key]);
      }
      expect(d.nLayer).toBe(1);
      const size = (o: typeof t) => Number(planSyntheticModel(o).plan.totalSize);
      expect(size(d)).toBeLessThan(size(t) / 10);
    }
    expect(() => syntheticPreset("small-draft", "mixtral")).toThrow(/exists for qwen3moe/);
  });

  it("generates once, then reuses the file; the key follows options and generator", async () => {
    const cacheDir = join(tmp.dir, "cache");
    const first = await ensureSyntheticModel("tiny", { cacheDir, arch: "qwen2moe" });
    expect(first.created).toBe(true);
    const again = await ensureSyntheticModel("tiny", { cacheDir, arch: "qwen2moe" });
    expect(again).toMatchObject({ created: false, path: first.path, size: first.size });
    const h = await readGguf(first.path);
    expect(getString(h, "general.architecture")).toBe("qwen2moe");
    const other = await ensureSyntheticModel("tiny", { cacheDir, arch: "qwen2moe", seed: 7 });
    expect(other.path).not.toBe(first.path);
    expect(syntheticModelKey(syntheticPreset("tiny"))).not.toBe(
      syntheticModelKey({ ...syntheticPreset("tiny"), seed: 7 }),
    );
    // Concurrent callers share one generation.
    const [x, y] = await Promise.all([
      ensureSyntheticModel("tiny", { cacheDir, arch: "mixtral" }),
      ensureSyntheticModel("tiny", { cacheDir, arch: "mixtral" }),
    ]);
    expect(x.path).toBe(y.path);
    expect(readdirSync(cacheDir).filter((f) => f.endsWith(".tmp"))).toEqual([]);
  });
});

#!/usr/bin/env node
// Writes the K-quant (and other non-gguf-py) models for scripts/gpu-check.py: gguf-py can quantize
// only F16/BF16/Q4_0..Q8_0, so the types real MoE files use most (Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4)
// are quantized here by @moeswarm/shard's quantizers (bit-exact with ggml's, test/quant-ggml) and
// carried to the GPU machine. One layer of a qwen3moe-shaped model: n_embd 512, n_ff 256, 16 experts.
//
//   node scripts/gpu-fixtures.mjs <dir>     then  gpu-check.py --model-files <dir>/*.gguf
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { GgmlType, quantize, ggufValue as v, writeGguf } from "@moeswarm/shard";

const dir = process.argv[2];
if (!dir) {
  console.error("usage: node scripts/gpu-fixtures.mjs <dir>");
  process.exit(2);
}
mkdirSync(dir, { recursive: true });
const nEmbd = 512;
const nFf = 256;
const nExpert = 16;

// a seeded Gaussian (xorshift32 + Box-Muller), so every run writes the same files
function gaussian(n, seed, scale) {
  const out = new Float32Array(n);
  let x = seed >>> 0 || 1;
  const u = () => {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    return (x + 1) / 4294967297;
  };
  for (let i = 0; i < n; i += 2) {
    const r = Math.sqrt(-2 * Math.log(u()));
    const t = 2 * Math.PI * u();
    out[i] = r * Math.cos(t) * scale;
    if (i + 1 < n) out[i + 1] = r * Math.sin(t) * scale;
  }
  return out;
}

for (const [name, type] of [
  ["q4_k", GgmlType.Q4_K],
  ["q5_k", GgmlType.Q5_K],
  ["q6_k", GgmlType.Q6_K],
  ["iq4_xs", GgmlType.IQ4_XS],
  ["mxfp4", GgmlType.MXFP4],
]) {
  const tensors = [];
  for (const [i, [t, ne0, ne1]] of [
    ["ffn_gate_exps", nEmbd, nFf],
    ["ffn_up_exps", nEmbd, nFf],
    ["ffn_down_exps", nFf, nEmbd],
  ].entries()) {
    const values = gaussian(ne0 * ne1 * nExpert, 1000 + 17 * i + type, 1 / Math.sqrt(ne0));
    tensors.push({
      name: `blk.0.${t}.weight`,
      type,
      shape: [ne0, ne1, nExpert],
      data: quantize(type, values, ne0),
    });
  }
  const path = join(dir, `check-${name}.gguf`);
  await writeGguf(
    {
      metadata: {
        "general.architecture": v.str("qwen3moe"),
        "general.name": v.str(`gpu-check-${name}`),
        "qwen3moe.expert_count": v.u32(nExpert),
        "qwen3moe.expert_used_count": v.u32(8),
        "qwen3moe.embedding_length": v.u32(nEmbd),
        "qwen3moe.expert_feed_forward_length": v.u32(nFf),
      },
      tensors,
    },
    path,
  );
  console.log(path);
}

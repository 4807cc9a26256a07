// Test fixtures for the offload planner: GGUF headers of Qwen3.5-MoE-shaped models (the hybrid
// `qwen35moe` architecture of the pinned llama.cpp) with the tensor types llama-quantize gives a
// Q4_K_M file, written header-only (sparse) with the shard writer.
import { GgmlType } from "../src/ggml-type.js";
import { GgufValueType } from "../src/gguf-constants.js";
import { type GgufMetadataValue, ggufValue } from "../src/gguf-metadata.js";
import type { GgufWriteInput, GgufWriteTensor } from "../src/gguf-writer.js";

export interface Qwen35MoeConfig {
  nLayer: number;
  nEmbd: number;
  nHead: number;
  nHeadKv: number;
  headDim: number;
  nExpert: number;
  nExpertUsed: number;
  nFfExp: number;
  nFfShexp: number;
  vocab: number;
  linearKeyHeads: number;
  linearValueHeads: number;
  linearHeadDim: number;
  convKernel: number;
  fullAttentionInterval: number;
  contextLength: number;
  /** MTP blocks appended after the trunk (`nextn_predict_layers`). */
  nextn?: number;
}

/**
 * Qwen/Qwen3.5-122B-A10B (config.json, text_config): 48 layers, hidden 3072, 32 query heads and
 * 2 KV heads of 256 on every 4th layer (gated attention), Gated DeltaNet on the others with 16
 * key heads and 64 value heads of 128 and a 4-tap conv, 256 experts of width 1024 with 8 used,
 * a shared expert of 1024, vocabulary 248320, 262144 context.
 */
export const QWEN35_122B: Qwen35MoeConfig = {
  nLayer: 48,
  nEmbd: 3072,
  nHead: 32,
  nHeadKv: 2,
  headDim: 256,
  nExpert: 256,
  nExpertUsed: 8,
  nFfExp: 1024,
  nFfShexp: 1024,
  vocab: 248320,
  linearKeyHeads: 16,
  linearValueHeads: 64,
  linearHeadDim: 128,
  convKernel: 4,
  fullAttentionInterval: 4,
  contextLength: 262144,
};

/** A tiny model of the same architecture that llama.cpp loads (every ne[0] a multiple of 256). */
export const QWEN35_TINY: Qwen35MoeConfig = {
  nLayer: 8,
  nEmbd: 256,
  nHead: 2,
  nHeadKv: 1,
  headDim: 128,
  nExpert: 8,
  nExpertUsed: 2,
  nFfExp: 256,
  nFfShexp: 256,
  vocab: 512,
  linearKeyHeads: 1,
  linearValueHeads: 2,
  linearHeadDim: 128,
  convKernel: 4,
  fullAttentionInterval: 4,
  contextLength: 4096,
};

// llama-quant.cpp: use_more_bits(i, n) picks the layers Q4_K_M gives Q6_K.
function useMoreBits(i: number, n: number): boolean {
  return i < Math.floor(n / 8) || i >= Math.floor((7 * n) / 8) || (i - Math.floor(n / 8)) % 3 === 2;
}

/**
 * The type llama_tensor_get_type gives a tensor for LLAMA_FTYPE_MOSTLY_Q4_K_M (pinned
 * src/llama-quant.cpp) when the source holds these tensors in F32 where the converter forces it
 * (1-D, norms, non-`.weight`, ffn_gate_inp, ssm_conv1d) and BF16 elsewhere: output Q6_K;
 * attn_v and attn_qkv (both "attention-v-like", counted in file order) and ffn_down (routed and
 * shared, by layer) Q6_K on use_more_bits layers, else Q4_K; every other 2-D weight Q4_K.
 */
export function q4kmType(
  name: string,
  shape: readonly number[],
  nLayerAll: number,
  iAttnV: number,
  nAttnV: number,
): GgmlType {
  const layer = /^blk\.(\d+)\./.exec(name);
  const unquantised =
    shape.length < 2 ||
    !name.endsWith("weight") ||
    name.includes("_norm.weight") ||
    name.includes("ffn_gate_inp.weight") ||
    name.includes("ssm_conv1d");
  if (unquantised) return GgmlType.F32;
  if (name === "output.weight") return GgmlType.Q6_K;
  if (name.includes("attn_qkv.weight") || name.includes("attn_v.weight")) {
    return useMoreBits(iAttnV, nAttnV) ? GgmlType.Q6_K : GgmlType.Q4_K;
  }
  if (name.includes("ffn_down") && layer) {
    return useMoreBits(Number(layer[1]), nLayerAll) ? GgmlType.Q6_K : GgmlType.Q4_K;
  }
  return GgmlType.Q4_K;
}

/** Tensor names and shapes in the order the converter writes them, as llama.cpp loads qwen35moe. */
export function qwen35moeShapes(c: Qwen35MoeConfig): Array<{ name: string; shape: number[] }> {
  const out: Array<{ name: string; shape: number[] }> = [];
  const add = (name: string, shape: number[]) => out.push({ name, shape });
  const nAll = c.nLayer + (c.nextn ?? 0);
  const keyDim = c.linearKeyHeads * c.linearHeadDim;
  const valueDim = c.linearValueHeads * c.linearHeadDim;
  const convDim = 2 * keyDim + valueDim;
  add("token_embd.weight", [c.nEmbd, c.vocab]);
  for (let il = 0; il < nAll; il++) {
    const b = `blk.${il}.`;
    const mtp = il >= c.nLayer;
    const recurrent = !mtp && (il + 1) % c.fullAttentionInterval !== 0;
    add(`${b}attn_norm.weight`, [c.nEmbd]);
    if (recurrent) {
      add(`${b}attn_qkv.weight`, [c.nEmbd, convDim]);
      add(`${b}attn_gate.weight`, [c.nEmbd, valueDim]);
      add(`${b}ssm_conv1d.weight`, [c.convKernel, convDim]);
      add(`${b}ssm_dt.bias`, [c.linearValueHeads]);
      add(`${b}ssm_a`, [c.linearValueHeads]);
      add(`${b}ssm_beta.weight`, [c.nEmbd, c.linearValueHeads]);
      add(`${b}ssm_alpha.weight`, [c.nEmbd, c.linearValueHeads]);
      add(`${b}ssm_norm.weight`, [c.linearHeadDim]);
      add(`${b}ssm_out.weight`, [valueDim, c.nEmbd]);
    } else {
      add(`${b}attn_q.weight`, [c.nEmbd, c.nHead * c.headDim * 2]);
      add(`${b}attn_k.weight`, [c.nEmbd, c.nHeadKv * c.headDim]);
      add(`${b}attn_v.weight`, [c.nEmbd, c.nHeadKv * c.headDim]);
      add(`${b}attn_output.weight`, [c.nHead * c.headDim, c.nEmbd]);
      add(`${b}attn_q_norm.weight`, [c.headDim]);
      add(`${b}attn_k_norm.weight`, [c.headDim]);
    }
    add(`${b}post_attention_norm.weight`, [c.nEmbd]);
    add(`${b}ffn_gate_inp.weight`, [c.nEmbd, c.nExpert]);
    add(`${b}ffn_gate_exps.weight`, [c.nEmbd, c.nFfExp, c.nExpert]);
    add(`${b}ffn_up_exps.weight`, [c.nEmbd, c.nFfExp, c.nExpert]);
    add(`${b}ffn_down_exps.weight`, [c.nFfExp, c.nEmbd, c.nExpert]);
    add(`${b}ffn_gate_inp_shexp.weight`, [c.nEmbd]);
    add(`${b}ffn_gate_shexp.weight`, [c.nEmbd, c.nFfShexp]);
    add(`${b}ffn_up_shexp.weight`, [c.nEmbd, c.nFfShexp]);
    add(`${b}ffn_down_shexp.weight`, [c.nFfShexp, c.nEmbd]);
    if (mtp) {
      add(`${b}nextn.eh_proj.weight`, [2 * c.nEmbd, c.nEmbd]);
      add(`${b}nextn.enorm.weight`, [c.nEmbd]);
      add(`${b}nextn.hnorm.weight`, [c.nEmbd]);
      add(`${b}nextn.shared_head_norm.weight`, [c.nEmbd]);
    }
  }
  add("output_norm.weight", [c.nEmbd]);
  add("output.weight", [c.nEmbd, c.vocab]);
  return out;
}

/**
 * The GGUF input of a Q4_K_M qwen35moe model: the metadata llama.cpp's loader reads (no
 * tokenizer: `tokenizer.ggml.model = "none"` with `<arch>.vocab_size`, for which llama.cpp makes
 * dummy tokens) and the tensors without data, for `writeGguf(..., { headerOnly: true })`.
 */
export function qwen35moeModel(c: Qwen35MoeConfig, name = "Qwen3.5-122B-A10B-shaped"): GgufWriteInput {
  const v = ggufValue;
  const k = (key: string) => `qwen35moe.${key}`;
  const nAll = c.nLayer + (c.nextn ?? 0);
  const md = new Map<string, GgufMetadataValue>([
    ["general.architecture", v.str("qwen35moe")],
    ["general.type", v.str("model")],
    ["general.name", v.str(name)],
    ["general.file_type", v.u32(15)], // LLAMA_FTYPE_MOSTLY_Q4_K_M
    ["general.quantization_version", v.u32(2)],
    [k("block_count"), v.u32(nAll)],
    [k("context_length"), v.u32(c.contextLength)],
    [k("embedding_length"), v.u32(c.nEmbd)],
    [k("attention.head_count"), v.u32(c.nHead)],
    [k("attention.head_count_kv"), v.u32(c.nHeadKv)],
    [k("attention.key_length"), v.u32(c.headDim)],
    [k("attention.value_length"), v.u32(c.headDim)],
    [k("attention.layer_norm_rms_epsilon"), v.f32(1e-6)],
    [k("rope.freq_base"), v.f32(10_000_000)],
    [k("rope.dimension_count"), v.u32(c.headDim / 4)],
    [k("rope.dimension_sections"), v.array(GgufValueType.INT32, [11, 11, 10, 0])],
    [k("expert_count"), v.u32(c.nExpert)],
    [k("expert_used_count"), v.u32(c.nExpertUsed)],
    [k("expert_feed_forward_length"), v.u32(c.nFfExp)],
    [k("expert_shared_feed_forward_length"), v.u32(c.nFfShexp)],
    [k("ssm.conv_kernel"), v.u32(c.convKernel)],
    [k("ssm.inner_size"), v.u32(c.linearValueHeads * c.linearHeadDim)],
    [k("ssm.state_size"), v.u32(c.linearHeadDim)],
    [k("ssm.time_step_rank"), v.u32(c.linearValueHeads)],
    [k("ssm.group_count"), v.u32(c.linearKeyHeads)],
    [k("full_attention_interval"), v.u32(c.fullAttentionInterval)],
    [k("vocab_size"), v.u32(c.vocab)],
    ["tokenizer.ggml.model", v.str("none")],
  ]);
  if (c.nextn) md.set(k("nextn_predict_layers"), v.u32(c.nextn));
  const shapes = qwen35moeShapes(c);
  const attnV = (n: string) => n.endsWith("attn_v.weight") || n.endsWith("attn_qkv.weight");
  const nAttnV = shapes.filter((s) => attnV(s.name)).length;
  let iAttnV = 0;
  const tensors: GgufWriteTensor[] = shapes.map(({ name: tensorName, shape }) => {
    const type = q4kmType(tensorName, shape, nAll, iAttnV, nAttnV);
    if (attnV(tensorName)) iAttnV++;
    return { name: tensorName, shape, type };
  });
  return { metadata: md, tensors };
}

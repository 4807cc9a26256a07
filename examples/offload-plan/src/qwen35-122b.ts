// A GGUF header shaped like a Q4_K_M file of Qwen/Qwen3.5-122B-A10B, built from the published
// configuration with the shard writer. Header only: the weights are a sparse hole, so the 74 GB
// file costs a few KB of disk and the planner reads it like the real thing.
import {
  GgmlType,
  type GgufMetadataValue,
  GgufValueType,
  type GgufWriteInput,
  type GgufWriteTensor,
  ggufValue,
  writeGguf,
} from "@moeswarm/shard";

/** The text model of Qwen/Qwen3.5-122B-A10B (config.json `text_config`). */
export const QWEN35_122B_A10B = {
  hiddenSize: 3072,
  numHiddenLayers: 48,
  // Gated attention on every 4th layer (3, 7, ..., 47), Gated DeltaNet on the others.
  fullAttentionInterval: 4,
  numAttentionHeads: 32,
  numKeyValueHeads: 2,
  headDim: 256,
  linearNumKeyHeads: 16,
  linearNumValueHeads: 64,
  linearKeyHeadDim: 128,
  linearValueHeadDim: 128,
  linearConvKernelDim: 4,
  numExperts: 256,
  numExpertsPerTok: 8,
  moeIntermediateSize: 1024,
  sharedExpertIntermediateSize: 1024,
  vocabSize: 248320,
  maxPositionEmbeddings: 262144,
  ropeTheta: 10_000_000,
  partialRotaryFactor: 0.25,
  rmsNormEps: 1e-6,
} as const;

type Config = typeof QWEN35_122B_A10B;

// llama-quant.cpp use_more_bits: the layers Q4_K_M gives Q6_K for attn_v-like and ffn_down tensors.
function useMoreBits(i: number, n: number): boolean {
  return i < Math.floor(n / 8) || i >= Math.floor((7 * n) / 8) || (i - Math.floor(n / 8)) % 3 === 2;
}

/**
 * The tensor type of a typical Q4_K_M file (llama-quantize of the pinned llama.cpp from a BF16
 * conversion): 1-D tensors, norms, biases, the router and the conv kernel stay F32; output Q6_K;
 * attn_v and the linear layers' fused attn_qkv Q6_K on use_more_bits layers; ffn_down (routed and
 * shared) Q6_K on use_more_bits layers; every other matrix Q4_K.
 */
function q4kmType(name: string, shape: readonly number[], layer: number, nLayer: number): GgmlType {
  if (
    shape.length < 2 ||
    !name.endsWith(".weight") ||
    name.includes("_norm.") ||
    name.includes("ffn_gate_inp.") ||
    name.includes("ssm_conv1d")
  ) {
    return GgmlType.F32;
  }
  if (name === "output.weight") return GgmlType.Q6_K;
  if (/attn_(v|qkv)\.weight$/.test(name) || name.includes("ffn_down")) {
    return useMoreBits(layer, nLayer) ? GgmlType.Q6_K : GgmlType.Q4_K;
  }
  return GgmlType.Q4_K;
}

/** Metadata and tensor list of the model as llama.cpp's `qwen35moe` loader expects them. */
export function qwen35MoeHeader(c: Config = QWEN35_122B_A10B): GgufWriteInput {
  const v = ggufValue;
  const k = (key: string) => `qwen35moe.${key}`;
  const metadata = new Map<string, GgufMetadataValue>([
    ["general.architecture", v.str("qwen35moe")],
    ["general.name", v.str("Qwen3.5-122B-A10B (shape only)")],
    ["general.file_type", v.u32(15)], // LLAMA_FTYPE_MOSTLY_Q4_K_M
    ["general.quantization_version", v.u32(2)],
    [k("block_count"), v.u32(c.numHiddenLayers)],
    [k("context_length"), v.u32(c.maxPositionEmbeddings)],
    [k("embedding_length"), v.u32(c.hiddenSize)],
    [k("attention.head_count"), v.u32(c.numAttentionHeads)],
    [k("attention.head_count_kv"), v.u32(c.numKeyValueHeads)],
    [k("attention.key_length"), v.u32(c.headDim)],
    [k("attention.value_length"), v.u32(c.headDim)],
    [k("attention.layer_norm_rms_epsilon"), v.f32(c.rmsNormEps)],
    [k("rope.freq_base"), v.f32(c.ropeTheta)],
    [k("rope.dimension_count"), v.u32(c.headDim * c.partialRotaryFactor)],
    [k("rope.dimension_sections"), v.array(GgufValueType.INT32, [11, 11, 10, 0])],
    [k("expert_count"), v.u32(c.numExperts)],
    [k("expert_used_count"), v.u32(c.numExpertsPerTok)],
    [k("expert_feed_forward_length"), v.u32(c.moeIntermediateSize)],
    [k("expert_shared_feed_forward_length"), v.u32(c.sharedExpertIntermediateSize)],
    [k("ssm.conv_kernel"), v.u32(c.linearConvKernelDim)],
    [k("ssm.inner_size"), v.u32(c.linearNumValueHeads * c.linearValueHeadDim)],
    [k("ssm.state_size"), v.u32(c.linearKeyHeadDim)],
    [k("ssm.time_step_rank"), v.u32(c.linearNumValueHeads)],
    [k("ssm.group_count"), v.u32(c.linearNumKeyHeads)],
    [k("full_attention_interval"), v.u32(c.fullAttentionInterval)],
    // No tokenizer in a shape-only header: llama.cpp makes vocab_size dummy tokens for "none".
    [k("vocab_size"), v.u32(c.vocabSize)],
    ["tokenizer.ggml.model", v.str("none")],
  ]);

  const n = c.numHiddenLayers;
  const keyDim = c.linearNumKeyHeads * c.linearKeyHeadDim;
  const valueDim = c.linearNumValueHeads * c.linearValueHeadDim;
  const convDim = 2 * keyDim + valueDim;
  const tensors: GgufWriteTensor[] = [];
  const add = (name: string, shape: number[], layer = 0) =>
    tensors.push({ name, shape, type: q4kmType(name, shape, layer, n) });

  add("token_embd.weight", [c.hiddenSize, c.vocabSize]);
  for (let il = 0; il < n; il++) {
    const b = `blk.${il}.`;
    const t = (name: string, shape: number[]) => add(b + name, shape, il);
    t("attn_norm.weight", [c.hiddenSize]);
    if ((il + 1) % c.fullAttentionInterval !== 0) {
      // Gated DeltaNet (linear attention).
      t("attn_qkv.weight", [c.hiddenSize, convDim]);
      t("attn_gate.weight", [c.hiddenSize, valueDim]);
      t("ssm_conv1d.weight", [c.linearConvKernelDim, convDim]);
      t("ssm_dt.bias", [c.linearNumValueHeads]);
      t("ssm_a", [c.linearNumValueHeads]);
      t("ssm_beta.weight", [c.hiddenSize, c.linearNumValueHeads]);
      t("ssm_alpha.weight", [c.hiddenSize, c.linearNumValueHeads]);
      t("ssm_norm.weight", [c.linearValueHeadDim]);
      t("ssm_out.weight", [valueDim, c.hiddenSize]);
    } else {
      // Gated attention: the query projection also yields the output gate.
      t("attn_q.weight", [c.hiddenSize, c.numAttentionHeads * c.headDim * 2]);
      t("attn_k.weight", [c.hiddenSize, c.numKeyValueHeads * c.headDim]);
      t("attn_v.weight", [c.hiddenSize, c.numKeyValueHeads * c.headDim]);
      t("attn_output.weight", [c.numAttentionHeads * c.headDim, c.hiddenSize]);
      t("attn_q_norm.weight", [c.headDim]);
      t("attn_k_norm.weight", [c.headDim]);
    }
    t("post_attention_norm.weight", [c.hiddenSize]);
    t("ffn_gate_inp.weight", [c.hiddenSize, c.numExperts]);
    t("ffn_gate_exps.weight", [c.hiddenSize, c.moeIntermediateSize, c.numExperts]);
    t("ffn_up_exps.weight", [c.hiddenSize, c.moeIntermediateSize, c.numExperts]);
    t("ffn_down_exps.weight", [c.moeIntermediateSize, c.hiddenSize, c.numExperts]);
    t("ffn_gate_inp_shexp.weight", [c.hiddenSize]);
    t("ffn_gate_shexp.weight", [c.hiddenSize, c.sharedExpertIntermediateSize]);
    t("ffn_up_shexp.weight", [c.hiddenSize, c.sharedExpertIntermediateSize]);
    t("ffn_down_shexp.weight", [c.sharedExpertIntermediateSize, c.hiddenSize]);
  }
  add("output_norm.weight", [c.hiddenSize]);
  add("output.weight", [c.hiddenSize, c.vocabSize]);
  return { metadata, tensors };
}

/** Writes the header-only (sparse) file; returns its full size in bytes. */
export async function writeQwen35Header(path: string): Promise<bigint> {
  const plan = await writeGguf(qwen35MoeHeader(), path, { headerOnly: true });
  return plan.totalSize;
}

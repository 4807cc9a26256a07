// The `glm4moe` family (GLM-4.5, GLM-4.5-Air): a leading dense layer, then MoE layers whose
// router takes the sigmoid of its logits, selects the top k of those plus a per-expert bias
// (exp_probs_b, DeepSeek-V3's "noaux_tc" balancing), normalises the k weights and scales them;
// one shared expert beside the routed ones. What the pinned llama.cpp's src/models/glm4-moe.cpp
// reads and creates (trunk only, no MTP block), with GLM's attention biases and half-rotary heads.
import { InvalidArgumentError } from "@moeswarm/core";
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";

export interface Glm4MoeDims {
  nLayer: number;
  nEmbd: number;
  nHead: number;
  nHeadKv: number;
  headDim: number;
  nFfExp: number;
  nExpert: number;
  nExpertUsed: number;
  /** Width of the shared experts together: a multiple of nFfExp (expert_shared_count of them). */
  nFfShared: number;
}

/** Dense layers before the first MoE layer (GLM-4.5-Air's first_k_dense_replace). */
export const GLM4MOE_DENSE_LEAD = 1;
/** routed_scaling_factor of GLM-4.5: the normalised expert weights are multiplied by it. */
export const GLM4MOE_WEIGHTS_SCALE = 2.5;

/** The dense FFN width of the leading layers (feed_forward_length). */
export const glm4moeDenseFf = (d: Glm4MoeDims) => d.nFfExp * d.nExpertUsed;

export function glm4moeMetadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  d: Glm4MoeDims,
): void {
  if (d.nFfShared % d.nFfExp !== 0) {
    throw new InvalidArgumentError(
      `glm4moe needs nFfShared (${d.nFfShared}) to be a multiple of nFfExp (${d.nFfExp})`,
    );
  }
  if (d.nLayer <= GLM4MOE_DENSE_LEAD)
    throw new InvalidArgumentError(`glm4moe needs more than ${GLM4MOE_DENSE_LEAD} layer(s)`);
  const v = ggufValue;
  md.set(k("attention.key_length"), v.u32(d.headDim));
  md.set(k("attention.value_length"), v.u32(d.headDim));
  md.set(k("rope.dimension_count"), v.u32(d.headDim / 2));
  md.set(k("expert_feed_forward_length"), v.u32(d.nFfExp));
  md.set(k("expert_shared_count"), v.u32(d.nFfShared / d.nFfExp));
  md.set(k("leading_dense_block_count"), v.u32(GLM4MOE_DENSE_LEAD));
  md.set(k("expert_weights_scale"), v.f32(GLM4MOE_WEIGHTS_SCALE));
  md.set(k("expert_weights_norm"), v.bool(true));
  md.set(k("expert_gating_func"), v.u32(2)); // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
}

export function glm4moeLayerTensors(add: FamilyAdd, d: Glm4MoeDims, il: number): void {
  const b = `blk.${il}.`;
  const inv = (n: number) => 1 / Math.sqrt(n);
  const norm = (name: string, n: number) => add(name, [n], "norm", 0.1, 1);
  const nq = d.nHead * d.headDim;
  const nkv = d.nHeadKv * d.headDim;
  norm(`${b}attn_norm.weight`, d.nEmbd);
  add(`${b}attn_q.weight`, [d.nEmbd, nq], "attention", inv(d.nEmbd));
  add(`${b}attn_k.weight`, [d.nEmbd, nkv], "attention", inv(d.nEmbd));
  add(`${b}attn_v.weight`, [d.nEmbd, nkv], "attention", inv(d.nEmbd));
  add(`${b}attn_q.bias`, [nq], "F32", 0.02);
  add(`${b}attn_k.bias`, [nkv], "F32", 0.02);
  add(`${b}attn_v.bias`, [nkv], "F32", 0.02);
  add(`${b}attn_output.weight`, [nq, d.nEmbd], "attention", inv(nq));
  norm(`${b}post_attention_norm.weight`, d.nEmbd);
  if (il < GLM4MOE_DENSE_LEAD) {
    const nFf = glm4moeDenseFf(d);
    add(`${b}ffn_gate.weight`, [d.nEmbd, nFf], "sharedExpert", inv(d.nEmbd));
    add(`${b}ffn_up.weight`, [d.nEmbd, nFf], "sharedExpert", inv(d.nEmbd));
    add(`${b}ffn_down.weight`, [nFf, d.nEmbd], "sharedExpert", inv(nFf));
    return;
  }
  add(`${b}ffn_gate_inp.weight`, [d.nEmbd, d.nExpert], "router", 2 * inv(d.nEmbd));
  // Added to the sigmoid scores for the selection only, not to the weights.
  add(`${b}exp_probs_b.bias`, [d.nExpert], "F32", 0.2);
  add(`${b}ffn_gate_exps.weight`, [d.nEmbd, d.nFfExp, d.nExpert], "experts", inv(d.nEmbd), 0, true);
  add(`${b}ffn_up_exps.weight`, [d.nEmbd, d.nFfExp, d.nExpert], "experts", inv(d.nEmbd), 0, true);
  add(`${b}ffn_down_exps.weight`, [d.nFfExp, d.nEmbd, d.nExpert], "experts", inv(d.nFfExp), 0, true);
  add(`${b}ffn_gate_shexp.weight`, [d.nEmbd, d.nFfShared], "sharedExpert", inv(d.nEmbd));
  add(`${b}ffn_up_shexp.weight`, [d.nEmbd, d.nFfShared], "sharedExpert", inv(d.nEmbd));
  add(`${b}ffn_down_shexp.weight`, [d.nFfShared, d.nEmbd], "sharedExpert", inv(d.nFfShared));
}

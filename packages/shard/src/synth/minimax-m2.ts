// The `minimax-m2` family (MiniMax-M2, M2.1, M2.5: 230B-A10B, 62 layers): every layer MoE, a
// sigmoid router whose top k are chosen with a per-expert selection bias (exp_probs_b) and then
// normalised, no shared expert; attention with RMS norms over the whole query and key widths
// (not per head) and RoPE on half of each head. What the pinned llama.cpp's
// src/models/minimax-m2.cpp reads and creates.
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";
import {
  attentionTensors,
  type BaseMoeDims,
  headLengthMetadata,
  normTensor,
  routedExpertTensors,
  routerTensor,
} from "./layer-parts.js";

export function minimaxM2Metadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  d: BaseMoeDims,
): void {
  const v = ggufValue;
  headLengthMetadata(md, k, d.headDim);
  // rotary_dim 64 of head_dim 128 in MiniMax-M2's config
  md.set(k("rope.dimension_count"), v.u32(d.headDim / 2));
  // load_arch_tensors shapes the experts with feed_forward_length (n_ff), which MiniMax's converter
  // writes as the expert width (intermediate_size 1536); expert_feed_forward_length is read too
  md.set(k("feed_forward_length"), v.u32(d.nFfExp));
  md.set(k("expert_feed_forward_length"), v.u32(d.nFfExp));
  md.set(k("expert_gating_func"), v.u32(2)); // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
}

export function minimaxM2LayerTensors(add: FamilyAdd, d: BaseMoeDims, il: number): void {
  const b = `blk.${il}.`;
  const nq = d.nHead * d.headDim;
  const nkv = d.nHeadKv * d.headDim;
  normTensor(add, `${b}attn_norm.weight`, d.nEmbd);
  attentionTensors(add, b, { nEmbd: d.nEmbd, nq, nkv });
  normTensor(add, `${b}attn_q_norm.weight`, nq);
  normTensor(add, `${b}attn_k_norm.weight`, nkv);
  normTensor(add, `${b}ffn_norm.weight`, d.nEmbd);
  routerTensor(add, b, d.nEmbd, d.nExpert);
  // Added to the sigmoid scores for the selection only, not to the weights.
  add(`${b}exp_probs_b.bias`, [d.nExpert], "F32", 0.2);
  routedExpertTensors(add, b, d, "gate-up-down");
}

// The `llama4` family (Llama 4 Scout/Maverick): MoE on every `interleave_moe_layer_step`-th layer
// (Maverick: every 2nd, dense FFNs between), one routed expert per token chosen on the raw router
// logits, whose sigmoid weight multiplies the expert's *input* (llama-graph.cpp build_moe_ffn with
// weight_before_ffn), and a shared expert beside it. What the pinned llama.cpp's
// src/models/llama4.cpp reads and creates, with chunked attention (its default without a key).
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";
import {
  attentionTensors,
  type BaseMoeDims,
  ffnTensors,
  normTensor,
  routedExpertTensors,
  routerTensor,
} from "./layer-parts.js";

export interface Llama4Dims extends BaseMoeDims {
  nExpertUsed: number;
}

/** Maverick's pattern: a dense layer, then an MoE layer. */
export const LLAMA4_MOE_STEP = 2;

export const isLlama4MoeLayer = (il: number) => (il + 1) % LLAMA4_MOE_STEP === 0;
/** The dense layers' FFN width (feed_forward_length). */
export const llama4DenseFf = (d: Llama4Dims) => d.nFfExp * d.nExpertUsed;

export function llama4Metadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  d: Llama4Dims,
): void {
  const v = ggufValue;
  md.set(k("expert_feed_forward_length"), v.u32(d.nFfExp));
  md.set(k("interleave_moe_layer_step"), v.u32(LLAMA4_MOE_STEP));
  md.set(k("rope.dimension_count"), v.u32(d.headDim));
}

export function llama4LayerTensors(add: FamilyAdd, d: Llama4Dims, il: number): void {
  const b = `blk.${il}.`;
  normTensor(add, `${b}attn_norm.weight`, d.nEmbd);
  attentionTensors(add, b, { nEmbd: d.nEmbd, nq: d.nHead * d.headDim, nkv: d.nHeadKv * d.headDim });
  normTensor(add, `${b}ffn_norm.weight`, d.nEmbd);
  if (!isLlama4MoeLayer(il)) {
    ffnTensors(add, b, "", d.nEmbd, llama4DenseFf(d), "gate-down-up");
    return;
  }
  routerTensor(add, b, d.nEmbd, d.nExpert);
  routedExpertTensors(add, b, d, "gate-down-up");
  ffnTensors(add, b, "_shexp", d.nEmbd, d.nFfExp, "gate-down-up");
}

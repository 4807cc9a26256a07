// The `glm4moe` family (GLM-4.5, GLM-4.5-Air): a leading dense layer, then MoE layers whose
// router takes the sigmoid of its logits, selects the top k of those plus a per-expert bias
// (exp_probs_b, DeepSeek-V3's "noaux_tc" balancing), normalises the k weights and scales them;
// one shared expert beside the routed ones. What the pinned llama.cpp's src/models/glm4-moe.cpp
// reads and creates (trunk only, no MTP block), with GLM's attention biases and half-rotary heads.
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";
import {
  attentionTensors,
  type BaseMoeDims,
  checkSigmoidRouting,
  ffnTensors,
  headLengthMetadata,
  normTensor,
  routedExpertTensors,
  routerTensor,
  sigmoidRoutingMetadata,
} from "./layer-parts.js";

export interface Glm4MoeDims extends BaseMoeDims {
  nLayer: number;
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
  checkSigmoidRouting("glm4moe", d, GLM4MOE_DENSE_LEAD);
  headLengthMetadata(md, k, d.headDim);
  md.set(k("rope.dimension_count"), ggufValue.u32(d.headDim / 2));
  sigmoidRoutingMetadata(md, k, d, GLM4MOE_DENSE_LEAD, GLM4MOE_WEIGHTS_SCALE);
}

export function glm4moeLayerTensors(add: FamilyAdd, d: Glm4MoeDims, il: number): void {
  const b = `blk.${il}.`;
  const nq = d.nHead * d.headDim;
  normTensor(add, `${b}attn_norm.weight`, d.nEmbd);
  attentionTensors(add, b, { nEmbd: d.nEmbd, nq, nkv: d.nHeadKv * d.headDim, qkvBias: true });
  normTensor(add, `${b}post_attention_norm.weight`, d.nEmbd);
  if (il < GLM4MOE_DENSE_LEAD) {
    ffnTensors(add, b, "", d.nEmbd, glm4moeDenseFf(d), "gate-up-down");
    return;
  }
  routerTensor(add, b, d.nEmbd, d.nExpert);
  // Added to the sigmoid scores for the selection only, not to the weights.
  add(`${b}exp_probs_b.bias`, [d.nExpert], "F32", 0.2);
  routedExpertTensors(add, b, d, "gate-up-down");
  ffnTensors(add, b, "_shexp", d.nEmbd, d.nFfShared, "gate-up-down");
}

// The `gpt-oss` family (OpenAI gpt-oss-20b/120b): alternating sliding-window and full attention
// with biases and per-head attention sinks, routed experts with gate/up/down biases and the
// clamped swiglu_oai activation, a biased router whose softmax runs over the k selected experts
// (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT). What the pinned llama.cpp's
// src/models/openai-moe.cpp reads and creates; experts ship in MXFP4.
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

export type GptOssDims = BaseMoeDims;

/** gpt-oss's window: 128 tokens on every other layer (sliding_window_pattern 2). */
export const GPT_OSS_SLIDING_WINDOW = 128;

/** The keys openai-moe.cpp's load_arch_hparams reads beyond the generic ones. */
export function gptOssMetadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  d: GptOssDims,
): void {
  const v = ggufValue;
  headLengthMetadata(md, k, d.headDim);
  md.set(k("expert_feed_forward_length"), v.u32(d.nFfExp));
  md.set(k("attention.sliding_window"), v.u32(GPT_OSS_SLIDING_WINDOW));
}

/** One layer's tensors (openai-moe.cpp load_arch_tensors). */
export function gptOssLayerTensors(add: FamilyAdd, d: GptOssDims, il: number): void {
  const b = `blk.${il}.`;
  const nq = d.nHead * d.headDim;
  const nkv = d.nHeadKv * d.headDim;
  normTensor(add, `${b}attn_norm.weight`, d.nEmbd);
  attentionTensors(add, b, { nEmbd: d.nEmbd, nq, nkv, qkvBias: true, outputBias: true });
  // One extra logit per head in the softmax's denominator.
  add(`${b}attn_sinks.weight`, [d.nHead], "F32", 1);
  normTensor(add, `${b}post_attention_norm.weight`, d.nEmbd);
  routerTensor(add, b, d.nEmbd, d.nExpert);
  add(`${b}ffn_gate_inp.bias`, [d.nExpert], "F32", 0.5);
  routedExpertTensors(add, b, d, "gate-up-down");
  // Biases of the experts: one row per expert along ne[1], sliced with their experts.
  add(`${b}ffn_gate_exps.bias`, [d.nFfExp, d.nExpert], "F32", 0.1);
  add(`${b}ffn_up_exps.bias`, [d.nFfExp, d.nExpert], "F32", 0.1);
  add(`${b}ffn_down_exps.bias`, [d.nEmbd, d.nExpert], "F32", 0.02);
}

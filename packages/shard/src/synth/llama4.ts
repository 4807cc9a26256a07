// The `llama4` family (Llama 4 Scout/Maverick): MoE on every `interleave_moe_layer_step`-th layer
// (Maverick: every 2nd, dense FFNs between), one routed expert per token chosen on the raw router
// logits, whose sigmoid weight multiplies the expert's *input* (llama-graph.cpp build_moe_ffn with
// weight_before_ffn), and a shared expert beside it. What the pinned llama.cpp's
// src/models/llama4.cpp reads and creates, with chunked attention (its default without a key).
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";

export interface Llama4Dims {
  nEmbd: number;
  nHead: number;
  nHeadKv: number;
  headDim: number;
  nFfExp: number;
  nExpert: number;
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
  const inv = (n: number) => 1 / Math.sqrt(n);
  const norm = (name: string, n: number) => add(name, [n], "norm", 0.1, 1);
  const nq = d.nHead * d.headDim;
  const nkv = d.nHeadKv * d.headDim;
  norm(`${b}attn_norm.weight`, d.nEmbd);
  add(`${b}attn_q.weight`, [d.nEmbd, nq], "attention", inv(d.nEmbd));
  add(`${b}attn_k.weight`, [d.nEmbd, nkv], "attention", inv(d.nEmbd));
  add(`${b}attn_v.weight`, [d.nEmbd, nkv], "attention", inv(d.nEmbd));
  add(`${b}attn_output.weight`, [nq, d.nEmbd], "attention", inv(nq));
  norm(`${b}ffn_norm.weight`, d.nEmbd);
  if (!isLlama4MoeLayer(il)) {
    const nFf = llama4DenseFf(d);
    add(`${b}ffn_gate.weight`, [d.nEmbd, nFf], "sharedExpert", inv(d.nEmbd));
    add(`${b}ffn_down.weight`, [nFf, d.nEmbd], "sharedExpert", inv(nFf));
    add(`${b}ffn_up.weight`, [d.nEmbd, nFf], "sharedExpert", inv(d.nEmbd));
    return;
  }
  add(`${b}ffn_gate_inp.weight`, [d.nEmbd, d.nExpert], "router", 2 * inv(d.nEmbd));
  add(`${b}ffn_gate_exps.weight`, [d.nEmbd, d.nFfExp, d.nExpert], "experts", inv(d.nEmbd), 0, true);
  add(`${b}ffn_down_exps.weight`, [d.nFfExp, d.nEmbd, d.nExpert], "experts", inv(d.nFfExp), 0, true);
  add(`${b}ffn_up_exps.weight`, [d.nEmbd, d.nFfExp, d.nExpert], "experts", inv(d.nEmbd), 0, true);
  add(`${b}ffn_gate_shexp.weight`, [d.nEmbd, d.nFfExp], "sharedExpert", inv(d.nEmbd));
  add(`${b}ffn_down_shexp.weight`, [d.nFfExp, d.nEmbd], "sharedExpert", inv(d.nFfExp));
  add(`${b}ffn_up_shexp.weight`, [d.nEmbd, d.nFfExp], "sharedExpert", inv(d.nEmbd));
}

// Tensor groups several families share (attention projections, norms, the router, routed and
// shared experts, dense FFNs), written once so a family file only says what sets it apart. Each
// helper adds its tensors in the order the pinned llama.cpp's converter writes them; the order
// is part of the file's bytes, so a family picks the FFN order its real GGUFs use.
import { InvalidArgumentError } from "@moeswarm/core";
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";

/** The sizes every family's attention and experts are built from. */
export interface BaseMoeDims {
  nEmbd: number;
  nHead: number;
  nHeadKv: number;
  headDim: number;
  nFfExp: number;
  nExpert: number;
}

/** The spread that keeps a projection's output near unit variance for an input of width n. */
export const inv = (n: number) => 1 / Math.sqrt(n);

/** An F32 norm weight drawn around 1. */
export const normTensor = (add: FamilyAdd, name: string, n: number) => add(name, [n], "norm", 0.1, 1);

export interface AttentionParts {
  nEmbd: number;
  /** Width of attn_q's output (qwen35moe: twice the heads, query and gate interleaved). */
  nq: number;
  nkv: number;
  /** Width of attn_output's input (default nq). */
  nOut?: number;
  /** attn_{q,k,v}.bias (qwen2moe, gpt-oss, glm4moe). */
  qkvBias?: boolean;
  /** attn_output.bias (gpt-oss). */
  outputBias?: boolean;
}

/** attn_q, attn_k, attn_v (then their biases), attn_output (then its bias). */
export function attentionTensors(add: FamilyAdd, b: string, p: AttentionParts): void {
  const nOut = p.nOut ?? p.nq;
  add(`${b}attn_q.weight`, [p.nEmbd, p.nq], "attention", inv(p.nEmbd));
  add(`${b}attn_k.weight`, [p.nEmbd, p.nkv], "attention", inv(p.nEmbd));
  add(`${b}attn_v.weight`, [p.nEmbd, p.nkv], "attention", inv(p.nEmbd));
  if (p.qkvBias) {
    add(`${b}attn_q.bias`, [p.nq], "F32", 0.02);
    add(`${b}attn_k.bias`, [p.nkv], "F32", 0.02);
    add(`${b}attn_v.bias`, [p.nkv], "F32", 0.02);
  }
  add(`${b}attn_output.weight`, [nOut, p.nEmbd], "attention", inv(nOut));
  if (p.outputBias) add(`${b}attn_output.bias`, [p.nEmbd], "F32", 0.02);
}

/** Router logits with a spread of about 2: clear preferences, not one-hot. */
export function routerTensor(add: FamilyAdd, b: string, nEmbd: number, nExpert: number): void {
  add(`${b}ffn_gate_inp.weight`, [nEmbd, nExpert], "router", 2 * inv(nEmbd));
}

/** The order of an FFN's three projections in the family's files. */
export type FfnOrder = "gate-up-down" | "gate-down-up";

const ORDER: Record<FfnOrder, readonly ("gate" | "up" | "down")[]> = {
  "gate-up-down": ["gate", "up", "down"],
  "gate-down-up": ["gate", "down", "up"],
};

/** ffn_{gate,up,down}_exps: one slab per expert along ne[2], each drawn from its own stream. */
export function routedExpertTensors(
  add: FamilyAdd,
  b: string,
  d: Pick<BaseMoeDims, "nEmbd" | "nFfExp" | "nExpert">,
  order: FfnOrder,
): void {
  for (const part of ORDER[order]) {
    const [nIn, nOutW] = part === "down" ? [d.nFfExp, d.nEmbd] : [d.nEmbd, d.nFfExp];
    add(`${b}ffn_${part}_exps.weight`, [nIn, nOutW, d.nExpert], "experts", inv(nIn), 0, true);
  }
}

/**
 * A dense FFN of width nFf: ffn_{gate,up,down}`suffix` (`_shexp` for a shared expert, "" for a
 * dense layer), drawn in the sharedExpert class.
 */
export function ffnTensors(
  add: FamilyAdd,
  b: string,
  suffix: "" | "_shexp",
  nEmbd: number,
  nFf: number,
  order: FfnOrder,
): void {
  for (const part of ORDER[order]) {
    const [nIn, nOutW] = part === "down" ? [nFf, nEmbd] : [nEmbd, nFf];
    add(`${b}ffn_${part}${suffix}.weight`, [nIn, nOutW], "sharedExpert", inv(nIn));
  }
}

type SigmoidRoutingDims = { nLayer: number; nFfExp: number; nFfShared: number };

/** Refuses shapes the DeepSeek-V3-style routing (glm4moe, deepseek2) cannot express. */
export function checkSigmoidRouting(arch: string, d: SigmoidRoutingDims, lead: number): void {
  if (d.nFfShared % d.nFfExp !== 0) {
    throw new InvalidArgumentError(
      `${arch} needs nFfShared (${d.nFfShared}) to be a multiple of nFfExp (${d.nFfExp})`,
    );
  }
  if (d.nLayer <= lead) throw new InvalidArgumentError(`${arch} needs more than ${lead} layer(s)`);
}

/**
 * The keys of the DeepSeek-V3-style routing glm4moe and deepseek2 share: `lead` dense layers,
 * shared experts nFfShared wide together, sigmoid scores whose normalised top k are scaled.
 */
export function sigmoidRoutingMetadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  d: SigmoidRoutingDims,
  lead: number,
  scale: number,
): void {
  const v = ggufValue;
  md.set(k("expert_feed_forward_length"), v.u32(d.nFfExp));
  md.set(k("expert_shared_count"), v.u32(d.nFfShared / d.nFfExp));
  md.set(k("leading_dense_block_count"), v.u32(lead));
  md.set(k("expert_weights_scale"), v.f32(scale));
  md.set(k("expert_weights_norm"), v.bool(true));
  md.set(k("expert_gating_func"), v.u32(2)); // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
}

/** attention.key_length and attention.value_length, both headDim. */
export function headLengthMetadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  headDim: number,
): void {
  md.set(k("attention.key_length"), ggufValue.u32(headDim));
  md.set(k("attention.value_length"), ggufValue.u32(headDim));
}

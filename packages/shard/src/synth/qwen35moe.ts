// The `qwen35moe` family (Qwen3.5-MoE, the seeds' Qwen3.5-122B-A10B): a hybrid of Gated DeltaNet
// ("linear attention") layers and gated full-attention layers in a 3:1 pattern, every layer with
// 256-style routed experts plus a shared expert behind a sigmoid gate. What the pinned llama.cpp's
// src/models/qwen35moe.cpp reads (load_arch_hparams) and creates (load_arch_tensors), trunk only.
import { InvalidArgumentError } from "@moeswarm/core";
import { GgufValueType } from "../gguf-constants.js";
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";
import {
  attentionTensors,
  type BaseMoeDims,
  ffnTensors,
  headLengthMetadata,
  inv,
  normTensor,
  routedExpertTensors,
  routerTensor,
} from "./layer-parts.js";

/** The Gated DeltaNet layers' sizes (the `ssm.*` keys) and the layer pattern. */
export interface LinearAttentionOptions {
  /** Key heads (`ssm.group_count`; HF linear_num_key_heads). */
  keyHeads: number;
  /** Value heads (`ssm.time_step_rank`; HF linear_num_value_heads), a multiple of keyHeads. */
  valueHeads: number;
  /** Key and value head size (`ssm.state_size`; HF linear_key_head_dim = linear_value_head_dim). */
  headDim: number;
  /** Causal conv taps (`ssm.conv_kernel`). */
  convKernel: number;
  /** Every n-th layer is full attention, the others Gated DeltaNet (`full_attention_interval`). */
  fullAttentionInterval: number;
}

/** What the family needs of the resolved options. */
export interface Qwen35Dims extends BaseMoeDims {
  nLayer: number;
  nFfShared: number;
  linear: LinearAttentionOptions;
}

function int(value: unknown, what: string, max = 1 << 16): number {
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < 1 || value > max) {
    throw new InvalidArgumentError(`linear.${what} must be an integer in [1, ${max}], got ${String(value)}`);
  }
  return value;
}

/** Validates the linear-attention options (defaults: Qwen3.5's 4-tap conv, 3:1 pattern). */
export function resolveLinearAttention(
  linear: Partial<LinearAttentionOptions> | undefined,
  headDim: number,
): LinearAttentionOptions {
  const l = linear ?? {};
  const keyHeads = int(l.keyHeads ?? 1, "keyHeads");
  const valueHeads = int(l.valueHeads ?? keyHeads, "valueHeads");
  if (valueHeads % keyHeads !== 0)
    throw new InvalidArgumentError(
      `linear.valueHeads (${valueHeads}) must be a multiple of keyHeads (${keyHeads})`,
    );
  return {
    keyHeads,
    valueHeads,
    headDim: int(l.headDim ?? headDim, "headDim"),
    convKernel: int(l.convKernel ?? 4, "convKernel", 64),
    fullAttentionInterval: int(l.fullAttentionInterval ?? 4, "fullAttentionInterval", 1024),
  };
}

/** True for a Gated DeltaNet layer, as llama.cpp's default `is_recr` pattern says. */
export function isRecurrentLayer(il: number, linear: LinearAttentionOptions): boolean {
  return (il + 1) % linear.fullAttentionInterval !== 0;
}

/**
 * IMRoPE sections over the rotated half of the head, in Qwen3.5's proportions (11, 11, 10, 0 for
 * 64 rotated dims): text positions are the same in every section, so only their sum matters.
 */
export function ropeSections(nRot: number): number[] {
  const half = nRot / 2;
  const a = Math.round((half * 11) / 32);
  return [a, a, half - 2 * a, 0];
}

/** The keys qwen35moe's load_arch_hparams reads beyond the generic ones. */
export function qwen35moeMetadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  d: Qwen35Dims,
): void {
  const v = ggufValue;
  const l = d.linear;
  // Qwen3.5 rotates a quarter of each head (partial_rotary_factor 0.25).
  const nRot = Math.max(2, 2 * Math.floor(d.headDim / 8));
  headLengthMetadata(md, k, d.headDim);
  md.set(k("rope.dimension_count"), v.u32(nRot));
  md.set(k("rope.dimension_sections"), v.array(GgufValueType.INT32, ropeSections(nRot)));
  md.set(k("expert_feed_forward_length"), v.u32(d.nFfExp));
  md.set(k("expert_shared_feed_forward_length"), v.u32(d.nFfShared));
  md.set(k("ssm.conv_kernel"), v.u32(l.convKernel));
  md.set(k("ssm.inner_size"), v.u32(l.valueHeads * l.headDim));
  md.set(k("ssm.state_size"), v.u32(l.headDim));
  md.set(k("ssm.time_step_rank"), v.u32(l.valueHeads));
  md.set(k("ssm.group_count"), v.u32(l.keyHeads));
  md.set(k("full_attention_interval"), v.u32(l.fullAttentionInterval));
}

/** One trunk layer's tensors, in the order the converter writes them. */
export function qwen35moeLayerTensors(add: FamilyAdd, d: Qwen35Dims, il: number): void {
  const b = `blk.${il}.`;
  const l = d.linear;
  const norm = (name: string, n: number) => normTensor(add, name, n);
  const keyDim = l.keyHeads * l.headDim;
  const valueDim = l.valueHeads * l.headDim;
  const convDim = 2 * keyDim + valueDim;
  norm(`${b}attn_norm.weight`, d.nEmbd);
  if (isRecurrentLayer(il, l)) {
    add(`${b}attn_qkv.weight`, [d.nEmbd, convDim], "attention", inv(d.nEmbd));
    add(`${b}attn_gate.weight`, [d.nEmbd, valueDim], "attention", inv(d.nEmbd));
    // ggml_ssm_conv takes an F32 kernel; the converter keeps it F32.
    add(`${b}ssm_conv1d.weight`, [l.convKernel, convDim], "F32", inv(l.convKernel));
    add(`${b}ssm_dt.bias`, [l.valueHeads], "F32", 0.5);
    // -exp(A_log): negative, so the state decays (gate = softplus(alpha + dt) * a < 0).
    add(`${b}ssm_a`, [l.valueHeads], "F32", 0.3, -1);
    add(`${b}ssm_beta.weight`, [d.nEmbd, l.valueHeads], "attention", inv(d.nEmbd));
    add(`${b}ssm_alpha.weight`, [d.nEmbd, l.valueHeads], "attention", inv(d.nEmbd));
    norm(`${b}ssm_norm.weight`, l.headDim);
    add(`${b}ssm_out.weight`, [valueDim, d.nEmbd], "attention", inv(valueDim));
  } else {
    const nq = d.nHead * d.headDim;
    // One projection gives the query and the output gate, interleaved per head.
    attentionTensors(add, b, { nEmbd: d.nEmbd, nq: 2 * nq, nkv: d.nHeadKv * d.headDim, nOut: nq });
    norm(`${b}attn_q_norm.weight`, d.headDim);
    norm(`${b}attn_k_norm.weight`, d.headDim);
  }
  norm(`${b}post_attention_norm.weight`, d.nEmbd);
  routerTensor(add, b, d.nEmbd, d.nExpert);
  routedExpertTensors(add, b, d, "gate-up-down");
  // The shared expert and its sigmoid gate run in the backbone, outside build_moe_ffn.
  add(`${b}ffn_gate_inp_shexp.weight`, [d.nEmbd], "F32", inv(d.nEmbd));
  ffnTensors(add, b, "_shexp", d.nEmbd, d.nFfShared, "gate-up-down");
}

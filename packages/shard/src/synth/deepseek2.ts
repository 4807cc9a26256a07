// The `deepseek2` family as DeepSeek-V3, R1 and Kimi K2 ship it: multi-head latent attention
// (low-rank q and kv projections, the kv latent shared by every head, split k_b/v_b heads), a
// leading dense layer, then MoE layers whose router takes the sigmoid of its logits, picks the
// best expert groups and the top k within them on the scores plus a per-expert bias
// (exp_probs_b), normalises and scales the k weights; shared experts beside the routed ones. What
// the pinned llama.cpp's src/models/deepseek2.cpp reads and creates (MLA form, trunk only).
import { InvalidArgumentError } from "@moeswarm/core";
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import type { FamilyAdd } from "./family.js";
import {
  checkSigmoidRouting,
  ffnTensors,
  inv,
  normTensor,
  routedExpertTensors,
  routerTensor,
  sigmoidRoutingMetadata,
} from "./layer-parts.js";

/** Multi-head latent attention sizes (DeepSeek-V3: 1536, 512, 64, 128, 128) and expert groups. */
export interface MlaOptions {
  qLoraRank: number;
  kvLoraRank: number;
  /** Rotated part of each q/k head (qk_rope_head_dim, rope.dimension_count). */
  ropeDim: number;
  /** Unrotated part of each q/k head (qk_nope_head_dim). */
  nopeDim: number;
  /** Value head size (v_head_dim). */
  vHeadDim: number;
  /** Expert groups (n_group) and how many the router keeps (topk_group). */
  groups: number;
  groupsUsed: number;
}

export interface DeepSeek2Dims {
  nLayer: number;
  nEmbd: number;
  nHead: number;
  nFfExp: number;
  nFfShared: number;
  nExpert: number;
  nExpertUsed: number;
  mla: MlaOptions;
}

export const DEEPSEEK2_DENSE_LEAD = 1;
/** DeepSeek-V3's routed_scaling_factor. */
export const DEEPSEEK2_WEIGHTS_SCALE = 2.5;

function int(value: unknown, what: string): number {
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < 1 || value > 1 << 16)
    throw new InvalidArgumentError(`mla.${what} must be an integer in [1, 65536], got ${String(value)}`);
  return value;
}

/** Validates the MLA options; defaults scale DeepSeek-V3's proportions to nEmbd. */
export function resolveMla(
  mla: Partial<MlaOptions> | undefined,
  nEmbd: number,
  nExpert: number,
  nExpertUsed: number,
): MlaOptions {
  const m = mla ?? {};
  const groups = int(m.groups ?? 1, "groups");
  const r: MlaOptions = {
    qLoraRank: int(m.qLoraRank ?? Math.max(32, nEmbd / 2), "qLoraRank"),
    kvLoraRank: int(m.kvLoraRank ?? Math.max(32, nEmbd / 2), "kvLoraRank"),
    ropeDim: int(m.ropeDim ?? 16, "ropeDim"),
    nopeDim: int(m.nopeDim ?? 32, "nopeDim"),
    vHeadDim: int(m.vHeadDim ?? 32, "vHeadDim"),
    groups,
    groupsUsed: int(m.groupsUsed ?? groups, "groupsUsed"),
  };
  if (r.ropeDim % 2 !== 0) throw new InvalidArgumentError(`mla.ropeDim must be even, got ${r.ropeDim}`);
  if (nExpert % groups !== 0 || r.groupsUsed > groups || (groups > 1 && r.groupsUsed >= groups)) {
    throw new InvalidArgumentError(
      `mla.groups (${groups}) must divide nExpert (${nExpert}) and exceed groupsUsed (${r.groupsUsed})`,
    );
  }
  if (groups > 1 && (nExpert / groups) * r.groupsUsed < nExpertUsed) {
    throw new InvalidArgumentError("the groups the router keeps hold fewer experts than nExpertUsed");
  }
  return r;
}

export function deepseek2Metadata(
  md: Map<string, GgufMetadataValue>,
  k: (key: string) => string,
  d: DeepSeek2Dims,
): void {
  checkSigmoidRouting("deepseek2", d, DEEPSEEK2_DENSE_LEAD);
  const v = ggufValue;
  const m = d.mla;
  // MLA as the converter writes it: the cache holds the latent and the rotated key (one "KV head").
  md.set(k("attention.head_count_kv"), v.u32(1));
  md.set(k("attention.key_length"), v.u32(m.kvLoraRank + m.ropeDim));
  md.set(k("attention.value_length"), v.u32(m.kvLoraRank));
  md.set(k("attention.key_length_mla"), v.u32(m.nopeDim + m.ropeDim));
  md.set(k("attention.value_length_mla"), v.u32(m.vHeadDim));
  md.set(k("attention.q_lora_rank"), v.u32(m.qLoraRank));
  md.set(k("attention.kv_lora_rank"), v.u32(m.kvLoraRank));
  md.set(k("rope.dimension_count"), v.u32(m.ropeDim));
  sigmoidRoutingMetadata(md, k, d, DEEPSEEK2_DENSE_LEAD, DEEPSEEK2_WEIGHTS_SCALE);
  if (m.groups > 1) {
    md.set(k("expert_group_count"), v.u32(m.groups));
    md.set(k("expert_group_used_count"), v.u32(m.groupsUsed));
  }
}

export const deepseek2DenseFf = (d: DeepSeek2Dims) => d.nFfExp * d.nExpertUsed;

export function deepseek2LayerTensors(add: FamilyAdd, d: DeepSeek2Dims, il: number): void {
  const b = `blk.${il}.`;
  const m = d.mla;
  const norm = (name: string, n: number) => normTensor(add, name, n);
  const headK = m.nopeDim + m.ropeDim;
  norm(`${b}attn_norm.weight`, d.nEmbd);
  norm(`${b}attn_q_a_norm.weight`, m.qLoraRank);
  norm(`${b}attn_kv_a_norm.weight`, m.kvLoraRank);
  add(`${b}attn_q_a.weight`, [d.nEmbd, m.qLoraRank], "attention", inv(d.nEmbd));
  add(`${b}attn_q_b.weight`, [m.qLoraRank, d.nHead * headK], "attention", inv(m.qLoraRank));
  add(`${b}attn_kv_a_mqa.weight`, [d.nEmbd, m.kvLoraRank + m.ropeDim], "attention", inv(d.nEmbd));
  add(`${b}attn_k_b.weight`, [m.nopeDim, m.kvLoraRank, d.nHead], "attention", inv(m.nopeDim));
  add(`${b}attn_v_b.weight`, [m.kvLoraRank, m.vHeadDim, d.nHead], "attention", inv(m.kvLoraRank));
  add(`${b}attn_output.weight`, [d.nHead * m.vHeadDim, d.nEmbd], "attention", inv(d.nHead * m.vHeadDim));
  norm(`${b}ffn_norm.weight`, d.nEmbd);
  if (il < DEEPSEEK2_DENSE_LEAD) {
    ffnTensors(add, b, "", d.nEmbd, deepseek2DenseFf(d), "gate-down-up");
    return;
  }
  routerTensor(add, b, d.nEmbd, d.nExpert);
  add(`${b}exp_probs_b.bias`, [d.nExpert], "F32", 0.2);
  routedExpertTensors(add, b, d, "gate-down-up");
  ffnTensors(add, b, "_shexp", d.nEmbd, d.nFfShared, "gate-down-up");
}

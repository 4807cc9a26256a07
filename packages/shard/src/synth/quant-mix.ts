// llama.cpp's per-tensor type rule for a quantisation preset ("mix"), so a synthetic model carries
// the types a real GGUF of that preset has: the sizes the planner and the workers see are real.
import { GgmlType, ggmlTypeTraits } from "../ggml-type.js";

/** Presets the synthesiser can mix (llama-quantize's names). */
export const SYNTHETIC_MIXES = ["Q4_K_M"] as const;
export type SyntheticMix = (typeof SYNTHETIC_MIXES)[number];

/** `general.file_type` of each mix (llama.h LLAMA_FTYPE_*). */
export const MIX_FILE_TYPE: Record<SyntheticMix, number> = { Q4_K_M: 15 };

// llama-quant.cpp use_more_bits(i, n): the layers Q4_K_M gives Q6_K.
function useMoreBits(i: number, n: number): boolean {
  return i < Math.floor(n / 8) || i >= Math.floor((7 * n) / 8) || (i - Math.floor(n / 8)) % 3 === 2;
}

// llama-quant.cpp tensor_type_fallback: a row length the target's 256-blocks do not divide.
function fallback(type: GgmlType, ne0: number): GgmlType {
  if (ne0 % ggmlTypeTraits(type).blockSize === 0) return type;
  const next =
    type === GgmlType.Q4_K
      ? GgmlType.Q5_0
      : type === GgmlType.Q5_K
        ? GgmlType.Q5_1
        : type === GgmlType.Q6_K
          ? GgmlType.Q8_0
          : type;
  return ne0 % ggmlTypeTraits(next).blockSize === 0 ? next : GgmlType.F16;
}

const isAttnV = (name: string) => name.endsWith("attn_v.weight") || name.endsWith("attn_qkv.weight");

/**
 * The types `llama_tensor_get_type` (pinned src/llama-quant.cpp) gives each tensor for
 * LLAMA_FTYPE_MOSTLY_Q4_K_M, from a source that holds in F32 what the converter keeps F32 (1-D
 * tensors, norms, non-`.weight`, ffn_gate_inp, ssm_conv1d): output Q6_K; attention-v-like
 * tensors (attn_v and attn_qkv, counted in file order) Q6_K on use_more_bits, else Q4_K (Q8_0
 * with exactly 8 experts, as attn_k; attn_output then Q5_K); ffn_down (routed and shared, by
 * layer) Q6_K on use_more_bits layers; everything else Q4_K; then the shape fallback.
 */
export function q4kmTypes(
  tensors: ReadonlyArray<{ name: string; shape: readonly number[] }>,
  nLayerAll: number,
  nExpert: number,
): GgmlType[] {
  const nAttnV = tensors.filter((t) => isAttnV(t.name)).length;
  let iAttnV = 0;
  return tensors.map(({ name, shape }) => {
    const layer = /^blk\.(\d+)\./.exec(name);
    const unquantised =
      shape.length < 2 ||
      !name.endsWith("weight") ||
      name.includes("_norm.weight") ||
      name.includes("ffn_gate_inp.weight") ||
      name.includes("ssm_conv1d");
    if (unquantised) return GgmlType.F32;
    let type = GgmlType.Q4_K;
    if (name === "output.weight") type = GgmlType.Q6_K;
    else if (isAttnV(name)) {
      type = useMoreBits(iAttnV++, nAttnV) ? GgmlType.Q6_K : GgmlType.Q4_K;
      if (nExpert === 8) type = GgmlType.Q8_0;
    } else if (name.endsWith("attn_k.weight") && nExpert === 8) type = GgmlType.Q8_0;
    else if (name.endsWith("attn_output.weight") && nExpert === 8) type = GgmlType.Q5_K;
    else if (name.includes("ffn_down") && layer && useMoreBits(Number(layer[1]), nLayerAll))
      type = GgmlType.Q6_K;
    return fallback(type, shape[0]!);
  });
}

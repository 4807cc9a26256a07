import { InvalidArgumentError } from "@moeswarm/core";
import { GgmlType, ggmlTypeTraits } from "../ggml-type.js";
import { GgufValueType } from "../gguf-constants.js";
import { type GgufMetadataValue, ggufValue } from "../gguf-metadata.js";
import { deepseek2LayerTensors, deepseek2Metadata, type MlaOptions, resolveMla } from "./deepseek2.js";
import type { FamilyAdd } from "./family.js";
import { glm4moeLayerTensors, glm4moeMetadata } from "./glm4moe.js";
import { gptOssLayerTensors, gptOssMetadata } from "./gpt-oss.js";
import {
  attentionTensors,
  ffnTensors,
  headLengthMetadata,
  inv,
  normTensor,
  routedExpertTensors,
  routerTensor,
} from "./layer-parts.js";
import { llama4LayerTensors, llama4Metadata } from "./llama4.js";
import { minimaxM2LayerTensors, minimaxM2Metadata } from "./minimax-m2.js";
import { MIX_FILE_TYPE, q4kmTypes, SYNTHETIC_MIXES, type SyntheticMix } from "./quant-mix.js";
import {
  type LinearAttentionOptions,
  qwen35moeLayerTensors,
  qwen35moeMetadata,
  resolveLinearAttention,
} from "./qwen35moe.js";
import { buildTokenizer } from "./tokenizer.js";

/**
 * Architectures the synthesiser writes; `mixtral` is GGUF architecture `llama` with experts,
 * `qwen35moe` the hybrid Gated DeltaNet / gated attention Qwen3.5-MoE, `gpt-oss` OpenAI's (biased
 * swiglu_oai experts, attention sinks), `glm4moe` GLM-4.5 (sigmoid router with a selection bias,
 * a shared expert, a leading dense layer), `deepseek2` DeepSeek-V3/Kimi K2 (latent attention,
 * grouped sigmoid routing with a selection bias, shared experts), `llama4` (top-1 routing whose
 * sigmoid weight scales the expert input, MoE every other layer), `minimax-m2` (sigmoid router with
 * a selection bias, no shared expert, full-width QK norms).
 */
export const SYNTHETIC_ARCHS = [
  "qwen3moe",
  "qwen2moe",
  "mixtral",
  "qwen35moe",
  "gpt-oss",
  "glm4moe",
  "deepseek2",
  "llama4",
  "minimax-m2",
] as const;
export type SyntheticArch = (typeof SYNTHETIC_ARCHS)[number];

/** Tensor types a synthetic model can be written in (the ones the shard quantisers encode). */
export const SYNTHETIC_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "MXFP4"] as const;
export type SyntheticType = (typeof SYNTHETIC_TYPES)[number];

/** The type of each class of tensor; norms (and attention biases) are always F32, as in ggml. */
export interface SyntheticTypes {
  /** Routed experts: ffn_{gate,up,down}_exps. */
  experts: SyntheticType;
  /** The shared expert (qwen2moe, qwen35moe): ffn_{gate,up,down}_shexp. */
  sharedExpert: SyntheticType;
  /** attn_q, attn_k, attn_v, attn_output (qwen35moe: also attn_qkv, attn_gate, ssm_{alpha,beta,out}). */
  attention: SyntheticType;
  /** token_embd. */
  embeddings: SyntheticType;
  /** output (the LM head). */
  output: SyntheticType;
  /** ffn_gate_inp (the router) and ffn_gate_inp_shexp. */
  router: SyntheticType;
}

export const DEFAULT_SYNTHETIC_TYPES: Readonly<SyntheticTypes> = Object.freeze({
  experts: "F16",
  sharedExpert: "F16",
  attention: "F16",
  embeddings: "F32",
  output: "F32",
  router: "F32",
});

export interface SyntheticMoeOptions {
  arch: SyntheticArch;
  /** uint32; the same seed and options always give the same bytes. */
  seed: number;
  nLayer: number;
  nEmbd: number;
  nHead: number;
  nHeadKv: number;
  /** Width of one routed expert's hidden layer. */
  nFfExp: number;
  nExpert: number;
  nExpertUsed: number;
  /** Width of the shared expert (qwen2moe: default nFfExp * nExpertUsed; qwen35moe: nFfExp). */
  nFfShared?: number;
  /** Vocabulary size, special tokens included (at least 259). */
  vocab: number;
  /** Attention head size (qwen3moe/qwen35moe key_length/value_length; the others nEmbd / nHead). */
  headDim?: number;
  contextLength?: number;
  ropeFreqBase?: number;
  rmsEps?: number;
  types?: Partial<SyntheticTypes>;
  /** `general.name` (default `moeswarm-synthetic-<arch>`). */
  name?: string;
  /**
   * Scale of the logits (default 10): the language model in token_embd/output gives logits of
   * logitStd / 4 per unit of ln P, so the top two tokens are rarely within rounding noise of each
   * other and greedy decoding is stable across builds.
   */
  logitStd?: number;
  /** qwen35moe only: the Gated DeltaNet layers (default 1 key head, as many value heads, 4 taps, 3:1). */
  linear?: Partial<LinearAttentionOptions>;
  /** deepseek2 only: latent attention sizes and expert groups (defaults: one group, small ranks). */
  mla?: Partial<MlaOptions>;
  /**
   * llama-quantize's per-tensor type rule for this preset (`Q4_K_M`), replacing `types`: the
   * tensors get the types a real GGUF of that preset has.
   */
  mix?: SyntheticMix;
  /**
   * How quantised weights are made. `quantised` (default): values drawn from the seeded generator
   * and quantised, the bytes ggml's quantiser writes. `direct`: the routed experts' Q4_K, Q6_K
   * and Q8_0 tensors written as random valid blocks of the same spread with no quantiser
   * (direct-blocks.ts, ~25x faster), for shape-true models whose experts are nearly all of the
   * values; every other tensor as with `quantised`.
   */
  weights?: SyntheticWeights;
}

export const SYNTHETIC_WEIGHTS = ["quantised", "direct"] as const;
export type SyntheticWeights = (typeof SYNTHETIC_WEIGHTS)[number];

/** The options with every default applied: what identifies a synthetic model. */
export type ResolvedSyntheticOptions = Required<
  Omit<SyntheticMoeOptions, "types" | "linear" | "mla" | "mix" | "weights">
> & {
  types: SyntheticTypes;
  /** Present for qwen35moe only (so the other families' keys stay what they were). */
  linear?: LinearAttentionOptions;
  /** Present for deepseek2 only. */
  mla?: MlaOptions;
  mix?: SyntheticMix;
  /** Present only when `direct` (so the other models' keys stay what they were). */
  weights?: "direct";
};

/** How the values of a tensor are drawn: mean and standard deviation before quantisation. */
export interface SynthTensorSpec {
  readonly name: string;
  readonly shape: readonly number[];
  readonly type: GgmlType;
  readonly mean: number;
  readonly std: number;
  /** Drawn slab by slab along ne[2], each expert from its own stream. */
  readonly perExpert: boolean;
}

export interface SynthModelSpec {
  readonly options: ResolvedSyntheticOptions;
  readonly ggufArch: string;
  readonly metadata: Map<string, GgufMetadataValue>;
  readonly tensors: readonly SynthTensorSpec[];
}

const GGML_OF: Record<SyntheticType, GgmlType> = {
  F32: GgmlType.F32,
  F16: GgmlType.F16,
  BF16: GgmlType.BF16,
  Q8_0: GgmlType.Q8_0,
  Q4_0: GgmlType.Q4_0,
  Q4_K: GgmlType.Q4_K,
  MXFP4: GgmlType.MXFP4,
};

/** Upper bounds that keep a typo from asking for terabytes. */
const LIMITS = {
  nLayer: 512,
  nEmbd: 65_536,
  nHead: 1024,
  nFfExp: 131_072,
  nExpert: 1024,
  contextLength: 1 << 24,
} as const;

function positiveInt(value: unknown, what: string, max: number): number {
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < 1 || value > max) {
    throw new InvalidArgumentError(`${what} must be an integer in [1, ${max}], got ${String(value)}`, {
      details: { [what]: value },
    });
  }
  return value;
}

function positiveNumber(value: unknown, what: string): number {
  if (typeof value !== "number" || !Number.isFinite(value) || value <= 0) {
    throw new InvalidArgumentError(`${what} must be a positive number, got ${String(value)}`);
  }
  return value;
}

/** Validates the options and applies the defaults. */
export function resolveSyntheticOptions(options: SyntheticMoeOptions): ResolvedSyntheticOptions {
  if (typeof options !== "object" || options === null)
    throw new InvalidArgumentError("synthetic model options must be an object");
  const arch = options.arch;
  if (!SYNTHETIC_ARCHS.includes(arch)) {
    throw new InvalidArgumentError(`arch must be one of ${SYNTHETIC_ARCHS.join(", ")}, got ${String(arch)}`);
  }
  const seed = options.seed;
  if (typeof seed !== "number" || !Number.isInteger(seed) || seed < 0 || seed > 0xffff_ffff) {
    throw new InvalidArgumentError(`seed must be a uint32, got ${String(seed)}`);
  }
  const nLayer = positiveInt(options.nLayer, "nLayer", LIMITS.nLayer);
  const nEmbd = positiveInt(options.nEmbd, "nEmbd", LIMITS.nEmbd);
  const nHead = positiveInt(options.nHead, "nHead", LIMITS.nHead);
  const nHeadKv = positiveInt(options.nHeadKv, "nHeadKv", nHead);
  if (nHead % nHeadKv !== 0)
    throw new InvalidArgumentError(`nHead (${nHead}) must be a multiple of nHeadKv (${nHeadKv})`);
  const nFfExp = positiveInt(options.nFfExp, "nFfExp", LIMITS.nFfExp);
  const nExpert = positiveInt(options.nExpert, "nExpert", LIMITS.nExpert);
  const nExpertUsed = positiveInt(options.nExpertUsed, "nExpertUsed", nExpert);
  const nFfShared = positiveInt(
    options.nFfShared ??
      (["qwen35moe", "glm4moe", "deepseek2"].includes(arch) ? nFfExp : nFfExp * nExpertUsed),
    "nFfShared",
    LIMITS.nFfExp,
  );
  const vocab = options.vocab;
  buildTokenizer(vocab); // validates the vocabulary size
  const headDim =
    options.headDim === undefined ? nEmbd / nHead : positiveInt(options.headDim, "headDim", LIMITS.nEmbd);
  if (!Number.isInteger(headDim))
    throw new InvalidArgumentError(`nEmbd (${nEmbd}) must be a multiple of nHead (${nHead})`);
  const freeHeadDim: readonly SyntheticArch[] = [
    "qwen3moe",
    "qwen35moe",
    "gpt-oss",
    "glm4moe",
    "deepseek2",
    "minimax-m2",
  ];
  if (!freeHeadDim.includes(arch) && headDim * nHead !== nEmbd) {
    throw new InvalidArgumentError(
      `${arch} needs headDim * nHead = nEmbd (${headDim} * ${nHead} != ${nEmbd})`,
    );
  }
  if (headDim % 2 !== 0) throw new InvalidArgumentError(`headDim must be even for RoPE, got ${headDim}`);
  const types: SyntheticTypes = { ...DEFAULT_SYNTHETIC_TYPES };
  for (const [key, value] of Object.entries(options.types ?? {})) {
    if (!(key in types))
      throw new InvalidArgumentError(`unknown tensor class ${JSON.stringify(key)} in types`);
    if (value === undefined) continue;
    if (!SYNTHETIC_TYPES.includes(value as SyntheticType)) {
      throw new InvalidArgumentError(
        `types.${key} must be one of ${SYNTHETIC_TYPES.join(", ")}, got ${String(value)}`,
      );
    }
    types[key as keyof SyntheticTypes] = value as SyntheticType;
  }
  if (options.linear !== undefined && arch !== "qwen35moe")
    throw new InvalidArgumentError(`linear applies to qwen35moe only, not ${arch}`);
  if (options.mix !== undefined && !SYNTHETIC_MIXES.includes(options.mix)) {
    throw new InvalidArgumentError(
      `mix must be one of ${SYNTHETIC_MIXES.join(", ")}, got ${String(options.mix)}`,
    );
  }
  if (options.mla !== undefined && arch !== "deepseek2")
    throw new InvalidArgumentError(`mla applies to deepseek2 only, not ${arch}`);
  if (options.weights !== undefined && !SYNTHETIC_WEIGHTS.includes(options.weights)) {
    throw new InvalidArgumentError(
      `weights must be one of ${SYNTHETIC_WEIGHTS.join(", ")}, got ${String(options.weights)}`,
    );
  }
  const extra: Pick<ResolvedSyntheticOptions, "linear" | "mla" | "mix" | "weights"> = {};
  if (arch === "qwen35moe") extra.linear = resolveLinearAttention(options.linear, headDim);
  if (arch === "deepseek2") extra.mla = resolveMla(options.mla, nEmbd, nExpert, nExpertUsed);
  if (options.mix !== undefined) extra.mix = options.mix;
  if (options.weights === "direct") extra.weights = "direct";
  return {
    arch,
    seed,
    nLayer,
    nEmbd,
    nHead,
    nHeadKv,
    nFfExp,
    nExpert,
    nExpertUsed,
    nFfShared,
    vocab,
    headDim,
    contextLength: positiveInt(options.contextLength ?? 4096, "contextLength", LIMITS.contextLength),
    ropeFreqBase: positiveNumber(options.ropeFreqBase ?? 1_000_000, "ropeFreqBase"),
    rmsEps: positiveNumber(options.rmsEps ?? 1e-6, "rmsEps"),
    types,
    name: options.name ?? `moeswarm-synthetic-${arch}`,
    logitStd: positiveNumber(options.logitStd ?? 10, "logitStd"),
    ...extra,
  };
}

/** Version of the generator: bump whenever the bytes for given options change. */
export const SYNTH_GENERATOR_VERSION = "moeswarm-synth/2";

/** The keys llama.cpp reads for the architecture, then the tokenizer and the generator's own. */
function syntheticMetadata(o: ResolvedSyntheticOptions, arch: string): Map<string, GgufMetadataValue> {
  const tok = buildTokenizer(o.vocab);
  const v = ggufValue;
  const k = (key: string) => `${arch}.${key}`;
  const md = new Map<string, GgufMetadataValue>();
  md.set("general.architecture", v.str(arch));
  md.set("general.type", v.str("model"));
  md.set("general.name", v.str(o.name));
  md.set("general.quantization_version", v.u32(2));
  if (o.mix !== undefined) md.set("general.file_type", v.u32(MIX_FILE_TYPE[o.mix]));
  md.set(k("block_count"), v.u32(o.nLayer));
  md.set(k("context_length"), v.u32(o.contextLength));
  md.set(k("embedding_length"), v.u32(o.nEmbd));
  // llama's experts use feed_forward_length; the qwen MoEs read expert_feed_forward_length and
  // keep feed_forward_length as the dense width a converter writes (Qwen3.5 has no dense width).
  if (o.arch !== "qwen35moe")
    md.set(k("feed_forward_length"), v.u32(o.arch === "mixtral" ? o.nFfExp : o.nFfExp * o.nExpertUsed));
  md.set(k("attention.head_count"), v.u32(o.nHead));
  md.set(k("attention.head_count_kv"), v.u32(o.nHeadKv));
  md.set(k("rope.freq_base"), v.f32(o.ropeFreqBase));
  md.set(k("attention.layer_norm_rms_epsilon"), v.f32(o.rmsEps));
  md.set(k("expert_count"), v.u32(o.nExpert));
  md.set(k("expert_used_count"), v.u32(o.nExpertUsed));
  if (o.arch === "qwen3moe") headLengthMetadata(md, k, o.headDim);
  if (o.arch === "qwen35moe" && o.linear) qwen35moeMetadata(md, k, { ...o, linear: o.linear });
  else if (o.arch === "gpt-oss") gptOssMetadata(md, k, o);
  else if (o.arch === "glm4moe") glm4moeMetadata(md, k, o);
  else if (o.arch === "deepseek2" && o.mla) deepseek2Metadata(md, k, { ...o, mla: o.mla });
  else if (o.arch === "llama4") llama4Metadata(md, k, o);
  else if (o.arch === "minimax-m2") minimaxM2Metadata(md, k, o);
  else if (o.arch !== "mixtral") md.set(k("expert_feed_forward_length"), v.u32(o.nFfExp));
  if (o.arch === "qwen2moe") md.set(k("expert_shared_feed_forward_length"), v.u32(o.nFfShared));
  if (o.arch === "mixtral") {
    md.set(k("rope.dimension_count"), v.u32(o.headDim));
    md.set(k("vocab_size"), v.u32(o.vocab));
  }
  // One tokenizer for every architecture (Mixtral ships an SPM one; llama.cpp runs either with
  // `llama`): GPT-2 byte-level BPE with Qwen2's pre-tokeniser, so any UTF-8 text round-trips.
  md.set("tokenizer.ggml.model", v.str("gpt2"));
  md.set("tokenizer.ggml.pre", v.str("qwen2"));
  md.set("tokenizer.ggml.tokens", v.array(GgufValueType.STRING, tok.tokens));
  md.set("tokenizer.ggml.token_type", v.array(GgufValueType.INT32, tok.tokenTypes));
  md.set("tokenizer.ggml.merges", v.array(GgufValueType.STRING, tok.merges));
  md.set("tokenizer.ggml.eos_token_id", v.u32(tok.eosId));
  md.set("tokenizer.ggml.bos_token_id", v.u32(tok.bosId));
  md.set("tokenizer.ggml.padding_token_id", v.u32(tok.eosId));
  md.set("tokenizer.ggml.add_bos_token", v.bool(false));
  md.set("moeswarm.synthetic.generator", v.str(SYNTH_GENERATOR_VERSION));
  md.set("moeswarm.synthetic.seed", v.u32(o.seed));
  if (o.weights !== undefined) md.set("moeswarm.synthetic.weights", v.str(o.weights));
  return md;
}

/** One layer of the families without a file of their own: qwen3moe, qwen2moe, mixtral. */
function genericLayerTensors(add: FamilyAdd, o: ResolvedSyntheticOptions, il: number): void {
  const b = `blk.${il}.`;
  normTensor(add, `${b}attn_norm.weight`, o.nEmbd);
  const nq = o.headDim * o.nHead;
  const nkv = o.headDim * o.nHeadKv;
  attentionTensors(add, b, { nEmbd: o.nEmbd, nq, nkv, qkvBias: o.arch === "qwen2moe" });
  if (o.arch === "qwen3moe") {
    normTensor(add, `${b}attn_q_norm.weight`, o.headDim);
    normTensor(add, `${b}attn_k_norm.weight`, o.headDim);
  }
  normTensor(add, `${b}ffn_norm.weight`, o.nEmbd);
  routerTensor(add, b, o.nEmbd, o.nExpert);
  routedExpertTensors(add, b, o, "gate-up-down");
  if (o.arch === "qwen2moe") {
    add(`${b}ffn_gate_inp_shexp.weight`, [o.nEmbd], "F32", inv(o.nEmbd));
    ffnTensors(add, b, "_shexp", o.nEmbd, o.nFfShared, "gate-up-down");
  }
}

type LayerTensors = (add: FamilyAdd, o: ResolvedSyntheticOptions, il: number) => void;

/** Each family's layer; `linear` is set for qwen35moe and `mla` for deepseek2 (resolveSyntheticOptions). */
const LAYER_TENSORS: Record<SyntheticArch, LayerTensors> = {
  qwen3moe: genericLayerTensors,
  qwen2moe: genericLayerTensors,
  mixtral: genericLayerTensors,
  qwen35moe: (add, o, il) => qwen35moeLayerTensors(add, { ...o, linear: o.linear! }, il),
  "gpt-oss": gptOssLayerTensors,
  glm4moe: glm4moeLayerTensors,
  deepseek2: (add, o, il) => deepseek2LayerTensors(add, { ...o, mla: o.mla! }, il),
  llama4: llama4LayerTensors,
  "minimax-m2": minimaxM2LayerTensors,
};

/** The tensors `load_arch_tensors` creates, in file order, each with its distribution. */
function syntheticTensors(o: ResolvedSyntheticOptions): SynthTensorSpec[] {
  const t = o.types;
  const tensors: SynthTensorSpec[] = [];
  const add = (
    name: string,
    shape: number[],
    type: SyntheticType | "F32",
    std: number,
    mean = 0,
    perExpert = false,
  ) => {
    const ggml = GGML_OF[type];
    const { blockSize, name: typeName } = ggmlTypeTraits(ggml);
    if (shape[0]! % blockSize !== 0) {
      throw new InvalidArgumentError(
        `tensor ${name}: ne[0] = ${shape[0]} is not a multiple of ${typeName}'s block size ${blockSize}; pick other types or sizes`,
        { details: { tensor: name, ne0: shape[0], type } },
      );
    }
    tensors.push({ name, shape, type: ggml, mean, std, perExpert });
  };

  add("token_embd.weight", [o.nEmbd, o.vocab], t.embeddings, 1);
  const familyAdd: FamilyAdd = (name, shape, cls, std, mean, perExpert) =>
    add(name, shape, cls === "norm" || cls === "F32" ? "F32" : t[cls], std, mean, perExpert);
  const layer = LAYER_TENSORS[o.arch];
  for (let i = 0; i < o.nLayer; i++) layer(familyAdd, o, i);
  normTensor(familyAdd, "output_norm.weight", o.nEmbd);
  add("output.weight", [o.nEmbd, o.vocab], t.output, o.logitStd * inv(o.nEmbd));
  if (o.mix === undefined) return tensors;
  const mixed = q4kmTypes(tensors, o.nLayer, o.nExpert);
  return tensors.map((spec, i) => ({ ...spec, type: mixed[i]! }));
}

/**
 * The metadata and tensor list llama.cpp (pinned release) requires for the architecture: the
 * keys its `load_hparams`/`load_arch_hparams` read and the tensors its `load_arch_tensors`
 * creates (src/models/qwen3moe.cpp, qwen2moe.cpp, llama.cpp, qwen35moe.cpp), with those shapes.
 */
export function syntheticModelSpec(options: SyntheticMoeOptions): SynthModelSpec {
  const o = resolveSyntheticOptions(options);
  const arch = o.arch === "mixtral" ? "llama" : o.arch;
  const md = syntheticMetadata(o, arch);
  const tensors = syntheticTensors(o);
  return { options: o, ggufArch: arch, metadata: md, tensors };
}

import { DispatchError, GgufError } from "@moeswarm/core";
import { type ExpertActivation, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT } from "./activation.js";
import {
  type GatingFunction,
  type RoutingConfig,
  type SelectionSource,
  validateRoutingConfig,
} from "./route.js";

/**
 * How an architecture's gating function is decided (the model file's `load_arch_hparams`):
 * fixed in the `build_moe_ffn` call, or read from `<arch>.expert_gating_func` with a default
 * when absent ("none": llama.cpp would abort building the graph, so the key is required).
 */
export type GatingRule =
  | { readonly fixed: GatingFunction }
  | { readonly key: true; readonly default: GatingFunction | "none" | "deepseek2" };

/** One row of the table derived from the pinned llama.cpp (see README.md). */
export interface ArchRoutingSpec {
  /** `general.architecture` value. */
  readonly arch: string;
  /** The `build_moe_ffn` call the arch's graph makes, `src/models/<file>:<line>`. */
  readonly graph: string;
  /** Where its routing hparams are read. */
  readonly hparams: string;
  readonly gating: GatingRule;
  /** `norm_w`: a literal in the call, or `<arch>.expert_weights_norm` (default false). */
  readonly normalize: boolean | "key";
  /** Whether `<arch>.expert_weights_scale` is read (else `w_scale` is 0 or 1: no scaling). */
  readonly scale: boolean;
  /** Whether the call passes `ffn_exp_probs_b` (present in the file or not). */
  readonly selectionBias: boolean;
  /** gpt-oss: `ffn_gate_inp.bias` added to the logits. */
  readonly logitBias?: boolean;
  readonly selectOn?: SelectionSource;
  readonly weightBeforeFfn?: boolean;
  readonly activation: "silu" | "gelu" | "relu" | "relu_sqr" | "swiglu_oai" | "situ";
  /** Reads `<arch>.swiglu_clamp_exp` (per layer): which clamp form build_moe_ffn applies. */
  readonly swigluLimit?: "clamp_output" | "clamp_input" | "dflash";
  /** "custom": the model computes router logits itself and passes them (`probs_in`). */
  readonly logits: "gate_inp" | "custom";
  /** k is read per layer (`n_expert_used(il)`), else the first value of expert_used_count. */
  readonly perLayerK?: boolean;
  readonly notes?: string;
}

const softmax: GatingRule = { fixed: "softmax" };
const sigmoid: GatingRule = { fixed: "sigmoid" };
const keyRequired: GatingRule = { key: true, default: "none" };
const keyOrSigmoid: GatingRule = { key: true, default: "sigmoid" };

function plain(
  arch: string,
  graph: string,
  hparams: string,
  normalize: boolean,
  extra: Partial<ArchRoutingSpec> = {},
): ArchRoutingSpec {
  return {
    arch,
    graph,
    hparams,
    gating: softmax,
    normalize,
    scale: false,
    selectionBias: false,
    activation: "silu",
    logits: "gate_inp",
    ...extra,
  };
}

function keyed(
  arch: string,
  graph: string,
  hparams: string,
  gating: GatingRule,
  extra: Partial<ArchRoutingSpec> = {},
): ArchRoutingSpec {
  return {
    arch,
    graph,
    hparams,
    gating,
    normalize: "key",
    scale: true,
    selectionBias: true,
    activation: "silu",
    logits: "gate_inp",
    ...extra,
  };
}

/**
 * Every architecture of llama.cpp 80fb11ac73e6 whose graph calls `build_moe_ffn` for routed
 * experts, with what it passes. Line numbers refer to that commit. The expert count keys are
 * generic for all: `<arch>.expert_count`, `<arch>.expert_used_count` (scalar or per-layer array),
 * `<arch>.expert_group_count`, `<arch>.expert_group_used_count` (src/llama-model.cpp:1229-1233).
 */
export const ROUTING_ARCHITECTURES: readonly ArchRoutingSpec[] = Object.freeze([
  plain("llama", "llama.cpp:203", "llama.cpp:3", true, {
    notes: "Mixtral and llama GGUFs with ffn_gate_inp; gate tensor optional; per-expert .scale tensors",
  }),
  plain("llama-embed", "llama.cpp:203", "llama.cpp:3", true, {
    notes: "llama graph, embedding variant (models.h:173)",
  }),
  plain("llama4", "llama4.cpp:221", "llama4.cpp:3", false, {
    gating: sigmoid,
    selectOn: "logits",
    weightBeforeFfn: true,
    notes:
      "top-k on the raw logits, sigmoid weights applied to the expert input (llama-graph.cpp:2017, 2104)",
  }),
  plain("grok", "grok.cpp:158", "grok.cpp:3", true, { activation: "gelu" }),
  plain("nomic-bert", "bert.cpp:179", "nomic-bert.cpp:5", false, {
    activation: "gelu",
    notes: "MoE on layers with il % moe_every_n_layers == 1; up-only experts (no gate)",
  }),
  plain("nomic-bert-moe", "bert.cpp:179", "nomic-bert-moe.cpp:5", false, {
    activation: "gelu",
    notes: "bert graph (models.h:334); MoE on layers with il % moe_every_n_layers == 1; no gate",
  }),
  plain("mellum", "mellum.cpp:179", "mellum.cpp:3", true),
  plain("llada-moe", "llada-moe.cpp:126", "llada-moe.cpp:3", false),
  plain("rnd1", "rnd1.cpp:139", "rnd1.cpp:3", true),
  plain("qwen2moe", "qwen2moe.cpp:132", "qwen2moe.cpp:3", false),
  plain("qwen3moe", "qwen3moe.cpp:137", "qwen3moe.cpp:3", true, { notes: "per-expert .scale tensors" }),
  plain("qwen3vlmoe", "qwen3vlmoe.cpp:145", "qwen3vlmoe.cpp:3", true),
  plain("qwen3next", "qwen3next.cpp:569", "qwen3next.cpp:4", true, {
    notes: "merged gate_up or separate; .scale",
  }),
  plain("qwen35moe", "qwen35moe.cpp:498", "qwen35moe.cpp:4", true, {
    notes: "merged gate_up or separate; .scale",
  }),
  plain("qwen4exp", "qwen4exp.cpp:977", "qwen4exp.cpp:26", true, {
    notes: "merged gate_up or separate; .scale",
  }),
  plain("phi3", "phi3.cpp:153", "phi3.cpp:3", true),
  plain("phimoe", "phi3.cpp:153", "phimoe.cpp:3", true, { notes: "phi3 graph (models.h:656)" }),
  plain("gemma4", "gemma4.cpp:301", "gemma4.cpp:3", true, {
    activation: "gelu",
    logits: "custom",
    notes: "router logits from a separately normed input (gemma4.cpp:294-298); w_scale literal 1.0",
  }),
  plain("jamba", "jamba.cpp:163", "jamba.cpp:3", false),
  keyed("cohere2moe", "cohere2moe.cpp:231", "cohere2moe.cpp:19-24", keyOrSigmoid, {
    selectionBias: false,
    notes: "merged gate_up or separate; .scale",
  }),
  plain("dbrx", "dbrx.cpp:115", "dbrx.cpp:3", true),
  plain("olmoe", "olmoe.cpp:137", "olmoe.cpp:3", false),
  plain("arctic", "arctic.cpp:141", "arctic.cpp:3", true),
  plain("deepseek", "deepseek.cpp:145", "deepseek.cpp:8", false, { scale: true }),
  keyed(
    "deepseek2",
    "deepseek2.cpp:664",
    "deepseek2.cpp:20-31",
    { key: true, default: "deepseek2" },
    {
      notes: "absent gating key: sigmoid for n_layer 47/48 with vocab 154880 (GLM 4.7 Lite), else softmax",
    },
  ),
  keyed(
    "mistral4",
    "deepseek2.cpp:664",
    "deepseek2.cpp:20-31",
    { key: true, default: "deepseek2" },
    {
      notes: "deepseek2 class and graph (models.h:1373)",
    },
  ),
  keyed(
    "deepseek2-ocr",
    "deepseek2.cpp:664",
    "deepseek2ocr.cpp:9-15",
    { key: true, default: "softmax" },
    {
      notes: "deepseek2 graph (models.h:1315)",
    },
  ),
  keyed("deepseek32", "deepseek32.cpp:424", "deepseek32.cpp:15-32", keyRequired),
  keyed("dots3note", "dots3note.cpp:425", "dots3note.cpp:16-18", keyRequired),
  keyed(
    "deepseek4",
    "deepseek4.cpp:1295",
    "deepseek4.cpp:34-66",
    { key: true, default: "none" },
    {
      swigluLimit: "clamp_input",
      notes:
        "gating must be sqrt_softplus; the first <arch>.hash_layer_count layers take ids from ffn_gate_tid2eid by token id (pass `selected` to route) without bias",
    },
  ),
  keyed("dflash", "dflash.cpp:945", "dflash.cpp:45-48", keyRequired, {
    swigluLimit: "dflash",
    notes: "swiglu clamp as deepseek4 when <arch>.hyper_connection.count > 0",
  }),
  keyed("glm-dsa", "glm-dsa.cpp:468", "glm-dsa.cpp:37-56", keyOrSigmoid),
  keyed("glm4moe", "glm4-moe.cpp:390", "glm4-moe.cpp:11-17", keyOrSigmoid),
  keyed("nemotron_h", "nemotron-h.cpp:293", "nemotron-h.cpp:25-27", sigmoid, {
    activation: "relu_sqr",
    perLayerK: true,
    notes:
      "up-only experts; with <arch>.moe_latent_size the experts take ffn_latent_down·x, the router uses x",
  }),
  keyed("nemotron_h_moe", "nemotron-h.cpp:293", "nemotron-h.cpp:25-27", sigmoid, {
    activation: "relu_sqr",
    perLayerK: true,
    notes: "nemotron_h graph and hparams (models.h:1519)",
  }),
  keyed("exaone-moe", "exaone-moe.cpp:190", "exaone-moe.cpp:18-20", keyRequired),
  plain("granite", "granite.cpp:270", "granite.cpp:5", true),
  plain("granitemoe", "granite.cpp:270", "granite-moe.cpp:3", true, {
    notes: "granite graph (models.h:1658)",
  }),
  plain("minicpm", "granite.cpp:270", "minicpm.cpp:3", true, { notes: "granite graph (models.h:1719)" }),
  plain("granitehybrid", "granite-hybrid.cpp:261", "granite-hybrid.cpp:3", true),
  plain("granite_swa", "granite-swa.cpp:277", "granite-swa.cpp:5", true, {
    notes: "merged gate_up or separate",
  }),
  keyed("bailingmoe", "bailingmoe.cpp:128", "bailingmoe.cpp:8-9", softmax, { selectionBias: false }),
  keyed("bailingmoe2", "bailingmoe2.cpp:161", "bailingmoe2.cpp:9-11", keyRequired),
  keyed("bailingmoe3", "bailingmoe3.cpp:369", "bailingmoe3.cpp:22-25", keyRequired, {
    swigluLimit: "clamp_output",
  }),
  keyed("dots1", "dots1.cpp:145", "dots1.cpp:8-10", keyRequired),
  keyed("afmoe", "afmoe.cpp:216", "afmoe.cpp:8-31", keyOrSigmoid),
  keyed("laguna", "laguna.cpp:279", "laguna.cpp:13-57", keyOrSigmoid),
  plain("ernie4_5-moe", "ernie4-5-moe.cpp:81", "ernie4-5.cpp:3", true, { selectionBias: true }),
  plain("hunyuan-moe", "hunyuan-moe.cpp:147", "hunyuan-moe.cpp:3", true),
  keyed("hy_v3", "hy-v3.cpp:173", "hy-v3.cpp:7-14", keyOrSigmoid, {
    notes: "merged gate_up or separate; .scale",
  }),
  plain("gpt-oss", "openai-moe.cpp:134", "openai-moe.cpp:3", false, {
    gating: { fixed: "softmax_weight" },
    logitBias: true,
    activation: "swiglu_oai",
    notes: "top-k on the biased logits, softmax over the k selected; per-expert gate/up/down biases",
  }),
  plain("lfm2moe", "lfm2.cpp:116", "lfm2moe.cpp:10", true, {
    gating: keyRequired,
    selectionBias: true,
    notes: "lfm2 graph (models.h:2066)",
  }),
  plain("smallthinker", "smallthinker.cpp:151", "smallthinker.cpp:23", true, {
    gating: keyRequired,
    activation: "relu",
    logits: "custom",
    notes: "router logits from the layer input before the FFN norm (smallthinker.cpp:111)",
  }),
  plain("grovemoe", "grovemoe.cpp:137", "grovemoe.cpp:3", true, {
    selectOn: "sigmoid",
    notes:
      "selection on sigmoid(logits), weights from softmax (llama-graph.cpp:2021); the second 'chunk expert' MoE (grovemoe.cpp:153) is not covered",
  }),
  plain("minimax-01", "minimax-01.cpp:441", "minimax-01.cpp:4", true, { selectionBias: true }),
  plain("minimax-m2", "minimax-m2.cpp:131", "minimax-m2.cpp:6", true, {
    gating: keyRequired,
    selectionBias: true,
  }),
  keyed("minimax-m3", "minimax-m3.cpp:556", "minimax-m3.cpp:18-20", keyRequired, {
    activation: "swiglu_oai",
  }),
  plain("mistral3", "mistral3.cpp:193", "mistral3.cpp:3", true, { notes: "gate optional; .scale" }),
  plain("mimo2", "mimo2.cpp:208", "mimo2.cpp:3", true, { gating: sigmoid, selectionBias: true }),
  keyed("kimi-linear", "kimi-linear.cpp:500", "kimi-linear.cpp:25-26", keyRequired, { normalize: true }),
  keyed("kimi-k3", "kimi-k3.cpp:580", "kimi-k3.cpp:36-43", keyRequired, {
    activation: "situ",
    logits: "custom",
    notes: "router logits computed by the model (kimi-k3.cpp:577)",
  }),
  keyed("step35", "step35.cpp:311", "step35.cpp:14-28", keyOrSigmoid, { swigluLimit: "clamp_output" }),
]);

const BY_ARCH = new Map(ROUTING_ARCHITECTURES.map((s) => [s.arch, s]));

const GATING_BY_ID: Readonly<Record<number, GatingFunction>> = {
  1: "softmax",
  2: "sigmoid",
  3: "softmax_weight",
  4: "sqrt_softplus",
};

/** GGUF metadata: a Map or record of key to value; values plain or `{ type, value }` as the shard reader gives them. */
export type GgufMetadataInput = ReadonlyMap<string, unknown> | Readonly<Record<string, unknown>>;

export interface GgufRoutingConfig extends RoutingConfig {
  readonly arch: string;
  readonly layer: number;
  /** The expert FFN's activation, for the oracle and workers. */
  readonly activation: ExpertActivation;
  /** The layer's `exp_probs_b` tensor name: load it into `selectionBias` when the file has it. */
  readonly selectionBiasTensor?: string;
  /** The layer's router bias tensor (gpt-oss): load it into `logitBias`. */
  readonly logitBiasTensor?: string;
  /** "custom": pass the model's own logits to `route` (it does not use `ffn_gate_inp · x`). */
  readonly logitsSource: "gate_inp" | "custom";
  readonly spec: ArchRoutingSpec;
}

function rawValue(metadata: GgufMetadataInput, key: string): unknown {
  const v = metadata instanceof Map ? metadata.get(key) : (metadata as Record<string, unknown>)[key];
  // the shard reader's typed values: { type, value } (arrays also carry itemType)
  if (typeof v === "object" && v !== null && !ArrayBuffer.isView(v) && !Array.isArray(v) && "value" in v) {
    return (v as { value: unknown }).value;
  }
  return v;
}

function bad(key: string, value: unknown, want: string): DispatchError {
  return new DispatchError(
    "MOESWARM_ROUTING_CONFIG",
    `metadata key ${key}: expected ${want}, found ${typeof value}`,
    {
      details: { key },
    },
  );
}

function toNumber(v: unknown): number | undefined {
  if (typeof v === "number") return v;
  if (typeof v === "bigint" && v <= BigInt(Number.MAX_SAFE_INTEGER) && v >= -BigInt(Number.MAX_SAFE_INTEGER))
    return Number(v);
  return undefined;
}

function getNumber(md: GgufMetadataInput, key: string): number | undefined {
  const v = rawValue(md, key);
  if (v === undefined) return undefined;
  const n = toNumber(v);
  if (n === undefined) throw bad(key, v, "a number");
  return n;
}

/** A scalar, or element `index` of a per-layer array (llama.cpp's get_key_or_arr). */
function getNumberOrArray(md: GgufMetadataInput, key: string, index: number): number | undefined {
  const v = rawValue(md, key);
  if (v === undefined) return undefined;
  if (Array.isArray(v) || ArrayBuffer.isView(v)) {
    const arr = v as ArrayLike<unknown>;
    if (index >= arr.length) {
      throw new DispatchError(
        "MOESWARM_ROUTING_CONFIG",
        `metadata key ${key} has ${arr.length} values, no layer ${index}`,
        {
          details: { key },
        },
      );
    }
    const n = toNumber(arr[index]);
    if (n === undefined) throw bad(key, arr[index], "numbers");
    return n;
  }
  const n = toNumber(v);
  if (n === undefined) throw bad(key, v, "a number or an array");
  return n;
}

function getBool(md: GgufMetadataInput, key: string): boolean | undefined {
  const v = rawValue(md, key);
  if (v === undefined) return undefined;
  if (typeof v === "boolean") return v;
  if (v === 0 || v === 1) return v === 1;
  throw bad(key, v, "a bool");
}

function vocabSize(md: GgufMetadataInput, arch: string): number {
  const n = getNumber(md, `${arch}.vocab_size`);
  if (n !== undefined) return n;
  const tokens = rawValue(md, "tokenizer.ggml.tokens");
  return Array.isArray(tokens) || ArrayBuffer.isView(tokens) ? (tokens as ArrayLike<unknown>).length : 0;
}

function resolveGating(md: GgufMetadataInput, spec: ArchRoutingSpec): GatingFunction {
  if ("fixed" in spec.gating) return spec.gating.fixed;
  const key = `${spec.arch}.expert_gating_func`;
  const id = getNumber(md, key) ?? 0;
  if (id !== 0) {
    const g = GATING_BY_ID[id];
    if (!g)
      throw new DispatchError("MOESWARM_ROUTING_CONFIG", `${key} = ${id} is not a gating function (1..4)`, {
        details: { key },
      });
    if (spec.arch === "deepseek4" && g !== "sqrt_softplus") {
      throw new DispatchError(
        "MOESWARM_ROUTING_CONFIG",
        `deepseek4 expects sqrt_softplus gating, ${key} = ${id}`,
      );
    }
    return g;
  }
  const def = spec.gating.default;
  if (def === "deepseek2") {
    const nLayer =
      (getNumber(md, `${spec.arch}.block_count`) ?? 0) -
      (getNumber(md, `${spec.arch}.nextn_predict_layers`) ?? 0);
    return (nLayer === 47 || nLayer === 48) && vocabSize(md, spec.arch) === 154_880 ? "sigmoid" : "softmax";
  }
  if (def === "none") {
    throw new DispatchError(
      "MOESWARM_ROUTING_CONFIG",
      `${key} is missing and ${spec.arch} has no default gating (llama.cpp would abort)`,
      { details: { key } },
    );
  }
  return def;
}

function resolveActivation(md: GgufMetadataInput, spec: ArchRoutingSpec, layer: number): ExpertActivation {
  switch (spec.activation) {
    case "silu": {
      if (!spec.swigluLimit) return { kind: "silu" };
      const limit = getNumberOrArray(md, `${spec.arch}.swiglu_clamp_exp`, layer) ?? 0;
      if (!(limit > 1e-6)) return { kind: "silu" };
      const mode =
        spec.swigluLimit === "dflash"
          ? (getNumber(md, `${spec.arch}.hyper_connection.count`) ?? 0) > 0
            ? "clamp_input"
            : "clamp_output"
          : spec.swigluLimit;
      return { kind: "silu", limit: Math.fround(limit), limitMode: mode };
    }
    case "swiglu_oai":
      return { kind: "swiglu_oai", alpha: SWIGLU_OAI_ALPHA, limit: SWIGLU_OAI_LIMIT };
    case "situ":
      return {
        kind: "situ",
        beta: Math.fround(getNumber(md, `${spec.arch}.activation.situ_beta`) ?? Number.NaN),
        linearBeta: Math.fround(getNumber(md, `${spec.arch}.activation.situ_linear_beta`) ?? 0),
      };
    default:
      return { kind: spec.activation };
  }
}

/**
 * The routing of one layer of a GGUF model, derived from its metadata exactly as the pinned
 * llama.cpp does (table: {@link ROUTING_ARCHITECTURES}, README.md). Per-layer tensors are named,
 * not loaded: set `selectionBias` / `logitBias` from `selectionBiasTensor` / `logitBiasTensor`
 * when the file has them.
 */
export function routingConfigFromGguf(
  metadata: GgufMetadataInput,
  options: { layer?: number } = {},
): GgufRoutingConfig {
  if (typeof metadata !== "object" || metadata === null) {
    throw new DispatchError("MOESWARM_ROUTING_CONFIG", "metadata must be a Map or an object of GGUF keys");
  }
  const layer = options.layer ?? 0;
  if (!Number.isInteger(layer) || layer < 0) {
    throw new DispatchError("MOESWARM_ROUTING_CONFIG", "layer must be a non-negative integer");
  }
  const arch = rawValue(metadata, "general.architecture");
  if (typeof arch !== "string") {
    throw new DispatchError("MOESWARM_ROUTING_CONFIG", "general.architecture is missing", {
      details: { key: "general.architecture" },
    });
  }
  const spec = BY_ARCH.get(arch);
  if (!spec) {
    throw new DispatchError(
      "MOESWARM_ROUTING_CONFIG",
      `architecture ${JSON.stringify(arch)} has no routed experts in llama.cpp 80fb11ac73e6`,
      { details: { arch } },
    );
  }
  const nExpert = getNumber(metadata, `${arch}.expert_count`) ?? 0;
  if (nExpert === 0) {
    throw new GgufError(
      "MOESWARM_GGUF_NOT_MOE",
      `${arch}.expert_count is missing or 0: the model has no routed experts`,
      {
        details: { key: `${arch}.expert_count` },
      },
    );
  }
  const nExpertUsed =
    getNumberOrArray(metadata, `${arch}.expert_used_count`, spec.perLayerK ? layer : 0) ?? 0;
  const normalize =
    spec.normalize === "key" ? (getBool(metadata, `${arch}.expert_weights_norm`) ?? false) : spec.normalize;
  const scale = spec.scale ? Math.fround(getNumber(metadata, `${arch}.expert_weights_scale`) ?? 0) : 0;
  const nExpertGroups = getNumber(metadata, `${arch}.expert_group_count`) ?? 0;
  const nGroupUsed = getNumber(metadata, `${arch}.expert_group_used_count`) ?? 0;
  const config: GgufRoutingConfig = {
    arch,
    layer,
    spec,
    nExpert,
    nExpertUsed,
    gating: resolveGating(metadata, spec),
    normalize,
    scale,
    nExpertGroups,
    nGroupUsed,
    activation: resolveActivation(metadata, spec, layer),
    logitsSource: spec.logits,
    ...(spec.selectOn ? { selectOn: spec.selectOn } : {}),
    ...(spec.weightBeforeFfn ? { weightBeforeFfn: true } : {}),
    ...(spec.selectionBias ? { selectionBiasTensor: `blk.${layer}.exp_probs_b.bias` } : {}),
    ...(spec.logitBias ? { logitBiasTensor: `blk.${layer}.ffn_gate_inp.bias` } : {}),
  };
  if (nExpert > 1024) {
    throw new DispatchError(
      "MOESWARM_ROUTING_CONFIG",
      `${arch}.expert_count ${nExpert} exceeds LLAMA_MAX_EXPERTS (1024)`,
    );
  }
  validateRoutingConfig(config);
  return config;
}

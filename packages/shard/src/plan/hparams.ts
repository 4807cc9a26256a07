import { GgufError } from "@moeswarm/core";
import { GgufValueType } from "../gguf-constants.js";
import { getInteger, getNumberArray, getString } from "../gguf-metadata.js";
import type { GgufHeader } from "../gguf-reader.js";

/**
 * The hyper-parameters that decide how much memory llama.cpp (pinned release) allocates beside
 * the weights: the KV cache of attention layers and the fixed-size state of recurrent ones.
 * Read as `llama_model::load_hparams` and the architectures' `load_arch_hparams` read them.
 */
export interface ModelHparams {
  readonly arch: string;
  /** `<arch>.block_count`: every block, MTP/NextN blocks included (`n_layer_all`). */
  readonly nLayerAll: number;
  /** `<arch>.nextn_predict_layers`: the last blocks that only multi-token prediction uses. */
  readonly nLayerNextn: number;
  readonly nEmbd: number;
  /** Rows of `token_embd` (`n_vocab`). */
  readonly nVocab: number;
  /** Per block (length `nLayerAll`). */
  readonly nHead: readonly number[];
  readonly nHeadKv: readonly number[];
  /** Head sizes of keys and values (`n_embd_head_k`/`_v`: key_length/value_length, else n_embd/n_head). */
  readonly headK: number;
  readonly headV: number;
  /** Multi-head latent attention (DeepSeek-style): the cache holds K only. */
  readonly mla: boolean;
  /** Per block: a recurrent (linear-attention, SSM, RWKV...) block, which keeps a state instead of a KV cache. */
  readonly recurrent: readonly boolean[];
  /** The architecture keeps a hybrid memory (attention + recurrent) whose layer filters skip MTP blocks. */
  readonly hybrid: boolean;
  /** Floats per sequence of a recurrent block's rolling (conv) state: `n_embd_r()`. */
  readonly nEmbdR: number;
  /** Floats per sequence of a recurrent block's SSM/delta-net state: `n_embd_s()`. */
  readonly nEmbdS: number;
  readonly nExpert: number;
  readonly nExpertUsed: number;
  /** Width of one routed expert (ne[0] of ffn_down_exps; 0 without experts). */
  readonly nFfExp: number;
  /** Width of the shared expert (ne[0] of ffn_down_shexp; 0 without one). */
  readonly nFfShexp: number;
}

// src/llama-arch.cpp llm_arch_is_recurrent / llm_arch_is_hybrid of the pinned release.
const RECURRENT_ARCHS = new Set(["mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"]);
const HYBRID_ARCHS = new Set([
  "jamba",
  "falcon-h1",
  "plamo2",
  "granitehybrid",
  "lfm2",
  "lfm2moe",
  "nemotron_h",
  "nemotron_h_moe",
  "qwen3next",
  "kimi-linear",
  "bailingmoe3",
  "kimi-k3",
  "qwen35",
  "qwen35moe",
  "qwen4exp",
  "deepseek4",
  "minimax-01",
]);
// Hybrids whose linear-attention blocks are every block but each `full_attention_interval`-th
// (src/models/qwen3next.cpp, qwen35.cpp, qwen35moe.cpp, qwen4exp.cpp, minimax-01.cpp).
const INTERVAL_ARCHS = new Set(["qwen3next", "qwen35", "qwen35moe", "qwen4exp", "minimax-01"]);
// Hybrids whose MTP blocks are filtered out of both caches (llama-model.cpp create_memory).
const MTP_FILTERED = INTERVAL_ARCHS;

function has(header: GgufHeader, key: string): boolean {
  return header.metadata.has(key);
}

/** `get_key_or_arr`: a scalar fills every block; an array must have one entry per block. */
function perLayer(header: GgufHeader, key: string, n: number, fallback: readonly number[]): number[] {
  if (!has(header, key)) return [...fallback];
  const values = getNumberArray(header, key);
  if (header.metadata.get(key)!.type !== GgufValueType.ARRAY) return Array(n).fill(values[0]);
  if (values.length !== n) {
    throw new GgufError("MOESWARM_GGUF_MISSING_KEY", `${key} has ${values.length} entries for ${n} blocks`, {
      details: { key, entries: values.length, blocks: n },
    });
  }
  return [...values];
}

function boolPerLayer(header: GgufHeader, key: string, n: number): boolean[] | undefined {
  const v = header.metadata.get(key);
  if (v === undefined) return undefined;
  if (v.type === GgufValueType.BOOL) return Array(n).fill(v.value);
  if (v.type === GgufValueType.ARRAY && v.itemType === GgufValueType.BOOL) {
    const items = v.value as readonly boolean[];
    if (items.length !== n) {
      throw new GgufError("MOESWARM_GGUF_MISSING_KEY", `${key} has ${items.length} entries for ${n} blocks`, {
        details: { key, entries: items.length, blocks: n },
      });
    }
    return [...items];
  }
  return perLayer(header, key, n, []).map((x) => x !== 0);
}

function int(header: GgufHeader, key: string, fallback = 0): number {
  return has(header, key) ? getInteger(header, key) : fallback;
}

/** src/llama-hparams.h of the pinned release: llama.cpp refuses models beyond these. */
export const LLAMA_MAX_LAYERS = 512;
export const LLAMA_MAX_EXPERTS = 1024;

/** Reads the memory-relevant hyper-parameters of a model from its GGUF header. */
export function modelHparams(header: GgufHeader): ModelHparams {
  const arch = getString(header, "general.architecture");
  const k = (key: string) => `${arch}.${key}`;
  const nLayerAll = getInteger(header, k("block_count"));
  // src/llama-hparams.h LLAMA_MAX_LAYERS.
  if (!Number.isSafeInteger(nLayerAll) || nLayerAll < 1 || nLayerAll > LLAMA_MAX_LAYERS) {
    throw new GgufError("MOESWARM_GGUF_MISSING_KEY", `${k("block_count")} = ${nLayerAll} is out of range`);
  }
  const nLayerNextn = Math.min(int(header, k("nextn_predict_layers")), nLayerAll);
  const nLayer = nLayerAll - nLayerNextn;
  const nEmbd = getInteger(header, k("embedding_length"));
  const nHead = perLayer(header, k("attention.head_count"), nLayerAll, Array(nLayerAll).fill(0));
  // llama.cpp: n_head_kv defaults to n_head.
  const nHeadKv = perLayer(header, k("attention.head_count_kv"), nLayerAll, nHead);
  const head0 = nHead[0] ?? 0;
  const headDefault = head0 > 0 ? Math.floor(nEmbd / head0) : 0;
  const headK = int(header, k("attention.key_length"), headDefault);
  const headV = int(header, k("attention.value_length"), headDefault);
  const mla = has(header, k("attention.key_length_mla"));

  const hybrid = HYBRID_ARCHS.has(arch);
  let recurrent: boolean[];
  if (RECURRENT_ARCHS.has(arch)) recurrent = Array(nLayerAll).fill(true);
  else if (!hybrid) recurrent = Array(nLayerAll).fill(false);
  else {
    const listed = boolPerLayer(header, k("attention.recurrent_layers"), nLayerAll);
    if (listed) recurrent = listed;
    else if (INTERVAL_ARCHS.has(arch)) {
      const interval = int(header, k("full_attention_interval"), 4);
      recurrent = Array.from({ length: nLayerAll }, (_, i) => i < nLayer && (i + 1) % interval !== 0);
    } else if (arch === "falcon-h1") recurrent = Array(nLayerAll).fill(true);
    else recurrent = nHeadKv.map((h) => h === 0);
  }

  // llama_hparams::n_embd_r() / n_embd_s() of the pinned release.
  const dConv = int(header, k("ssm.conv_kernel"));
  const dInner = int(header, k("ssm.inner_size"));
  const dState = int(header, k("ssm.state_size"));
  const nGroup = int(header, k("ssm.group_count"));
  const wkvHead = int(header, k("wkv.head_size"));
  const tokenShift = int(header, k("token_shift_count"), 2);
  const shortconv = int(header, k("shortconv.l_cache"));
  const kdaHead = int(header, k("kda.head_dim"));
  let nEmbdR: number;
  let nEmbdS: number;
  if (wkvHead !== 0) {
    nEmbdR = tokenShift * nEmbd;
    nEmbdS = nEmbd * wkvHead;
  } else if (shortconv !== 0) {
    nEmbdR = nEmbd * (shortconv - 1);
    nEmbdS = dState * dInner;
  } else if (kdaHead !== 0) {
    nEmbdR = 3 * (dConv > 0 ? dConv - 1 : 3) * head0 * kdaHead;
    nEmbdS = kdaHead * kdaHead * head0;
  } else {
    nEmbdR = (dConv > 0 ? dConv - 1 : 0) * (dInner + 2 * nGroup * dState);
    nEmbdS = dState * dInner;
  }

  // Expert widths from the tensors themselves: `llama` (Mixtral) keeps them in feed_forward_length,
  // the qwen MoEs in expert_feed_forward_length, others derive them.
  const tensor = (re: RegExp) => header.tensors.find((t) => re.test(t.name));
  const down = tensor(/^blk\.\d+\.ffn_down_(ch|)exps\.weight$/);
  const gateUp = tensor(/^blk\.\d+\.ffn_gate_up_exps\.weight$/);
  const nFfExp =
    down?.shape[0] ?? (gateUp ? (gateUp.shape[1] ?? 0) / 2 : int(header, k("expert_feed_forward_length")));
  const shexp = tensor(/^blk\.\d+\.ffn_down_shexp\.weight$/);
  const nFfShexp = shexp?.shape[0] ?? int(header, k("expert_shared_feed_forward_length"));
  const embd = header.tensors.find((t) => t.name === "token_embd.weight");
  const nVocab = embd?.shape[1] ?? int(header, k("vocab_size"));
  return {
    arch,
    nLayerAll,
    nLayerNextn,
    nEmbd,
    nVocab,
    nHead,
    nHeadKv,
    headK,
    headV,
    mla,
    recurrent,
    hybrid,
    nEmbdR,
    nEmbdS,
    nExpert: int(header, k("expert_count")),
    nExpertUsed: int(header, k("expert_used_count")),
    nFfExp,
    nFfShexp,
  };
}

/**
 * Blocks that hold a KV cache (llama_kv_cache's constructor with the memory's layer filter):
 * every block for a plain model (MTP blocks included: the unfiltered cache spans `n_layer_all`),
 * for a hybrid only the non-recurrent blocks below the MTP ones, none for a recurrent model.
 */
export function kvLayers(hp: ModelHparams): number[] {
  const out: number[] = [];
  const nLayer = hp.nLayerAll - hp.nLayerNextn;
  for (let il = 0; il < hp.nLayerAll; il++) {
    if (hp.recurrent[il]) continue;
    if (hp.hybrid && MTP_FILTERED.has(hp.arch) && il >= nLayer) continue;
    if (RECURRENT_ARCHS.has(hp.arch)) continue;
    out.push(il);
  }
  return out;
}

/** Blocks that keep a recurrent state (llama_memory_recurrent with the hybrid's filter). */
export function recurrentLayers(hp: ModelHparams): number[] {
  const nLayer = hp.nLayerAll - hp.nLayerNextn;
  const out: number[] = [];
  for (let il = 0; il < hp.nLayerAll; il++) {
    if (!hp.recurrent[il]) continue;
    if (hp.hybrid && MTP_FILTERED.has(hp.arch) && il >= nLayer) continue;
    out.push(il);
  }
  return out;
}

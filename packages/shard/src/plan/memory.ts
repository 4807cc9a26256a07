import { InvalidArgumentError } from "@moeswarm/core";
import { GgmlType, ggmlTensorBytes } from "../ggml-type.js";
import { kvLayers, type ModelHparams, recurrentLayers } from "./hparams.js";

/** KV cache types llama.cpp accepts for `--cache-type-k/-v` (common/arg.cpp kv_cache_types). */
export const KV_CACHE_TYPES = [
  "f32",
  "f16",
  "bf16",
  "q8_0",
  "q4_0",
  "q4_1",
  "iq4_nl",
  "q5_0",
  "q5_1",
] as const;
export type KvCacheType = (typeof KV_CACHE_TYPES)[number];

const KV_GGML: Record<KvCacheType, GgmlType> = {
  f32: GgmlType.F32,
  f16: GgmlType.F16,
  bf16: GgmlType.BF16,
  q8_0: GgmlType.Q8_0,
  q4_0: GgmlType.Q4_0,
  q4_1: GgmlType.Q4_1,
  iq4_nl: GgmlType.IQ4_NL,
  q5_0: GgmlType.Q5_0,
  q5_1: GgmlType.Q5_1,
};

export function kvCacheGgmlType(type: KvCacheType): GgmlType {
  const t = KV_GGML[type];
  if (t === undefined) {
    throw new InvalidArgumentError(
      `kvType must be one of ${KV_CACHE_TYPES.join(", ")}, got ${JSON.stringify(type)}`,
    );
  }
  return t;
}

/** The context llama.cpp would create (llama_context's constructor). */
export interface ContextShape {
  /** `--ctx-size` (n_ctx); llama.cpp pads it to a multiple of 256. */
  readonly ctx: number;
  /** `--batch-size` (n_batch, default 2048): the most tokens one llama_decode takes. */
  readonly batch: number;
  /** `--ubatch-size` (n_ubatch, default 512): the tokens of one graph evaluation. */
  readonly ubatch: number;
  /** `--parallel` (n_seq_max, default 1). */
  readonly seqs: number;
  readonly kvType: KvCacheType;
  readonly kvTypeV: KvCacheType;
  /** `--flash-attn`: with it off the V cache is stored transposed and attention scores are materialised. */
  readonly flashAttention: boolean;
  /** `--kv-unified` (default off: one stream per sequence). */
  readonly kvUnified: boolean;
}

const pad = (n: number, to: number) => Math.ceil(n / to) * to;

/** KV cells per stream and streams, as llama_context pads n_ctx and splits it between sequences. */
export function kvCells(shape: ContextShape): { cellsPerStream: number; streams: number } {
  const nCtx = pad(shape.ctx, 256);
  if (shape.kvUnified || shape.seqs === 1) return { cellsPerStream: nCtx, streams: 1 };
  const perSeq = pad(Math.floor(nCtx / shape.seqs), 256);
  return { cellsPerStream: perSeq, streams: shape.seqs };
}

export interface KvCacheSize {
  /** Blocks with a KV cache. */
  readonly layers: readonly number[];
  readonly cells: number;
  readonly k: bigint;
  readonly v: bigint;
  readonly total: bigint;
}

/**
 * Bytes of llama_kv_cache for this context (src/llama-kv-cache.cpp): per attention block a K
 * tensor of `n_embd_k_gqa x cells x streams` and a V tensor of `n_embd_v_gqa` (the maximum over
 * blocks when V is transposed, i.e. without flash attention) in the cache types; no V for MLA.
 */
export function kvCacheSize(hp: ModelHparams, shape: ContextShape): KvCacheSize {
  const layers = kvLayers(hp);
  const { cellsPerStream, streams } = kvCells(shape);
  const kType = kvCacheGgmlType(shape.kvType);
  const vType = kvCacheGgmlType(shape.kvTypeV);
  const vMax = Math.max(0, ...layers.map((il) => hp.nHeadKv[il]! * hp.headV));
  let k = 0n;
  let v = 0n;
  for (const il of layers) {
    const nK = hp.nHeadKv[il]! * hp.headK;
    const nV = shape.flashAttention ? hp.nHeadKv[il]! * hp.headV : vMax;
    if (nK === 0) continue;
    k += ggmlTensorBytes(kType, [nK, cellsPerStream, streams]);
    if (!hp.mla) v += ggmlTensorBytes(vType, [nV, cellsPerStream, streams]);
  }
  return { layers, cells: cellsPerStream * streams, k, v, total: k + v };
}

export interface RecurrentStateSize {
  readonly layers: readonly number[];
  /** Per block: `(n_embd_r + n_embd_s) x 4` bytes per sequence (the states are f32). */
  readonly perLayer: bigint;
  readonly total: bigint;
}

/**
 * Bytes of llama_memory_recurrent (src/llama-memory-recurrent.cpp): per recurrent block an f32
 * `r` tensor of n_embd_r and an `s` tensor of n_embd_s per row, `max(1, n_seq_max)` rows (no
 * rollback snapshots: n_rs_seq = 0). It does not grow with the context.
 */
export function recurrentStateSize(hp: ModelHparams, shape: Pick<ContextShape, "seqs">): RecurrentStateSize {
  const layers = recurrentLayers(hp);
  const rows = BigInt(Math.max(1, shape.seqs));
  const perLayer = BigInt(hp.nEmbdR + hp.nEmbdS) * 4n * rows;
  return { layers, perLayer, total: layers.length === 0 ? 0n : perLayer * BigInt(layers.length) };
}

/** The terms of the compute-buffer estimate, in bytes. */
export interface ComputeEstimate {
  /** Tokens of one graph evaluation: min(n_ctx, n_ubatch). */
  readonly tokens: number;
  /** f32 logits of the reserved graph: n_vocab x min(tokens, n_batch). */
  readonly logits: bigint;
  /** Without flash attention, the f32 scores n_head x n_kv x tokens of a full context (else 0). */
  readonly attentionScores: bigint;
  /**
   * The attention mask n_kv x tokens (f16 with flash attention, f32 without), one block's f32
   * activations per token (routed and shared FFN intermediates, hidden states) and a recurrent
   * block's state in and out.
   */
  readonly activations: bigint;
  /**
   * With expert layers in host memory and tokens >= 32, the GPU backend runs their MoE products
   * itself (`op_offload`) and copies one layer's expert weights into its compute buffer.
   */
  readonly offloadCopy: bigint;
  /** max(logits, attentionScores) + activations + offloadCopy. */
  readonly total: bigint;
}

/** The CUDA backend offloads host-weight ops from this batch size (GGML_OP_OFFLOAD_MIN_BATCH). */
export const OP_OFFLOAD_MIN_BATCH = 32;

/**
 * An estimate of the compute buffer llama.cpp reserves on the device that holds the output layer
 * (llama_context::sched_reserve: a worst-case graph of min(n_ctx, n_ubatch) tokens). The graph
 * allocator reuses memory between nodes, so the largest single tensor — usually the f32 logits,
 * without flash attention the attention scores of a full context — dominates; on top of it sit
 * the live activations of one block and, when expert layers stay in host memory, the copy of
 * one layer's expert weights that op offloading makes for prompt batches. Calibrated against
 * llama.cpp's own reserve (a no_alloc context of the pinned release on the CPU backend, see
 * test/plan-llama.test.ts): an upper bound everywhere there, 1-18% above it for the
 * Qwen3.5-122B shape at contexts up to 32k (64% at 262144, where the f16 mask shares memory with
 * the logits), up to 2.3x for tiny test models. GPU backends fuse differently, hence `reserve`.
 */
export function estimateComputeBuffer(
  hp: ModelHparams,
  shape: ContextShape,
  offloadedLayerBytes: bigint,
): ComputeEstimate {
  const tokens = Math.min(pad(shape.ctx, 256), shape.ubatch);
  const T = BigInt(tokens);
  const outputs = BigInt(Math.min(tokens, shape.batch));
  const logits = BigInt(hp.nVocab) * outputs * 4n;
  const { cellsPerStream, streams } = kvCells(shape);
  const nKv = BigInt(cellsPerStream * streams);
  const attention = kvLayers(hp).length > 0;
  const nHeadMax = BigInt(Math.max(0, ...hp.nHead));
  // Without flash attention the f32 scores of a full context, which never live at the same time
  // as the logits; the KQ mask (f16 with flash attention, f32 without) may.
  const mask = attention ? nKv * T * (shape.flashAttention ? 2n : 4n) : 0n;
  const attentionScores = shape.flashAttention || !attention ? 0n : nHeadMax * nKv * T * 4n;
  // One block's live f32 activations per token: routed and shared expert intermediates, hidden states.
  const floats = BigInt(3 * hp.nExpertUsed * hp.nFfExp + 3 * hp.nFfShexp + 4 * hp.nEmbd);
  // A recurrent block reads its state and writes the next one, per sequence.
  const state =
    recurrentLayers(hp).length > 0 ? 2n * BigInt(hp.nEmbdR + hp.nEmbdS) * 4n * BigInt(shape.seqs) : 0n;
  const activations = T * floats * 4n + mask + state;
  const offloadCopy = tokens >= OP_OFFLOAD_MIN_BATCH ? offloadedLayerBytes : 0n;
  const big = logits > attentionScores ? logits : attentionScores;
  return {
    tokens,
    logits,
    attentionScores,
    activations,
    offloadCopy,
    total: big + activations + offloadCopy,
  };
}

/**
 * Host memory llama.cpp uses beside the weights it maps: the CPU backend's compute buffer (the
 * token-embedding lookup, and the MoE products of host-resident expert layers for batches the
 * GPU does not take) and the logits output buffer of one output per sequence.
 */
export function estimateHostBuffers(
  hp: ModelHparams,
  shape: ContextShape,
  expertLayersOnHost: boolean,
): bigint {
  const tokens = BigInt(Math.min(pad(shape.ctx, 256), shape.ubatch));
  const moe = expertLayersOnHost ? BigInt(3 * hp.nExpertUsed * hp.nFfExp) : 0n;
  const compute = tokens * (BigInt(2 * hp.nEmbd) + moe) * 4n;
  const output = BigInt(hp.nVocab) * BigInt(Math.max(1, shape.seqs)) * 4n;
  return compute + output;
}

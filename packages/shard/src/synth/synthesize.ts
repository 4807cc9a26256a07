import { createHash, randomBytes } from "node:crypto";
import { open, rename, unlink } from "node:fs/promises";
import type { Writable } from "node:stream";
import { GgufError, InvalidArgumentError, onAbort, throwIfAborted } from "@moeswarm/core";
import { writeAll } from "../atomic-file.js";
import type { GgmlType } from "../ggml-type.js";
import { type GgufPlan, planGguf, writeGguf } from "../gguf-writer.js";
import { quantize } from "../quant/quantize.js";
import { directBlocks, hasDirectBlocks } from "./direct-blocks.js";
import { syntheticLanguageModel } from "./language-model.js";
import { streamFor } from "./prng.js";
import {
  type ResolvedSyntheticOptions,
  type SyntheticMoeOptions,
  type SynthModelSpec,
  type SynthTensorSpec,
  syntheticModelSpec,
} from "./spec.js";

export interface SynthesizeProgress {
  bytesWritten: number;
  totalBytes: number;
}

/**
 * Encodes f32 values as a ggml type, `ne0` values per row. Must write exactly what `quantize`
 * does (ggml_quantize_chunk's bytes): a faster encoder gives the same file.
 */
export type SynthQuantizer = (
  type: GgmlType,
  values: Float32Array,
  ne0: number,
) => Uint8Array | Promise<Uint8Array>;

export interface SynthesizeOptions {
  signal?: AbortSignal;
  onProgress?: (progress: SynthesizeProgress) => void;
  /**
   * The encoder (default: the shard quantisers, a reference implementation at about 0.4 M values/s
   * for Q4_K). Shape-true models hold billions of values: pass ggml's own (worker-native's
   * `ggmlQuantize`), which writes the same bytes.
   */
  quantize?: SynthQuantizer;
}

export interface SynthesizeResult {
  /** The file written, when the target was a path. */
  readonly path: string | undefined;
  readonly size: number;
  /** sha256 (hex) of the whole file. */
  readonly sha256: string;
  readonly plan: GgufPlan;
  readonly options: ResolvedSyntheticOptions;
}

// Values drawn per chunk of a dense tensor: bounds memory whatever the tensor size.
const CHUNK_VALUES = 1 << 20;
const WRITE_BUFFER = 4 << 20;

/** The file's layout, computed without drawing a weight: its exact size and tensor offsets. */
export function planSyntheticModel(options: SyntheticMoeOptions): { spec: SynthModelSpec; plan: GgufPlan } {
  const spec = syntheticModelSpec(options);
  const plan = planGguf({
    metadata: spec.metadata,
    tensors: spec.tensors.map(({ name, shape, type }) => ({ name, shape, type })),
  });
  return { spec, plan };
}

/**
 * Writes only the header of the synthetic model and extends the file to its full size as a sparse
 * hole: what the planner and `readGguf` see of a real model of that shape, at the cost of a few
 * megabytes (the tokenizer) and no weights. Options like the shape-true preset's with the real
 * layer count and vocabulary give the header of the real model.
 */
export async function writeSyntheticHeader(
  options: SyntheticMoeOptions,
  path: string,
  opts: { signal?: AbortSignal } = {},
): Promise<{ spec: SynthModelSpec; plan: GgufPlan }> {
  const spec = syntheticModelSpec(options);
  const plan = await writeGguf(
    {
      metadata: spec.metadata,
      tensors: spec.tensors.map(({ name, shape, type }) => ({ name, shape, type })),
    },
    path,
    { headerOnly: true, signal: opts.signal },
  );
  return { spec, plan };
}

const referenceQuantizer: SynthQuantizer = (type, values, ne0) => quantize(type, values, ne0);

/**
 * The bytes of one tensor, in bounded chunks, each expert slab from its own stream: drawn and
 * encoded, or (`direct`, routed experts only) written as random valid blocks. Only the experts:
 * with every Q4_K tensor of a small Q4_K_M qwen35moe direct, swapping every pair of experts no
 * longer changed 64 greedy tokens; with the dense tensors quantised it did from token 8, as with
 * everything quantised from token 0-1 (cause not found). The experts are 96% of a shape-true model.
 */
async function* tensorChunks(
  seed: number,
  t: SynthTensorSpec,
  encode: SynthQuantizer,
  direct: boolean,
): AsyncGenerator<Uint8Array> {
  const ne0 = t.shape[0] ?? 1;
  const blocks = direct && t.perExpert && t.mean === 0 && hasDirectBlocks(t.type, t.std);
  if (t.perExpert) {
    const slab = ne0 * (t.shape[1] ?? 1);
    const values = blocks ? undefined : new Float32Array(slab);
    const nExpert = t.shape[2] ?? 1;
    for (let e = 0; e < nExpert; e++) {
      const rng = streamFor(seed, t.name, e);
      if (!values) yield directBlocks(t.type, slab, t.std, rng);
      else {
        rng.fillTriangular(values, t.std, t.mean);
        yield await encode(t.type, values, ne0);
      }
    }
    return;
  }
  let rows = 1;
  for (let d = 1; d < t.shape.length; d++) rows *= t.shape[d]!;
  const rowsPerChunk = Math.max(1, Math.floor(CHUNK_VALUES / ne0));
  const rng = streamFor(seed, t.name, 0);
  for (let r = 0; r < rows; r += rowsPerChunk) {
    const values = new Float32Array(Math.min(rowsPerChunk, rows - r) * ne0);
    rng.fillTriangular(values, t.std, t.mean);
    yield await encode(t.type, values, ne0);
  }
}

// token_embd and output carry the language model (language-model.ts) in every family.
const LANGUAGE_MODEL_ROWS: Readonly<Record<string, "embeddingRow" | "outputRow">> = {
  "token_embd.weight": "embeddingRow",
  "output.weight": "outputRow",
};

/** The bytes of token_embd or output: the language model's rows, in bounded chunks. */
async function* languageModelChunks(
  o: ResolvedSyntheticOptions,
  t: SynthTensorSpec,
  kind: "embeddingRow" | "outputRow",
  encode: SynthQuantizer,
): AsyncGenerator<Uint8Array> {
  const [ne0 = 1, rows = 1] = t.shape;
  const lm = syntheticLanguageModel(rows, ne0, o.seed, o.logitStd / 4);
  const rowsPerChunk = Math.max(1, Math.floor(CHUNK_VALUES / ne0));
  for (let r = 0; r < rows; r += rowsPerChunk) {
    const n = Math.min(rowsPerChunk, rows - r);
    const values = new Float32Array(n * ne0);
    for (let i = 0; i < n; i++) lm[kind](r + i, values.subarray(i * ne0, (i + 1) * ne0));
    yield await encode(t.type, values, ne0);
  }
}

/** Every byte of the file in order: header, padding, each tensor and its padding. */
async function* fileChunks(
  spec: SynthModelSpec,
  plan: GgufPlan,
  encode: SynthQuantizer,
): AsyncGenerator<Uint8Array> {
  yield plan.header;
  let pos = BigInt(plan.header.byteLength);
  for (let i = 0; i < plan.tensors.length; i++) {
    const planned = plan.tensors[i]!;
    if (planned.absoluteOffset > pos) yield new Uint8Array(Number(planned.absoluteOffset - pos));
    let n = 0n;
    const t = spec.tensors[i]!;
    const lmRows = LANGUAGE_MODEL_ROWS[t.name];
    const chunks = lmRows
      ? languageModelChunks(spec.options, t, lmRows, encode)
      : tensorChunks(spec.options.seed, t, encode, spec.options.weights === "direct");
    for await (const chunk of chunks) {
      n += BigInt(chunk.byteLength);
      yield chunk;
    }
    if (n !== planned.nbytes) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_TENSOR",
        `synthesised ${n} bytes for ${planned.name}, planned ${planned.nbytes}`,
      );
    }
    pos = planned.absoluteOffset + n;
  }
  if (plan.totalSize > pos) yield new Uint8Array(Number(plan.totalSize - pos));
}

interface ChunkSink {
  write(chunk: Uint8Array): Promise<void>;
  finish(): Promise<void>;
  abandon(): Promise<void>;
}

async function fileSink(path: string): Promise<ChunkSink> {
  const tmp = `${path}.${process.pid}-${randomBytes(4).toString("hex")}.tmp`;
  let handle: Awaited<ReturnType<typeof open>>;
  try {
    handle = await open(tmp, "wx");
  } catch (error) {
    throw new GgufError("MOESWARM_GGUF_IO", `cannot create ${tmp}: ${(error as Error).message}`, {
      cause: error,
    });
  }
  let buffer = new Uint8Array(WRITE_BUFFER);
  let used = 0;
  let closed = false;
  const flush = async () => {
    await writeAll(handle, buffer.subarray(0, used));
    used = 0;
  };
  const io = async <T>(what: string, fn: () => Promise<T>): Promise<T> => {
    try {
      return await fn();
    } catch (error) {
      throw new GgufError("MOESWARM_GGUF_IO", `${what} ${path}: ${(error as Error).message}`, {
        cause: error,
      });
    }
  };
  return {
    write: (chunk) =>
      io("writing", async () => {
        if (used + chunk.byteLength > buffer.byteLength) await flush();
        if (chunk.byteLength > buffer.byteLength) {
          await writeAll(handle, chunk);
          return;
        }
        buffer.set(chunk, used);
        used += chunk.byteLength;
      }),
    finish: () =>
      io("writing", async () => {
        await flush();
        buffer = new Uint8Array(0);
        closed = true;
        await handle.close();
        // Renamed only once complete, so a crash never leaves a half-written model at `path`.
        await rename(tmp, path);
      }),
    async abandon() {
      if (!closed) await handle.close().catch(() => undefined);
      await unlink(tmp).catch(() => undefined);
    },
  };
}

function streamSink(sink: Writable, signal: AbortSignal | undefined): ChunkSink {
  return {
    write(chunk) {
      return new Promise<void>((resolve, reject) => {
        const cleanup = () => {
          abort[Symbol.dispose]();
          sink.removeListener("error", onError);
          sink.removeListener("drain", onDrain);
        };
        const onError = (error: Error) => {
          cleanup();
          reject(new GgufError("MOESWARM_GGUF_IO", `writing the model: ${error.message}`, { cause: error }));
        };
        const onDrain = () => {
          cleanup();
          resolve();
        };
        const abort = onAbort(signal, (reason) => {
          cleanup();
          reject(reason);
        });
        sink.once("error", onError);
        if (sink.write(chunk)) {
          cleanup();
          resolve();
        } else sink.once("drain", onDrain);
      });
    },
    finish: () => Promise.resolve(),
    abandon: () => Promise.resolve(),
  };
}

/**
 * Writes a deterministic synthetic MoE model that llama.cpp loads and decodes: the tensors and
 * keys the pinned release requires for `qwen3moe`, `qwen2moe` (with a shared expert) or
 * `mixtral` (`llama` with experts), a byte-level BPE tokenizer learned from English text, and
 * weights drawn from a seeded generator (no clock, no Math.random: the same options give the
 * same bytes) and quantised with the shard quantisers. Memory stays bounded: weights are drawn
 * one expert slab or 1M values at a time. A path target is written beside it and renamed when
 * complete; a Writable is written and left open.
 */
export async function synthesizeMoeModel(
  options: SyntheticMoeOptions,
  target: string | Writable,
  opts: SynthesizeOptions = {},
): Promise<SynthesizeResult> {
  const { signal, onProgress } = opts;
  const encode = opts.quantize ?? referenceQuantizer;
  throwIfAborted(signal);
  const { spec, plan } = planSyntheticModel(options);
  let sink: ChunkSink;
  if (typeof target === "string") {
    if (target.length === 0) throw new InvalidArgumentError("the output path is empty");
    sink = await fileSink(target);
  } else if (typeof target === "object" && target !== null && typeof target.write === "function") {
    sink = streamSink(target, signal);
  } else {
    throw new InvalidArgumentError("synthesizeMoeModel needs a path or a Writable");
  }
  const hash = createHash("sha256");
  const total = Number(plan.totalSize);
  let written = 0;
  let sinceYield = 0;
  try {
    for await (const chunk of fileChunks(spec, plan, encode)) {
      throwIfAborted(signal);
      hash.update(chunk);
      await sink.write(chunk);
      written += chunk.byteLength;
      onProgress?.({ bytesWritten: written, totalBytes: total });
      // Generation is CPU-bound: let timers and abort signals run between chunks.
      sinceYield += chunk.byteLength;
      if (sinceYield >= 16 << 20) {
        sinceYield = 0;
        await new Promise<void>((r) => setImmediate(r));
      }
    }
    throwIfAborted(signal);
    await sink.finish();
  } catch (error) {
    await sink.abandon();
    throw error;
  }
  return {
    path: typeof target === "string" ? target : undefined,
    size: written,
    sha256: hash.digest("hex"),
    plan,
    options: spec.options,
  };
}

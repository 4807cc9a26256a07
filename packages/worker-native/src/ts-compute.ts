import type { FileHandle } from "node:fs/promises";
import { open } from "node:fs/promises";
import { GgufError, InvalidArgumentError, NativeError, sumSlots, throwIfAborted } from "@moeswarm/core";
import { dequantize, readGguf } from "@moeswarm/shard";
import {
  type Activation,
  checkRunRequest,
  type ExpertCompute,
  type ExpertComputeInfo,
  type RunOptions,
  type RunRequest,
} from "./expert-compute.js";
import { RunQueue } from "./run-queue.js";
import {
  layoutDequantizable,
  layoutInfo,
  type SliceLayer,
  type SliceLayout,
  type SliceTensor,
  sliceLayout,
} from "./slice-layout.js";

// The portable path: the same expert FFN in TypeScript, for hosts without a native binary.
// Weights are dequantised with shard (bit for bit ggml's to_float), the matrix-vector products
// accumulate in f64 and each output is rounded to f32; so it agrees with ggml to the error of
// ggml's own activation quantisation (q8_0/q8_K), not bit for bit.

export interface TsLoadOptions {
  /** Override the activation chosen from `general.architecture`. */
  act?: Activation | "auto";
  /** Bytes of dequantised f32 expert weights kept between runs (default 256 MiB). */
  cacheBytes?: number;
  signal?: AbortSignal;
}

/** One expert's dequantised weights of one layer. */
interface ExpertWeights {
  gate: Float32Array | undefined; // [nFf][nEmbd]
  up: Float32Array; // [nFf][nEmbd] (the up half of a merged tensor)
  down: Float32Array; // [nEmbd][nFf]
  gateBias: Float32Array | undefined;
  upBias: Float32Array | undefined;
  downBias: Float32Array | undefined;
  gateScale: number;
  upScale: number;
  downScale: number;
  bytes: number;
}

const DEFAULT_CACHE_BYTES = 256 * 1024 * 1024;

function gelu(x: number): number {
  return 0.5 * x * (1 + Math.tanh(0.7978845608028654 * x * (1 + 0.044715 * x * x)));
}

function silu(x: number): number {
  return x / (1 + Math.exp(-x));
}

/** y[r] = sum_c w[r*cols + c] * x[c], accumulated in f64. */
function matVec(
  w: Float32Array,
  rows: number,
  cols: number,
  x: Float64Array | Float32Array,
  y: Float64Array,
): void {
  for (let r = 0; r < rows; r++) {
    const base = r * cols;
    let s0 = 0;
    let s1 = 0;
    let s2 = 0;
    let s3 = 0;
    let c = 0;
    for (; c + 3 < cols; c += 4) {
      s0 += w[base + c]! * x[c]!;
      s1 += w[base + c + 1]! * x[c + 1]!;
      s2 += w[base + c + 2]! * x[c + 2]!;
      s3 += w[base + c + 3]! * x[c + 3]!;
    }
    for (; c < cols; c++) s0 += w[base + c]! * x[c]!;
    y[r] = s0 + s1 + (s2 + s3);
  }
}

export class TsExpertCompute implements ExpertCompute {
  readonly info: ExpertComputeInfo;
  readonly #layout: SliceLayout;
  readonly #file: FileHandle;
  readonly #queue = new RunQueue();
  readonly #experts: ReadonlySet<number>;
  readonly #local: ReadonlyMap<number, number>;
  readonly #cache = new Map<string, ExpertWeights>();
  readonly #cacheLimit: number;
  #cacheBytes = 0;
  #closed = false;

  private constructor(layout: SliceLayout, file: FileHandle, cacheBytes: number) {
    this.#layout = layout;
    this.#file = file;
    this.#cacheLimit = cacheBytes;
    this.info = { backend: "ts", ...layoutInfo(layout) };
    this.#experts = new Set(layout.experts);
    this.#local = new Map(layout.experts.map((g, i) => [g, i]));
  }

  static async load(slicePath: string, options: TsLoadOptions = {}): Promise<TsExpertCompute> {
    throwIfAborted(options.signal);
    const cacheBytes = options.cacheBytes ?? DEFAULT_CACHE_BYTES;
    if (!Number.isSafeInteger(cacheBytes) || cacheBytes < 0) {
      throw new InvalidArgumentError(`cacheBytes must be a non-negative integer, got ${String(cacheBytes)}`);
    }
    const header = await readGguf(slicePath, options.signal ? { signal: options.signal } : {});
    const layout = sliceLayout(header, options.act ? { act: options.act } : {});
    const why = layoutDequantizable(layout);
    if (why) throw new GgufError("MOESWARM_GGUF_UNSUPPORTED_TYPE", why);
    let file: FileHandle;
    try {
      file = await open(slicePath, "r");
    } catch (cause) {
      throw new GgufError("MOESWARM_GGUF_IO", `cannot open ${slicePath}: ${(cause as Error).message}`, {
        cause,
      });
    }
    return new TsExpertCompute(layout, file, cacheBytes);
  }

  run(request: RunRequest, options: RunOptions = {}): Promise<Float32Array> {
    if (this.#closed)
      return Promise.reject(new NativeError("MOESWARM_NATIVE_CLOSED", "the expert compute was closed"));
    let n: number;
    try {
      n = checkRunRequest(request, this.info, this.#experts);
    } catch (error) {
      return Promise.reject(error);
    }
    const signal = options.signal;
    return this.#queue.enqueue(() => this.#compute(request, n, signal), signal);
  }

  async #read(t: SliceTensor, start: number, length: number): Promise<Uint8Array> {
    const buf = new Uint8Array(length);
    let done = 0;
    while (done < length) {
      const { bytesRead } = await this.#file.read(buf, done, length - done, t.offset + start + done);
      if (bytesRead === 0)
        throw new GgufError("MOESWARM_GGUF_TRUNCATED", `${t.name}: the file ends inside the tensor`);
      done += bytesRead;
    }
    return buf;
  }

  /** Slab `e` of a 3-D tensor as f32 (rows of ne[0]). */
  async #slab(t: SliceTensor, e: number): Promise<Float32Array> {
    const slabBytes = t.nbytes / t.shape[2]!;
    const n = t.shape[0]! * t.shape[1]!;
    return dequantize(t.type, await this.#read(t, e * slabBytes, slabBytes), n);
  }

  async #row(t: SliceTensor | undefined, e: number): Promise<Float32Array | undefined> {
    if (!t) return undefined;
    const n = t.shape[0]!;
    const bytes = await this.#read(t, e * n * 4, n * 4);
    return new Float32Array(bytes.buffer, bytes.byteOffset, n);
  }

  async #scale(t: SliceTensor | undefined, e: number): Promise<number> {
    if (!t) return 1;
    const bytes = await this.#read(t, e * 4, 4);
    return new DataView(bytes.buffer, bytes.byteOffset, 4).getFloat32(0, true);
  }

  async #weights(L: SliceLayer, e: number): Promise<ExpertWeights> {
    const key = `${L.layer}:${e}`;
    const hit = this.#cache.get(key);
    if (hit) {
      this.#cache.delete(key);
      this.#cache.set(key, hit);
      return hit;
    }
    let gate: Float32Array | undefined;
    let up: Float32Array;
    let gateBias: Float32Array | undefined;
    let upBias: Float32Array | undefined;
    const half = L.nFf * this.#layout.nEmbd;
    if (L.gateUp) {
      const gu = await this.#slab(L.gateUp, e);
      gate = gu.subarray(0, half);
      up = gu.subarray(half);
      const b = await this.#row(L.gateUpBias, e);
      if (b) {
        gateBias = b.subarray(0, L.nFf);
        upBias = b.subarray(L.nFf);
      }
    } else {
      up = await this.#slab(L.up!, e);
      gate = L.gate ? await this.#slab(L.gate, e) : undefined;
      gateBias = await this.#row(L.gateBias, e);
      upBias = await this.#row(L.upBias, e);
    }
    const down = await this.#slab(L.down, e);
    const w: ExpertWeights = {
      gate,
      up,
      down,
      gateBias,
      upBias,
      downBias: await this.#row(L.downBias, e),
      gateScale: await this.#scale(L.gateScale, e),
      upScale: await this.#scale(L.upScale, e),
      downScale: await this.#scale(L.downScale, e),
      bytes: 4 * (up.length + (gate?.length ?? 0) + down.length),
    };
    if (w.bytes <= this.#cacheLimit) {
      this.#cache.set(key, w);
      this.#cacheBytes += w.bytes;
      for (const [k, v] of this.#cache) {
        if (this.#cacheBytes <= this.#cacheLimit) break;
        this.#cache.delete(k);
        this.#cacheBytes -= v.bytes;
      }
    }
    return w;
  }

  /** One expert's FFN on one token, as build_moe_ffn orders it: matmul, scale, bias, activation. */
  #ffn(L: SliceLayer, w: ExpertWeights, x: Float32Array, out: Float32Array, outOffset: number): void {
    const nEmbd = this.#layout.nEmbd;
    const nFf = L.nFf;
    const u = new Float64Array(nFf);
    matVec(w.up, nFf, nEmbd, x, u);
    let g: Float64Array | undefined;
    if (w.gate) {
      g = new Float64Array(nFf);
      matVec(w.gate, nFf, nEmbd, x, g);
    }
    for (let r = 0; r < nFf; r++) {
      u[r] = u[r]! * w.upScale + (w.upBias ? w.upBias[r]! : 0);
      if (g) g[r] = g[r]! * w.gateScale + (w.gateBias ? w.gateBias[r]! : 0);
    }
    const a = new Float64Array(nFf);
    const act = this.#layout.act;
    const limit = L.swigluLimit;
    for (let r = 0; r < nFf; r++) {
      const up = u[r]!;
      const gt = g ? g[r]! : up;
      let v: number;
      switch (act) {
        case "silu":
          if (limit > 0) {
            const cu = Math.min(Math.max(up, -limit), limit);
            v =
              this.#layout.arch === "deepseek4"
                ? silu(Math.min(gt, limit)) * cu
                : Math.min(silu(gt), limit) * cu;
          } else {
            v = g ? silu(gt) * up : silu(up);
          }
          break;
        case "gelu":
          v = g ? gelu(gt) * up : gelu(up);
          break;
        case "relu":
          v = g ? Math.max(gt, 0) * up : Math.max(up, 0);
          break;
        case "swiglu_oai": {
          const xg = Math.min(gt, 7);
          const yl = Math.min(Math.max(up, -7), 7);
          v = (xg / (1 + Math.exp(-1.702 * xg))) * (yl + 1);
          break;
        }
        case "relu_sqr": {
          const rl = Math.max(up, 0);
          v = rl * rl;
          break;
        }
      }
      a[r] = v;
    }
    const y = new Float64Array(nEmbd);
    matVec(w.down, nEmbd, nFf, a, y);
    for (let r = 0; r < nEmbd; r++) {
      out[outOffset + r] = y[r]! * w.downScale + (w.downBias ? w.downBias[r]! : 0);
    }
  }

  async #compute(request: RunRequest, n: number, signal: AbortSignal | undefined): Promise<Float32Array> {
    const { layer, ids, k, w: weights, mode } = request;
    // checkRunRequest refused q8 rows: this compute takes f32 only
    const x = request.x as Float32Array;
    const L = this.#layout.layers.find((l) => l.layer === layer)!;
    const nEmbd = this.#layout.nEmbd;
    const each = new Float32Array(n * k * nEmbd);
    // group the slots by expert so each expert's weights are fetched once per run
    const byExpert = new Map<number, number[]>();
    for (let s = 0; s < ids.length; s++) {
      const id = ids[s]!;
      if (id === -1) continue;
      const local = this.#local.get(id)!;
      let list = byExpert.get(local);
      if (!list) {
        list = [];
        byExpert.set(local, list);
      }
      list.push(s);
    }
    for (const [e, slots] of byExpert) {
      throwIfAborted(signal);
      const w = await this.#weights(L, e);
      for (const s of slots) {
        const i = Math.floor(s / k);
        this.#ffn(L, w, x.subarray(i * nEmbd, (i + 1) * nEmbd), each, s * nEmbd);
      }
    }
    if (mode === "each") return each;
    return sumSlots(each, weights!, ids, { n, k, embd: nEmbd });
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#queue.idle();
    this.#cache.clear();
    await this.#file.close();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

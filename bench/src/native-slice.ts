// The set-up the native-compute benchmarks share (compute-call, expert-compute,
// expert-compute-shape): their compute thread count, the addon probe that skips a benchmark with a
// note where the addon does not load, and the synthetic quantised slice and random requests that
// compute-call and expert-compute run (one definition, so that their figures stay comparable).
import { mulberry32 } from "@moeswarm/core";
import {
  type GgmlType,
  type GgufMetadataValue,
  GgufValueType,
  ggmlTypeName,
  ggufValue,
  writeGguf,
} from "@moeswarm/shard";
import { ggmlQuantize, type NativeStatus, probeNative } from "@moeswarm/worker-native";
import type { BenchReport } from "./harness.js";

/**
 * Compute threads (MOESWARM_BENCH_THREADS, default 1): one thread keeps the figures meaningful on
 * a shared machine, where ggml's thread barriers stall whenever another process takes a core.
 */
export const THREADS = Number(process.env.MOESWARM_BENCH_THREADS) || 1;

/** The addon as probed here, or the report of a benchmark that measures nothing without it. */
export async function nativeOrSkip(): Promise<
  { status: NativeStatus & { path: string }; skipped?: undefined } | { skipped: BenchReport }
> {
  const status = await probeNative();
  if (!status.available || status.path === undefined) {
    return {
      skipped: {
        rows: [],
        ratios: {},
        notes: [`native addon unavailable, nothing measured:\n${status.message}`],
      },
    };
  }
  return { status: { ...status, path: status.path } };
}

/** n values uniform in [-scale, scale), from a PRNG seeded with `seed`. */
export function uniform(n: number, seed: number, scale: number): Float32Array {
  const r = mulberry32(seed);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = (r() * 2 - 1) * scale;
  return out;
}

/** A one-layer slice of a qwen35moe model: its shape and the ids its experts have in the model. */
export interface SliceSpec {
  type: GgmlType;
  nEmbd: number;
  nFf: number;
  nExpert: number;
  layer: number;
  /** The slice's e-th expert is the model's expert e * idStride (default 1: the first nExpert). */
  idStride?: number;
  /** `general.name`, written when given. */
  name?: string;
}

/**
 * Writes `spec`'s slice to `path`: gate, up and down of every expert, random weights (a fixed seed
 * per tensor and expert) of variance 1/row length, so that activations keep their scale through the
 * layer, quantised to `spec.type` by ggml.
 */
export async function writeExpertSlice(path: string, spec: SliceSpec): Promise<void> {
  const { type, nExpert, layer } = spec;
  const stride = spec.idStride ?? 1;
  const tensor = async (name: string, ne0: number, ne1: number, seed: number) => {
    // one expert at a time keeps the f32 staging small (12 MB at n_embd 3072, n_ff 1024)
    const parts: Uint8Array[] = [];
    for (let e = 0; e < nExpert; e++) {
      parts.push(
        await ggmlQuantize(ggmlTypeName(type), uniform(ne0 * ne1, seed * 100 + e, Math.sqrt(3 / ne0)), ne0),
      );
    }
    const data = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of parts) {
      data.set(p, at);
      at += p.length;
    }
    return { name, type, shape: [ne0, ne1, nExpert], data };
  };
  const metadata = new Map<string, GgufMetadataValue>([
    ["general.architecture", ggufValue.str("qwen35moe")],
    ...(spec.name === undefined ? [] : [["general.name", ggufValue.str(spec.name)] as const]),
    ["moeswarm.slice.layers", ggufValue.array(GgufValueType.UINT32, [layer])],
    [
      "moeswarm.slice.experts",
      ggufValue.array(
        GgufValueType.UINT32,
        [...Array(nExpert).keys()].map((e) => e * stride),
      ),
    ],
  ]);
  const tensors = [
    await tensor(`blk.${layer}.ffn_gate_exps.weight`, spec.nEmbd, spec.nFf, 1),
    await tensor(`blk.${layer}.ffn_up_exps.weight`, spec.nEmbd, spec.nFf, 2),
    await tensor(`blk.${layer}.ffn_down_exps.weight`, spec.nFf, spec.nEmbd, 3),
  ];
  await writeGguf({ metadata, tensors }, path);
}

/**
 * A mode "sum" request of n tokens on `spec`'s slice, each token with k distinct experts of the
 * slice drawn at random (by their model ids) at weight 1/k, and activations uniform in [-1, 1).
 */
export function sliceRequest(
  spec: Pick<SliceSpec, "nEmbd" | "nExpert" | "layer" | "idStride">,
  n: number,
  k: number,
  seed: number,
) {
  const stride = spec.idStride ?? 1;
  const r = mulberry32(seed);
  const ids = new Int32Array(n * k);
  const w = new Float32Array(n * k).fill(1 / k);
  for (let i = 0; i < n; i++) {
    const pool = [...Array(spec.nExpert).keys()];
    for (let j = 0; j < k; j++) ids[i * k + j] = pool.splice(Math.floor(r() * pool.length), 1)[0]! * stride;
  }
  return { layer: spec.layer, x: uniform(n * spec.nEmbd, seed, 1), ids, k, w, mode: "sum" as const };
}

import { join } from "node:path";
import {
  dequantize,
  GgmlType,
  type GgufMetadataValue,
  GgufValueType,
  type GgufWriteTensor,
  ggmlTypeName,
  ggufValue,
  quantize as shardQuantize,
  writeGguf,
} from "@moeswarm/shard";
import { rng } from "@moeswarm/testkit";
import { type NativeAddon, probeNative, requireNative } from "../src/native-binding.js";

export { rng };

export const TYPES = [
  GgmlType.F32,
  GgmlType.F16,
  GgmlType.BF16,
  GgmlType.Q8_0,
  GgmlType.Q4_0,
  GgmlType.Q4_K,
  GgmlType.Q6_K,
] as const;

/** Normal samples from a seeded PRNG (testkit's mulberry32). */
export function normals(n: number, seed: number, scale = 1): Float32Array {
  const r = rng(seed);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i += 2) {
    const u = Math.max(r(), 1e-12);
    const v = r();
    const m = Math.sqrt(-2 * Math.log(u)) * scale;
    out[i] = m * Math.cos(2 * Math.PI * v);
    if (i + 1 < n) out[i + 1] = m * Math.sin(2 * Math.PI * v);
  }
  return out;
}

let native: NativeAddon | undefined | null = null;

/** The addon when it loads, else undefined (tests that need it skip with a printed reason). */
export async function nativeAddon(): Promise<NativeAddon | undefined> {
  if (native === null) native = (await probeNative()).available ? await requireNative() : undefined;
  return native;
}

export async function quantizeWithGgml(
  type: GgmlType,
  values: Float32Array,
  nPerRow: number,
): Promise<Uint8Array> {
  const addon = await nativeAddon();
  return addon ? addon.quantize(ggmlTypeName(type), values, nPerRow) : shardQuantize(type, values, nPerRow);
}

export interface ModelSpec {
  type: GgmlType;
  nEmbd: number;
  nFf: number;
  nExpert: number;
  layers: number[];
  seed: number;
  arch?: string;
  /** ffn_gate_up_exps instead of separate gate and up tensors. */
  merged?: boolean;
  /** No gate tensor at all (up only). */
  noGate?: boolean;
  /** Per-expert biases (.bias) and scales (.scale). */
  extras?: boolean;
  /** Another type for the down projection (llama.cpp's mixes, e.g. Q4_K gate/up with Q6_K down). */
  downType?: GgmlType;
  name?: string;
}

/** One tensor of the fixture: its stored bytes and f32 values as ggml's to_float gives them. */
export interface FixtureTensor {
  name: string;
  type: GgmlType;
  shape: number[];
  data: Uint8Array;
}

export interface Fixture {
  spec: ModelSpec;
  path: string;
  tensors: Map<string, FixtureTensor>;
  dir: string;
  cleanup(): void;
}

function f32Bytes(values: Float32Array): Uint8Array {
  return new Uint8Array(values.buffer.slice(values.byteOffset, values.byteOffset + values.byteLength));
}

/** Writes a full MoE model (expert tensors only) with the given spec. */
export async function writeModel(spec: ModelSpec, dir: string): Promise<Fixture> {
  const { nEmbd, nFf, nExpert, type, seed } = spec;
  const tensors = new Map<string, FixtureTensor>();
  let s = seed;
  const add = async (name: string, t: GgmlType, shape: number[], scale: number) => {
    const n = shape.reduce((a, b) => a * b, 1);
    const values = normals(n, s++, scale);
    const data = t === GgmlType.F32 ? f32Bytes(values) : await quantizeWithGgml(t, values, shape[0]!);
    tensors.set(name, { name, type: t, shape, data });
  };
  for (const il of spec.layers) {
    const w = 1 / Math.sqrt(nEmbd);
    if (spec.merged) {
      await add(`blk.${il}.ffn_gate_up_exps.weight`, type, [nEmbd, 2 * nFf, nExpert], w);
    } else {
      if (!spec.noGate) await add(`blk.${il}.ffn_gate_exps.weight`, type, [nEmbd, nFf, nExpert], w);
      await add(`blk.${il}.ffn_up_exps.weight`, type, [nEmbd, nFf, nExpert], w);
    }
    await add(
      `blk.${il}.ffn_down_exps.weight`,
      spec.downType ?? type,
      [nFf, nEmbd, nExpert],
      1 / Math.sqrt(nFf),
    );
    if (spec.extras) {
      if (spec.merged) {
        await add(`blk.${il}.ffn_gate_up_exps.bias`, GgmlType.F32, [2 * nFf, nExpert], 0.1);
      } else {
        await add(`blk.${il}.ffn_up_exps.bias`, GgmlType.F32, [nFf, nExpert], 0.1);
        await add(`blk.${il}.ffn_up_exps.scale`, GgmlType.F32, [nExpert], 0.5);
        if (!spec.noGate) {
          await add(`blk.${il}.ffn_gate_exps.bias`, GgmlType.F32, [nFf, nExpert], 0.1);
          await add(`blk.${il}.ffn_gate_exps.scale`, GgmlType.F32, [nExpert], 0.5);
        }
      }
      await add(`blk.${il}.ffn_down_exps.bias`, GgmlType.F32, [nEmbd, nExpert], 0.1);
      await add(`blk.${il}.ffn_down_exps.scale`, GgmlType.F32, [nExpert], 0.5);
    }
  }
  const metadata = new Map<string, GgufMetadataValue>();
  metadata.set("general.architecture", ggufValue.str(spec.arch ?? "qwen3moe"));
  metadata.set("general.name", ggufValue.str(spec.name ?? "synthetic-moe"));
  const path = join(dir, `model-${ggmlTypeName(type)}-${seed}.gguf`);
  await writeGguf(
    {
      metadata,
      tensors: [...tensors.values()].map(
        (t): GgufWriteTensor => ({ name: t.name, type: t.type, shape: t.shape, data: t.data }),
      ),
    },
    path,
  );
  return { spec, path, tensors, dir, cleanup: () => {} };
}

/** One model per type of TYPES, alike but for the type; each one's seed is `seedBase + type`. */
export async function writeModelPerType(
  spec: Omit<ModelSpec, "type" | "seed">,
  seedBase: number,
  dir: string,
): Promise<Map<GgmlType, Fixture>> {
  const models = new Map<GgmlType, Fixture>();
  for (const type of TYPES) models.set(type, await writeModel({ ...spec, type, seed: seedBase + type }, dir));
  return models;
}

/**
 * A slice of a model: for each chosen layer, the byte-copied ne[2] slabs of the chosen experts
 * (in the given order), with `moeswarm.slice.layers` and `moeswarm.slice.experts`.
 */
export async function writeSlice(
  model: Fixture,
  experts: number[],
  layers: number[],
  path: string,
): Promise<void> {
  const out: GgufWriteTensor[] = [];
  for (const t of model.tensors.values()) {
    const il = Number(/^blk\.(\d+)\./.exec(t.name)![1]);
    if (!layers.includes(il)) continue;
    const ne2 = t.shape[t.shape.length - 1]!;
    const slab = t.data.byteLength / ne2;
    const data = new Uint8Array(slab * experts.length);
    experts.forEach((e, i) => {
      data.set(t.data.subarray(e * slab, (e + 1) * slab), i * slab);
    });
    out.push({ name: t.name, type: t.type, shape: [...t.shape.slice(0, -1), experts.length], data });
  }
  const metadata = new Map<string, GgufMetadataValue>();
  metadata.set("general.architecture", ggufValue.str(model.spec.arch ?? "qwen3moe"));
  metadata.set("general.name", ggufValue.str(model.spec.name ?? "synthetic-moe"));
  metadata.set("moeswarm.slice.layers", ggufValue.array(GgufValueType.UINT32, layers));
  metadata.set("moeswarm.slice.experts", ggufValue.array(GgufValueType.UINT32, experts));
  await writeGguf({ metadata, tensors: out }, path);
}

/** ggml's to_float of one expert's slab of a tensor, widened to f64. */
export async function slabF64(t: FixtureTensor, e: number): Promise<Float64Array> {
  const ne2 = t.shape[t.shape.length - 1]!;
  const slabBytes = t.data.byteLength / ne2;
  const n = t.shape.slice(0, -1).reduce((a, b) => a * b, 1);
  const bytes = t.data.subarray(e * slabBytes, (e + 1) * slabBytes);
  const addon = await nativeAddon();
  let f32: Float32Array;
  if (addon) {
    f32 = addon.dequantize(ggmlTypeName(t.type), new Uint8Array(bytes), n);
  } else {
    f32 = dequantize(t.type, new Uint8Array(bytes), n);
  }
  return Float64Array.from(f32);
}

/**
 * The type ggml's CPU backend converts the activations to before a mul_mat with weights of
 * `type` (type_traits_cpu[type].vec_dot_type at the pinned release).
 */
export function vecDotType(type: GgmlType): GgmlType {
  switch (type) {
    case GgmlType.F32:
    case GgmlType.F16:
    case GgmlType.BF16:
      return type;
    case GgmlType.Q4_0:
    case GgmlType.Q8_0:
      return GgmlType.Q8_0;
    default:
      return GgmlType.Q8_K;
  }
}

/** Values as ggml sees them after converting to `type` (block-wise for the quantised ones). */
function roundTrip(type: GgmlType, values: ArrayLike<number>): Float64Array {
  const f32 = Float32Array.from(values);
  if (type === GgmlType.F32) return Float64Array.from(f32);
  return Float64Array.from(dequantize(type, shardQuantize(type, f32, f32.length), f32.length));
}

const silu = (v: number) => v / (1 + Math.exp(-v));
const gelu = (v: number) => 0.5 * v * (1 + Math.tanh(0.7978845608028654 * v * (1 + 0.044715 * v * v)));

function matVec(w: Float64Array, rows: number, cols: number, x: ArrayLike<number>): Float64Array {
  const y = new Float64Array(rows);
  for (let r = 0; r < rows; r++) {
    let s = 0;
    for (let c = 0; c < cols; c++) s += w[r * cols + c]! * x[c]!;
    y[r] = s;
  }
  return y;
}

/**
 * The f64 oracle of one expert on one token: llama.cpp's order of matmul, scale, bias, activation.
 * With `emulate`, the matmul inputs are first converted as ggml's CPU backend converts them
 * (to the weights' vec_dot_type: f16, bf16, q8_0 or q8_K), which isolates the kernels from that
 * (deliberate, llama.cpp-wide) activation rounding.
 */
export async function oracleExpert(
  model: Fixture,
  layer: number,
  e: number,
  x0: Float32Array,
  act = "silu",
  emulate = false,
): Promise<Float64Array> {
  const { nEmbd, nFf } = model.spec;
  const t = (suffix: string) => model.tensors.get(`blk.${layer}.${suffix}`);
  const inType = (t("ffn_gate_up_exps.weight") ?? t("ffn_up_exps.weight"))!.type;
  const x = emulate ? roundTrip(vecDotType(inType), x0) : x0;
  const vec = async (suffix: string, n: number): Promise<Float64Array | undefined> => {
    const tt = t(suffix);
    if (!tt) return undefined;
    const f = new Float32Array(
      tt.data.buffer.slice(tt.data.byteOffset, tt.data.byteOffset + tt.data.byteLength),
    );
    return Float64Array.from(f.subarray(e * n, (e + 1) * n));
  };
  let gate: Float64Array | undefined;
  let up: Float64Array;
  if (t("ffn_gate_up_exps.weight")) {
    const gu = matVec(await slabF64(t("ffn_gate_up_exps.weight")!, e), 2 * nFf, nEmbd, x);
    const b = await vec("ffn_gate_up_exps.bias", 2 * nFf);
    if (b) for (let i = 0; i < 2 * nFf; i++) gu[i] = gu[i]! + b[i]!;
    gate = gu.subarray(0, nFf);
    up = gu.subarray(nFf);
  } else {
    up = matVec(await slabF64(t("ffn_up_exps.weight")!, e), nFf, nEmbd, x);
    const us = (await vec("ffn_up_exps.scale", 1))?.[0] ?? 1;
    const ub = await vec("ffn_up_exps.bias", nFf);
    for (let i = 0; i < nFf; i++) up[i] = up[i]! * us + (ub ? ub[i]! : 0);
    if (t("ffn_gate_exps.weight")) {
      gate = matVec(await slabF64(t("ffn_gate_exps.weight")!, e), nFf, nEmbd, x);
      const gs = (await vec("ffn_gate_exps.scale", 1))?.[0] ?? 1;
      const gb = await vec("ffn_gate_exps.bias", nFf);
      for (let i = 0; i < nFf; i++) gate[i] = gate[i]! * gs + (gb ? gb[i]! : 0);
    }
  }
  let a: Float64Array = new Float64Array(nFf);
  for (let i = 0; i < nFf; i++) {
    const u = emulate ? Math.fround(up[i]!) : up[i]!;
    const g = gate ? (emulate ? Math.fround(gate[i]!) : gate[i]!) : u;
    if (act === "silu") a[i] = gate ? silu(g) * u : silu(u);
    else if (act === "gelu") a[i] = gate ? gelu(g) * u : gelu(u);
    else if (act === "relu_sqr") a[i] = Math.max(u, 0) ** 2;
    else throw new Error(`oracle: no ${act}`);
  }
  if (emulate) a = roundTrip(vecDotType(t("ffn_down_exps.weight")!.type), a);
  const y = matVec(await slabF64(t("ffn_down_exps.weight")!, e), nEmbd, nFf, a);
  const ds = (await vec("ffn_down_exps.scale", 1))?.[0] ?? 1;
  const db = await vec("ffn_down_exps.bias", nEmbd);
  for (let i = 0; i < nEmbd; i++) y[i] = y[i]! * ds + (db ? db[i]! : 0);
  return y;
}

/** Oracle outputs in the "each" layout for global ids (full model: local = global). */
export async function oracleEach(
  model: Fixture,
  layer: number,
  x: Float32Array,
  ids: Int32Array,
  k: number,
  act = "silu",
  emulate = false,
): Promise<Float64Array> {
  const { nEmbd } = model.spec;
  const out = new Float64Array(ids.length * nEmbd);
  for (let s = 0; s < ids.length; s++) {
    const id = ids[s]!;
    if (id < 0) continue;
    const i = Math.floor(s / k);
    out.set(
      await oracleExpert(model, layer, id, x.subarray(i * nEmbd, (i + 1) * nEmbd), act, emulate),
      s * nEmbd,
    );
  }
  return out;
}

/** Distinct random expert ids per token (top-k style), or -1 with probability `empty`. */
export function randomIds(n: number, k: number, experts: number[], seed: number, empty = 0): Int32Array {
  const r = rng(seed);
  const ids = new Int32Array(n * k);
  for (let i = 0; i < n; i++) {
    const pool = [...experts];
    for (let j = 0; j < k; j++) {
      const pick = pool.splice(Math.floor(r() * pool.length), 1)[0]!;
      ids[i * k + j] = r() < empty ? -1 : pick;
    }
  }
  return ids;
}

/** Router-like weights: positive, summing to 1 per token. */
export function randomWeights(n: number, k: number, seed: number): Float32Array {
  const r = rng(seed);
  const w = new Float32Array(n * k);
  for (let i = 0; i < n; i++) {
    let sum = 0;
    for (let j = 0; j < k; j++) sum += w[i * k + j] = 0.05 + r();
    for (let j = 0; j < k; j++) w[i * k + j] = w[i * k + j]! / sum;
  }
  return w;
}

export function bitsEqual(a: Float32Array, b: Float32Array): boolean {
  if (a.length !== b.length) return false;
  const ua = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const ub = new Uint32Array(b.buffer, b.byteOffset, b.length);
  for (let i = 0; i < ua.length; i++) if (ua[i] !== ub[i]) return false;
  return true;
}

/** First index where two f32 arrays differ in bits, or -1. */
export function firstBitDiff(a: Float32Array, b: Float32Array): number {
  const ua = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const ub = new Uint32Array(b.buffer, b.byteOffset, b.length);
  for (let i = 0; i < Math.min(ua.length, ub.length); i++) if (ua[i] !== ub[i]) return i;
  return a.length === b.length ? -1 : Math.min(a.length, b.length);
}

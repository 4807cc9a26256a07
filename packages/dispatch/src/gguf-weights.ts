import { InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import {
  type ByteSource,
  dequantizeF64,
  type ExpertTensor,
  findExpertTensors,
  type GgufHeader,
  getNumberArray,
  SLICE_KEYS,
} from "@moeswarm/shard";
import type { ExpertMatrices, ExpertWeights } from "./oracle.js";

export interface LoadExpertWeightsOptions {
  /** Layers to load (default: every layer with routed experts). */
  readonly layers?: readonly number[];
  /** Global expert ids to load (default: all the file holds). */
  readonly experts?: readonly number[];
  readonly signal?: AbortSignal;
}

/** {@link ExpertWeights} loaded from a GGUF, with what it holds. */
export interface GgufExpertWeights extends ExpertWeights {
  readonly layers: readonly number[];
  readonly experts: readonly number[];
}

type Field = keyof ExpertMatrices;

/** `ffn_<projection>_exps.<suffix>` to the ExpertMatrices field it fills (build_moe_ffn's use of it). */
const FIELDS: Readonly<Record<string, Field>> = {
  "gate.weight": "gate",
  "up.weight": "up",
  "gate_up.weight": "gateUp",
  "down.weight": "down",
  "gate.scale": "gateScale",
  "up.scale": "upScale",
  "down.scale": "downScale",
  "gate.bias": "gateBias",
  "up.bias": "upBias",
  "gate_up.bias": "gateUpBias",
  "down.bias": "downBias",
};

/**
 * Dequantises the routed experts of a GGUF (a whole model or a moeswarm slice, whose slab i is
 * expert `moeswarm.slice.experts[i]`) into f64 {@link ExpertWeights} for the oracle: for each
 * requested (layer, expert) only that expert's slab of each `blk.N.ffn_*_exps.*` tensor is read.
 * Values are ggml's f32 dequantisation widened to f64 (shard's `dequantizeF64`).
 */
export async function loadExpertWeightsFromGguf(
  source: ByteSource,
  header: GgufHeader,
  options: LoadExpertWeightsOptions = {},
): Promise<GgufExpertWeights> {
  const layout = findExpertTensors(header);
  if (layout.layers.length === 0) throw new InvalidArgumentError("the GGUF has no routed-expert tensors");
  const sliceIds = header.metadata.has(SLICE_KEYS.experts)
    ? getNumberArray(header, SLICE_KEYS.experts)
    : undefined;
  const nSlabs = layout.layers[0]!.nExpert;
  const fileExperts = sliceIds ?? Array.from({ length: nSlabs }, (_, e) => e);
  const slabOf = new Map(fileExperts.map((id, i) => [id, i]));
  const experts = options.experts ?? fileExperts;
  const layers = options.layers ?? layout.layers.map((l) => l.layer);
  let nEmbd = 0;
  const store = new Map<string, ExpertMatrices>();
  for (const layer of layers) {
    const l = layout.layers.find((x) => x.layer === layer);
    if (!l) throw new InvalidArgumentError(`layer ${layer} has no routed-expert tensors`);
    const down = l.tensors.find((t) => t.projection === "down" && t.suffix === "weight");
    if (down?.info.shape.length !== 3)
      throw new InvalidArgumentError(`layer ${layer} has no 3-D ffn_down_exps.weight`);
    const embd = down.info.shape[1]!;
    if (nEmbd !== 0 && embd !== nEmbd)
      throw new InvalidArgumentError(`layer ${layer} has n_embd ${embd}, not ${nEmbd}`);
    nEmbd = embd;
    for (const id of experts) {
      const slab = slabOf.get(id);
      if (slab === undefined) throw new InvalidArgumentError(`expert ${id} is not in this GGUF`);
      const m: Record<string, Float64Array | number> = {};
      for (const t of l.tensors) {
        const field = FIELDS[`${t.projection}.${t.suffix}`];
        if (!field) continue; // e.g. input_scale: not applied by build_moe_ffn
        throwIfAborted(options.signal);
        m[field] = await readSlab(source, t, slab, options.signal);
      }
      for (const f of ["gateScale", "upScale", "downScale"] as const) {
        const v = m[f];
        if (v instanceof Float64Array) m[f] = v[0]!;
      }
      store.set(`${layer}:${id}`, m as unknown as ExpertMatrices);
    }
  }
  return {
    nEmbd,
    layers: [...layers],
    experts: [...experts],
    expert(layer, expert) {
      const m = store.get(`${layer}:${expert}`);
      if (!m) throw new InvalidArgumentError(`expert ${expert} of layer ${layer} was not loaded`);
      return m;
    },
  };
}

async function readSlab(
  source: ByteSource,
  t: ExpertTensor,
  slab: number,
  signal?: AbortSignal,
): Promise<Float64Array> {
  const elements = t.info.nElements / t.nExpert;
  const bytes = await source.read(t.info.absoluteOffset + BigInt(slab) * t.slabBytes, Number(t.slabBytes), {
    signal,
  });
  return dequantizeF64(t.info.type, bytes, elements);
}

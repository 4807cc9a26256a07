import { GgufError } from "@moeswarm/core";
import { ggmlTypeName, ggmlTypeTraits } from "./ggml-type.js";
import { GgufValueType } from "./gguf-constants.js";
import { getInteger, getString } from "./gguf-metadata.js";
import type { GgufHeader, GgufTensorInfo } from "./gguf-reader.js";

/** Which projection of the expert FFN a tensor belongs to. */
export type ExpertProjection = "gate" | "up" | "down" | "gate_up";

/** One routed-expert tensor of one layer: all experts' slabs stacked along its last axis. */
export interface ExpertTensor {
  readonly name: string;
  readonly layer: number;
  readonly projection: ExpertProjection;
  /** What follows `_exps.`: `weight`, `bias`, `scale`, `input_scale`... */
  readonly suffix: string;
  readonly info: GgufTensorInfo;
  /** The axis that indexes experts: the last one (ne[2] for weights, ne[1] for biases, ne[0] for scales). */
  readonly expertAxis: number;
  readonly nExpert: number;
  /** Bytes of one expert's slab: `nbytes / nExpert`; slab e lies at `absoluteOffset + e * slabBytes`. */
  readonly slabBytes: bigint;
}

/** Metadata keys of a slice (the native worker reads `layers` and `experts`: names and types are fixed). */
export const SLICE_KEYS = {
  /** str: the source model's id or name. */
  source: "moeswarm.slice.source",
  /** str: sha256 (hex) of the source's header bytes, magic to the last tensor info. */
  sourceSha256: "moeswarm.slice.source_sha256",
  /** arr[u32]: the layers in the slice, ascending. */
  layers: "moeswarm.slice.layers",
  /** arr[u32]: global expert ids, ascending: slab i of every tensor is expert experts[i]. */
  experts: "moeswarm.slice.experts",
  /** arr[str]: sha256 (hex) of each slab, tensor by tensor in file order, experts in slice order. */
  slabSha256: "moeswarm.slice.slab_sha256",
} as const;

export interface ExpertLayer {
  readonly layer: number;
  readonly nExpert: number;
  /** In the file's tensor order. */
  readonly tensors: readonly ExpertTensor[];
  /** Bytes of one expert of this layer over all its tensors. */
  readonly bytesPerExpert: bigint;
}

export interface MoeLayout {
  /** `general.architecture`, when present. */
  readonly arch: string | undefined;
  /** `<arch>.block_count`, when present. */
  readonly blockCount: number | undefined;
  /** `<arch>.expert_count`, when present. */
  readonly expertCount: number | undefined;
  /** `<arch>.expert_used_count`, when present. */
  readonly expertUsedCount: number | undefined;
  /** Layers that have routed experts, ascending. */
  readonly layers: readonly ExpertLayer[];
}

// Names from LLM_TENSOR_NAMES in src/llama-arch.cpp of the pinned release
// (blk.%d.ffn_{gate,up,down,gate_up}_exps) with the suffixes llama-model.cpp loads
// (weight, bias, scale, input_scale), and any other suffix a later release adds.
const EXPERT_TENSOR = /^blk\.(\d{1,9})\.ffn_(gate_up|gate|up|down)_exps\.([A-Za-z0-9_]+)$/;

function notMoe(message: string, details?: Record<string, unknown>): GgufError {
  return new GgufError("MOESWARM_GGUF_NOT_MOE", message, details ? { details } : {});
}

function optionalInteger(header: GgufHeader, key: string): number | undefined {
  if (!header.metadata.has(key)) return undefined;
  return getInteger(header, key);
}

/**
 * The routed-expert tensors of every layer (`blk.N.ffn_{gate,up,down,gate_up}_exps.*`), with
 * the number of experts (the tensor's last axis) and the bytes of one expert's slab. Checks that
 * a layer's tensors agree on the expert count, that it matches `<arch>.expert_count` when
 * present, and that each slab is a whole number of bytes (an expert axis that is ne[0] of a
 * block-quantised type is not). A model without such tensors has `layers: []`.
 */
export function findExpertTensors(header: GgufHeader): MoeLayout {
  const arch = header.metadata.has("general.architecture")
    ? getString(header, "general.architecture")
    : undefined;
  const expertCount = arch ? optionalInteger(header, `${arch}.expert_count`) : undefined;
  // A slice keeps the model's expert_count; its tensors hold the experts it lists.
  const sliceExperts = header.metadata.get(SLICE_KEYS.experts);
  const expected = sliceExperts?.type === GgufValueType.ARRAY ? sliceExperts.value.length : expertCount;
  const byLayer = new Map<number, ExpertTensor[]>();
  for (const info of header.tensors) {
    const m = EXPERT_TENSOR.exec(info.name);
    if (!m) continue;
    const layer = Number(m[1]);
    const projection = m[2] as ExpertProjection;
    const suffix = m[3]!;
    const expertAxis = info.shape.length - 1;
    const nExpert = info.shape[expertAxis] ?? 0;
    if (expertAxis < 0 || nExpert < 1) {
      throw notMoe(`tensor ${info.name} has shape [${info.shape.join(", ")}]: no expert axis`, {
        tensor: info.name,
      });
    }
    if (expertAxis === 0 && ggmlTypeTraits(info.type).blockSize !== 1) {
      throw new GgufError(
        "MOESWARM_GGUF_UNSUPPORTED_TYPE",
        `tensor ${info.name}: experts along ne[0] of block type ${ggmlTypeName(info.type)} cannot be sliced by bytes`,
        { details: { tensor: info.name, type: info.type } },
      );
    }
    if (info.nbytes % BigInt(nExpert) !== 0n) {
      throw notMoe(`tensor ${info.name}: ${info.nbytes} bytes do not split into ${nExpert} experts`, {
        tensor: info.name,
      });
    }
    const list = byLayer.get(layer) ?? [];
    list.push({
      name: info.name,
      layer,
      projection,
      suffix,
      info,
      expertAxis,
      nExpert,
      slabBytes: info.nbytes / BigInt(nExpert),
    });
    byLayer.set(layer, list);
  }
  const layers: ExpertLayer[] = [];
  for (const layer of [...byLayer.keys()].sort((a, b) => a - b)) {
    const tensors = byLayer.get(layer)!;
    const nExpert = tensors[0]!.nExpert;
    for (const t of tensors) {
      if (t.nExpert !== nExpert) {
        throw notMoe(
          `layer ${layer}: ${t.name} has ${t.nExpert} experts, ${tensors[0]!.name} has ${nExpert}`,
          {
            layer,
          },
        );
      }
    }
    if (expected !== undefined && nExpert !== expected) {
      const what = sliceExperts
        ? `${SLICE_KEYS.experts} lists ${expected}`
        : `${arch}.expert_count is ${expected}`;
      throw notMoe(`layer ${layer} has ${nExpert} experts, but ${what}`, { layer, nExpert, expected });
    }
    layers.push({
      layer,
      nExpert,
      tensors,
      bytesPerExpert: tensors.reduce((sum, t) => sum + t.slabBytes, 0n),
    });
  }
  return {
    arch,
    blockCount: arch ? optionalInteger(header, `${arch}.block_count`) : undefined,
    expertCount,
    expertUsedCount: arch ? optionalInteger(header, `${arch}.expert_used_count`) : undefined,
    layers,
  };
}

// The steps of planOffload that depend only on the model and the context, not on the placement
// search: classifying tensors, the cache block check, and turning a placement into llama.cpp
// flags (overrides, arguments) and notes.
import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import { ggmlTypeTraits } from "../ggml-type.js";
import type { GgufHeader } from "../gguf-reader.js";
import { LLAMA_MAX_EXPERTS, type ModelHparams } from "./hparams.js";
import { type ContextShape, kvCacheGgmlType } from "./memory.js";
import { equivalentNCpuMoe, expertOverridePattern, parseExpertTensorName } from "./override.js";

export interface TensorOverride {
  readonly pattern: string;
  readonly bufferType: string;
  /** The tensors it moves (checked by matching the pattern against every loaded tensor name). */
  readonly tensors: readonly string[];
}

// common/common.h: input-layer tensors (LLM_TENSOR_LAYER_INPUT) llama.cpp keeps on the CPU.
const INPUT_TENSOR = /^(token_embd|position_embd|token_types|per_layer_token_embd)\./;

export type TensorKind =
  | { readonly kind: "mtp"; readonly layer: number }
  | { readonly kind: "input"; readonly layer: number | undefined }
  | { readonly kind: "expert"; readonly layer: number }
  | { readonly kind: "dense"; readonly layer: number | undefined };

export interface TensorClasses {
  /** One per header tensor, in order. */
  readonly kinds: readonly TensorKind[];
  /** Routed-expert tensor names per layer, in file order. */
  readonly expertNames: ReadonlyMap<number, string[]>;
  /** Bytes of the routed-expert tensors per layer. */
  readonly expertBytes: ReadonlyMap<number, bigint>;
  /** Layers with routed experts, ascending. */
  readonly expertLayers: readonly number[];
  /** Every tensor llama.cpp loads (all but the skipped MTP blocks). */
  readonly loadedNames: readonly string[];
  readonly allExpertNames: readonly string[];
}

/** llama_init_from_model: with flash attention a quantised cache's block must divide the head size. */
export function checkCacheBlocks(hp: ModelHparams, context: ContextShape): void {
  for (const [type, head, which] of [
    [context.kvType, hp.headK, "K"],
    [context.kvTypeV, hp.headV, "V"],
  ] as const) {
    const block = ggmlTypeTraits(kvCacheGgmlType(type)).blockSize;
    if (context.flashAttention && head % block !== 0) {
      throw new InvalidArgumentError(
        `${which} cache type ${type} (blocks of ${block}) does not divide the head size ${head}`,
      );
    }
  }
}

/** Classifies every tensor once: MTP (not loaded), input, routed expert or dense. */
export function classifyTensors(header: GgufHeader, hp: ModelHparams, loadMtp: boolean): TensorClasses {
  const nLayer = hp.nLayerAll - hp.nLayerNextn;
  const expertNames = new Map<number, string[]>();
  const expertBytes = new Map<number, bigint>();
  const kinds = header.tensors.map((t): TensorKind => {
    const layerMatch = /^blk\.(\d+)\./.exec(t.name);
    const layer = layerMatch ? Number(layerMatch[1]) : undefined;
    if (layer !== undefined && layer >= hp.nLayerAll) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_TENSOR",
        `tensor ${t.name} is beyond block_count ${hp.nLayerAll}`,
        {
          details: { tensor: t.name, blockCount: hp.nLayerAll },
        },
      );
    }
    if (layer !== undefined && layer >= nLayer && !loadMtp) return { kind: "mtp", layer };
    if (INPUT_TENSOR.test(t.name)) return { kind: "input", layer };
    const expert = parseExpertTensorName(t.name);
    if (expert) {
      expertNames.set(expert.layer, [...(expertNames.get(expert.layer) ?? []), t.name]);
      expertBytes.set(expert.layer, (expertBytes.get(expert.layer) ?? 0n) + t.nbytes);
      return { kind: "expert", layer: expert.layer };
    }
    return { kind: "dense", layer };
  });
  const expertLayers = [...expertNames.keys()].sort((a, b) => a - b);
  const loadedNames = header.tensors.filter((_, i) => kinds[i]!.kind !== "mtp").map((t) => t.name);
  const allExpertNames = expertLayers.flatMap((l) => expertNames.get(l)!);
  return { kinds, expertNames, expertBytes, expertLayers, loadedNames, allExpertNames };
}

/**
 * Experts per layer for the swarm. The expert axis is the last one of every expert tensor (ne[2]
 * of weights, ne[1] of biases).
 */
export function expertCounts(header: GgufHeader, kinds: readonly TensorKind[]): Map<number, number> {
  const nExpertByLayer = new Map<number, number>();
  header.tensors.forEach((t, i) => {
    const { kind, layer } = kinds[i]!;
    if (kind !== "expert") return;
    const n = t.shape[t.shape.length - 1] ?? 1;
    if (n > LLAMA_MAX_EXPERTS) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_TENSOR",
        `${t.name}: ${n} experts, more than llama.cpp's ${LLAMA_MAX_EXPERTS}`,
        {
          details: { tensor: t.name, experts: n },
        },
      );
    }
    nExpertByLayer.set(layer, Math.max(nExpertByLayer.get(layer) ?? 1, n));
  });
  return nExpertByLayer;
}

/**
 * The overrides moving each group of layers to its buffer type, each checked against every
 * tensor llama.cpp loads (JS RegExp: the pattern uses only syntax that means the same in
 * ECMAScript std::regex). Empty groups get no override.
 */
function tensorOverrides(
  groups: readonly (readonly [readonly number[], string])[],
  expertNames: ReadonlyMap<number, string[]>,
  allExpertNames: readonly string[],
  loadedNames: readonly string[],
): TensorOverride[] {
  const overrides: TensorOverride[] = [];
  for (const [layers, bufferType] of groups) {
    if (layers.length === 0) continue;
    const pattern = expertOverridePattern(layers, allExpertNames);
    const re = new RegExp(pattern);
    const matched = loadedNames.filter((n) => re.test(n));
    const wanted = new Set(layers.flatMap((l) => expertNames.get(l)!));
    if (matched.length !== wanted.size || !matched.every((n) => wanted.has(n))) {
      throw new InvalidArgumentError(
        `internal: override ${pattern} does not match exactly the tensors of layers ${layers.join(",")}`,
      );
    }
    overrides.push({ pattern, bufferType, tensors: matched });
  }
  return overrides;
}

/**
 * The overrides of a placement (RAM layers to CPU, swarm layers to the swarm's buffer type), the
 * `--override-tensor` value they make and the equivalent `--n-cpu-moe`, when there is one.
 */
export function placementOverrides(
  ramLayers: readonly number[],
  swarmLayers: readonly number[],
  swarmBufferType: string,
  classes: Pick<TensorClasses, "expertNames" | "allExpertNames" | "loadedNames">,
): { overrides: TensorOverride[]; overrideTensor: string | undefined; nCpuMoe: number | undefined } {
  const { expertNames, allExpertNames, loadedNames } = classes;
  const overrides = tensorOverrides(
    [
      [ramLayers, "CPU"],
      [swarmLayers, swarmBufferType],
    ],
    expertNames,
    allExpertNames,
    loadedNames,
  );
  const overrideTensor =
    overrides.length === 0 ? undefined : overrides.map((o) => `${o.pattern}=${o.bufferType}`).join(",");
  const ramNames = new Set(ramLayers.flatMap((l) => expertNames.get(l)!));
  const nCpuMoe = equivalentNCpuMoe(loadedNames, ramNames);
  return { overrides, overrideTensor, nCpuMoe };
}

/** The llama-server/llama-cli arguments that load the model as planned. */
export function llamaArgsFor(context: ContextShape, overrideTensor: string | undefined): string[] {
  return [
    "--n-gpu-layers",
    "999",
    "--fit",
    "off",
    "--ctx-size",
    String(context.ctx),
    "--batch-size",
    String(context.batch),
    "--ubatch-size",
    String(context.ubatch),
    "--cache-type-k",
    context.kvType,
    "--cache-type-v",
    context.kvTypeV,
    "--flash-attn",
    context.flashAttention ? "on" : "off",
    ...(context.seqs > 1 ? ["--parallel", String(context.seqs)] : []),
    ...(context.kvUnified ? ["--kv-unified"] : []),
    ...(overrideTensor ? ["--override-tensor", overrideTensor] : []),
  ];
}

export interface PlanFacts {
  readonly mtpTensors: number;
  readonly skippedBytes: bigint;
  readonly tied: bigint;
  readonly vramFits: boolean;
  readonly ramFits: boolean;
  readonly swarmLayers: number;
  readonly swarmBufferType: string;
}

/** The plan's notes, in the order the report prints them. */
export function planNotes(f: PlanFacts): string[] {
  const notes: string[] = [];
  if (f.skippedBytes > 0n) notes.push(`${f.mtpTensors} MTP tensors are not loaded (load_mtp off)`);
  if (f.tied > 0n)
    notes.push(
      "no output.weight: llama.cpp loads token_embd a second time as the output layer (counted in VRAM)",
    );
  if (!f.vramFits)
    notes.push(
      "the dense tensors, caches and compute buffer do not fit in VRAM even with every expert layer offloaded",
    );
  if (!f.ramFits) notes.push("the offloaded expert layers do not fit in RAM");
  if (f.swarmLayers > 0) {
    notes.push(`swarm layers need the moeswarm ggml backend (buffer type ${f.swarmBufferType}) in llama.cpp`);
  }
  return notes;
}

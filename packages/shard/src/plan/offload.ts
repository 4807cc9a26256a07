import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import { ggmlTypeTraits } from "../ggml-type.js";
import type { GgufHeader } from "../gguf-reader.js";
import { LLAMA_MAX_EXPERTS, type ModelHparams, modelHparams } from "./hparams.js";
import {
  type ComputeEstimate,
  type ContextShape,
  estimateComputeBuffer,
  estimateHostBuffers,
  KV_CACHE_TYPES,
  type KvCacheSize,
  type KvCacheType,
  kvCacheGgmlType,
  kvCacheSize,
  type RecurrentStateSize,
  recurrentStateSize,
} from "./memory.js";
import { equivalentNCpuMoe, expertOverridePattern, parseExpertTensorName } from "./override.js";
import {
  assignResolved,
  demandOf,
  type ExpertDemand,
  resolveWorkers,
  type SwarmLayerInfo,
  type SwarmPlan,
  type SwarmWorker,
} from "./swarm.js";
import { type ByteSize, parseByteSize } from "./units.js";

/** Where a tensor (or an expert layer) lives. `skipped`: llama.cpp does not load it. */
export type OffloadDevice = "vram" | "ram" | "swarm" | "skipped";

/** The order in which whole expert layers leave the GPU. */
export type OffloadOrder = "last" | "first" | "demand" | readonly number[];

export interface PlanOffloadOptions {
  /** Memory of the GPU (bytes or `"64GiB"`). */
  vram: ByteSize;
  /** Host memory for what llama.cpp keeps there; unchecked when absent. */
  ram?: ByteSize;
  /** `--ctx-size` (default 4096). */
  ctx?: number;
  /** `--cache-type-k` (default f16); also the V type unless `kvTypeV` is given. */
  kvType?: KvCacheType;
  /** `--cache-type-v` (default `kvType`). */
  kvTypeV?: KvCacheType;
  /** `--batch-size` (default 2048). */
  batch?: number;
  /** `--ubatch-size` (default 512). */
  ubatch?: number;
  /** `--parallel`: sequences (default 1). */
  seqs?: number;
  /** `--kv-unified` (default false). */
  kvUnified?: boolean;
  /** `--flash-attn on|off` (default on). */
  flashAttention?: boolean;
  /**
   * The GPU compute buffer: bytes, or `"auto"` (default) for {@link estimateComputeBuffer}: the
   * f32 logits of one ubatch (or the attention scores of a full context without flash
   * attention), one block's activations, and the copy of one host-resident expert layer that
   * llama.cpp's op offloading makes for prompt batches.
   */
  reserve?: ByteSize | "auto";
  /**
   * VRAM left free (default 1 GiB, llama.cpp's `--fit-target` default): the CUDA/ROCm context,
   * allocator rounding and other processes.
   */
  margin?: ByteSize;
  /**
   * Which expert layers leave the GPU first: `"last"` (default without demand: from the end),
   * `"first"` (from the beginning: what `--n-cpu-moe` does), `"demand"` (default with demand:
   * the least-selected layers first, ties from the end), or an explicit list of layers (layers
   * not listed stay on the GPU).
   */
  order?: OffloadOrder;
  /** Load MTP/NextN blocks (`load_mtp`); default false, as llama.cpp skips them unless MTP is on. */
  loadMtp?: boolean;
  /** Swarm workers that can hold expert slices. */
  workers?: readonly SwarmWorker[];
  /** Routing statistics (per layer, selections of each expert): replicas for hot experts, and `order: "demand"`. */
  demand?: ExpertDemand;
  /**
   * Which expert layers the swarm serves (with `workers`): `"offloaded"` (default) the layers
   * that leave the GPU, as far as the workers cover them (the rest go to RAM); `"overflow"` only
   * what RAM cannot hold; or an explicit list of layers.
   */
  swarm?: "offloaded" | "overflow" | readonly number[];
  /** Most copies of one expert across workers, replicas included (default 2). */
  maxCopies?: number;
  /** The buffer type of the moeswarm ggml backend that `-ot` names for swarm layers (default MOESWARM). */
  swarmBufferType?: string;
}

export interface PlannedTensor {
  readonly name: string;
  readonly bytes: bigint;
  /** `input`: token embeddings, which llama.cpp always keeps in host memory. */
  readonly kind: "dense" | "input" | "expert" | "mtp";
  readonly layer: number | undefined;
  readonly device: OffloadDevice;
}

export interface ExpertLayerPlan {
  readonly layer: number;
  /** Bytes of the layer's routed-expert tensors. */
  readonly bytes: bigint;
  readonly device: OffloadDevice;
}

/** What one memory holds, in bytes. */
export interface DeviceTotals {
  readonly capacity: bigint | undefined;
  readonly weights: bigint;
  readonly kvCache: bigint;
  readonly recurrentState: bigint;
  /** Compute buffers (and, on the host, the logits output buffer). */
  readonly compute: bigint;
  readonly margin: bigint;
  /** Everything above. */
  readonly total: bigint;
  readonly free: bigint | undefined;
  readonly fits: boolean;
}

export interface TensorOverride {
  readonly pattern: string;
  readonly bufferType: string;
  /** The tensors it moves (checked by matching the pattern against every loaded tensor name). */
  readonly tensors: readonly string[];
}

export interface OffloadPlan {
  readonly arch: string;
  readonly blockCount: number;
  /** Sum of every tensor's bytes in the file. */
  readonly modelBytes: bigint;
  readonly tensors: readonly PlannedTensor[];
  /** Weight bytes per device; they add up to `modelBytes`. */
  readonly weights: Readonly<Record<OffloadDevice, bigint>>;
  readonly layers: readonly ExpertLayerPlan[];
  readonly vramLayers: readonly number[];
  readonly ramLayers: readonly number[];
  readonly swarmLayers: readonly number[];
  readonly vram: DeviceTotals;
  readonly ram: DeviceTotals;
  readonly context: ContextShape;
  readonly kv: KvCacheSize;
  readonly recurrent: RecurrentStateSize;
  /** The estimate; `computeBytes` is what the plan reserves (the estimate or `reserve`). */
  readonly compute: ComputeEstimate;
  readonly computeBytes: bigint;
  readonly hostBuffers: bigint;
  readonly overrides: readonly TensorOverride[];
  /** The value of llama.cpp's `--override-tensor`/`-ot`, or undefined when nothing moves. */
  readonly overrideTensor: string | undefined;
  /** `--n-cpu-moe N` moving exactly the RAM layers' tensors, when one exists. */
  readonly nCpuMoe: number | undefined;
  /** llama-server/llama-cli arguments that implement the plan. */
  readonly llamaArgs: readonly string[];
  readonly swarm: SwarmPlan | undefined;
  readonly fits: boolean;
  readonly notes: readonly string[];
}

const GIB = 1n << 30n;
// common/common.h: input-layer tensors (LLM_TENSOR_LAYER_INPUT) llama.cpp keeps on the CPU.
const INPUT_TENSOR = /^(token_embd|position_embd|token_types|per_layer_token_embd)\./;

function positiveInt(value: unknown, what: string, fallback: number, max = 1 << 24): number {
  if (value === undefined) return fallback;
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < 1 || value > max) {
    throw new InvalidArgumentError(`${what} must be an integer in [1, ${max}], got ${String(value)}`);
  }
  return value;
}

function kvType(value: unknown, what: string, fallback: KvCacheType): KvCacheType {
  if (value === undefined) return fallback;
  if (!KV_CACHE_TYPES.includes(value as KvCacheType)) {
    throw new InvalidArgumentError(
      `${what} must be one of ${KV_CACHE_TYPES.join(", ")}, got ${String(value)}`,
    );
  }
  return value as KvCacheType;
}

function resolveContext(o: PlanOffloadOptions): ContextShape {
  const ctx = positiveInt(o.ctx, "ctx", 4096);
  // llama_context: n_batch = min(n_ctx, n_batch) for causal models, n_ubatch = min(n_batch, n_ubatch).
  const batch = Math.min(positiveInt(o.batch, "batch", 2048), ctx);
  const k = kvType(o.kvType, "kvType", "f16");
  const v = kvType(o.kvTypeV, "kvTypeV", k);
  const flashAttention = o.flashAttention ?? true;
  // llama_init_from_model refuses a quantised V cache without flash attention.
  if (!flashAttention && !["f32", "f16", "bf16"].includes(v)) {
    throw new InvalidArgumentError(`a ${v} V cache needs flash attention (llama.cpp refuses it otherwise)`);
  }
  return {
    ctx,
    batch,
    ubatch: Math.min(positiveInt(o.ubatch, "ubatch", 512), batch),
    seqs: positiveInt(o.seqs, "seqs", 1, 4096),
    kvType: k,
    kvTypeV: v,
    flashAttention,
    kvUnified: o.kvUnified ?? false,
  };
}

function maxBig(a: bigint, b: bigint): bigint {
  return a > b ? a : b;
}

function sum(values: Iterable<bigint>): bigint {
  let s = 0n;
  for (const v of values) s += v;
  return s;
}

function totals(
  capacity: bigint | undefined,
  parts: { weights: bigint; kvCache?: bigint; recurrentState?: bigint; compute: bigint; margin?: bigint },
): DeviceTotals {
  const kvCache = parts.kvCache ?? 0n;
  const recurrentState = parts.recurrentState ?? 0n;
  const margin = parts.margin ?? 0n;
  const total = parts.weights + kvCache + recurrentState + parts.compute + margin;
  return {
    capacity,
    weights: parts.weights,
    kvCache,
    recurrentState,
    compute: parts.compute,
    margin,
    total,
    free: capacity === undefined ? undefined : capacity - total,
    fits: capacity === undefined || total <= capacity,
  };
}

function offloadOrder(
  order: OffloadOrder,
  expertLayers: readonly number[],
  demand: ExpertDemand | undefined,
  nExpertOf: (layer: number) => number,
): number[] {
  if (Array.isArray(order)) {
    const known = new Set(expertLayers);
    const seen = new Set<number>();
    for (const l of order as readonly number[]) {
      if (!known.has(l))
        throw new InvalidArgumentError(`order lists layer ${String(l)}, which has no routed experts`);
      if (seen.has(l)) throw new InvalidArgumentError(`order lists layer ${l} twice`);
      seen.add(l);
    }
    return [...(order as readonly number[])];
  }
  const desc = [...expertLayers].sort((a, b) => b - a);
  switch (order) {
    case "last":
      return desc;
    case "first":
      return [...expertLayers].sort((a, b) => a - b);
    case "demand": {
      if (!demand) throw new InvalidArgumentError('order "demand" needs demand statistics');
      const total = new Map(
        desc.map((l) => [l, demandOf(demand, l, nExpertOf(l))!.reduce((s, x) => s + x, 0)]),
      );
      // Stable sort of the descending list: ties leave from the end.
      return desc.sort((a, b) => total.get(a)! - total.get(b)!);
    }
    default:
      throw new InvalidArgumentError(
        `order must be "last", "first", "demand" or a list of layers, got ${String(order)}`,
      );
  }
}

/**
 * Plans where every tensor of a MoE model goes when llama.cpp (pinned release) runs it on one GPU
 * with host memory and, optionally, a swarm of workers: dense tensors and as many whole expert
 * layers as fit stay in VRAM beside the KV cache (attention blocks only; recurrent blocks of
 * hybrid architectures keep a fixed state instead), the compute buffer and a margin; expert
 * layers leave in `order` for host RAM (or the swarm) until the rest fits. Token embeddings stay
 * in host memory as llama.cpp keeps them. Returns the totals per device, the layers moved, the
 * exact `--override-tensor` value (checked against every tensor name) and the equivalent
 * `--n-cpu-moe` when there is one. A plan that cannot fit is returned with `fits: false`.
 */
export function planOffload(header: GgufHeader, options: PlanOffloadOptions): OffloadPlan {
  if (typeof options !== "object" || options === null)
    throw new InvalidArgumentError("planOffload needs an options object");
  const hp: ModelHparams = modelHparams(header);
  const context = resolveContext(options);
  // llama_init_from_model: with flash attention a quantised cache's block must divide the head size.
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
  const vramCapacity = parseByteSize(options.vram, "vram");
  const ramCapacity = options.ram === undefined ? undefined : parseByteSize(options.ram, "ram");
  const margin = options.margin === undefined ? GIB : parseByteSize(options.margin, "margin");
  const reserve =
    options.reserve === undefined || options.reserve === "auto"
      ? undefined
      : parseByteSize(options.reserve, "reserve");
  const swarmBufferType = options.swarmBufferType ?? "MOESWARM";
  if (!/^[A-Za-z0-9_]+$/.test(swarmBufferType))
    throw new InvalidArgumentError("swarmBufferType must be a buffer type name");
  const workers = options.workers === undefined ? [] : resolveWorkers(options.workers);
  const maxCopies = positiveInt(options.maxCopies, "maxCopies", 2, 64);

  // Classify every tensor once.
  const nLayer = hp.nLayerAll - hp.nLayerNextn;
  const loadMtp = options.loadMtp ?? false;
  const expertNames = new Map<number, string[]>();
  const expertBytes = new Map<number, bigint>();
  const kinds = header.tensors.map((t) => {
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
    if (layer !== undefined && layer >= nLayer && !loadMtp) return { kind: "mtp" as const, layer };
    if (INPUT_TENSOR.test(t.name)) return { kind: "input" as const, layer };
    const expert = parseExpertTensorName(t.name);
    if (expert) {
      expertNames.set(expert.layer, [...(expertNames.get(expert.layer) ?? []), t.name]);
      expertBytes.set(expert.layer, (expertBytes.get(expert.layer) ?? 0n) + t.nbytes);
      return { kind: "expert" as const, layer: expert.layer };
    }
    return { kind: "dense" as const, layer };
  });
  const expertLayers = [...expertNames.keys()].sort((a, b) => a - b);
  const loadedNames = header.tensors.filter((_, i) => kinds[i]!.kind !== "mtp").map((t) => t.name);
  const allExpertNames = expertLayers.flatMap((l) => expertNames.get(l)!);

  const denseBytes = sum(header.tensors.filter((_, i) => kinds[i]!.kind === "dense").map((t) => t.nbytes));
  const inputBytes = sum(header.tensors.filter((_, i) => kinds[i]!.kind === "input").map((t) => t.nbytes));
  // No output.weight: llama.cpp loads token_embd a second time as the output layer (TENSOR_DUPLICATED).
  const tied = header.tensors.some((t) => t.name === "output.weight")
    ? 0n
    : (header.tensors.find((t) => t.name === "token_embd.weight")?.nbytes ?? 0n);

  const kv = kvCacheSize(hp, context);
  const recurrent = recurrentStateSize(hp, context);

  // Per-layer expert shape for the swarm (bytes of one expert over the layer's expert tensors).
  // The expert axis is the last one of every expert tensor (ne[2] of weights, ne[1] of biases).
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
    nExpertByLayer.set(layer!, Math.max(nExpertByLayer.get(layer!) ?? 1, n));
  });
  const swarmInfo = (layer: number): SwarmLayerInfo => {
    const nExpert = nExpertByLayer.get(layer)!;
    return { layer, nExpert, bytesPerExpert: expertBytes.get(layer)! / BigInt(nExpert) };
  };
  const nExpertOf = (layer: number) => swarmInfo(layer).nExpert;

  const device = new Map<number, OffloadDevice>(expertLayers.map((l) => [l, "vram"]));
  const explicitSwarm = Array.isArray(options.swarm) ? (options.swarm as readonly number[]) : undefined;
  const swarmMode = explicitSwarm ? "list" : ((options.swarm as string | undefined) ?? "offloaded");
  if (!["list", "offloaded", "overflow"].includes(swarmMode)) {
    throw new InvalidArgumentError(
      `swarm must be "offloaded", "overflow" or a list of layers, got ${String(options.swarm)}`,
    );
  }
  if (explicitSwarm) {
    if (workers.length === 0) throw new InvalidArgumentError("swarm lists layers but there are no workers");
    for (const l of explicitSwarm) {
      if (!device.has(l))
        throw new InvalidArgumentError(`swarm lists layer ${String(l)}, which has no routed experts`);
      device.set(l, "swarm");
    }
  }
  const layersOn = (d: OffloadDevice) => expertLayers.filter((l) => device.get(l) === d);
  const swarmCovers = (layers: readonly number[]) =>
    assignResolved(layers.map(swarmInfo), workers, { demand: options.demand, maxCopies });

  const hostLayerMax = () => layersOn("ram").reduce((m, l) => maxBig(m, expertBytes.get(l)!), 0n);
  const computeFor = () => estimateComputeBuffer(hp, context, hostLayerMax());
  const vramTotals = () => {
    const est = computeFor();
    return totals(vramCapacity, {
      weights: denseBytes + tied + sum(layersOn("vram").map((l) => expertBytes.get(l)!)),
      kvCache: kv.total,
      recurrentState: recurrent.total,
      compute: reserve ?? est.total,
      margin,
    });
  };
  const ramTotals = () =>
    totals(ramCapacity, {
      weights: inputBytes + sum(layersOn("ram").map((l) => expertBytes.get(l)!)),
      compute: estimateHostBuffers(hp, context, layersOn("ram").length > 0),
    });

  const order = offloadOrder(
    options.order ?? (options.demand ? "demand" : "last"),
    expertLayers,
    options.demand,
    nExpertOf,
  ).filter((l) => device.get(l) === "vram");
  const useSwarmFirst = workers.length > 0 && swarmMode === "offloaded";
  for (const layer of order) {
    if (vramTotals().fits) break;
    if (useSwarmFirst && swarmCovers([...layersOn("swarm"), layer])) device.set(layer, "swarm");
    else device.set(layer, "ram");
  }
  if (workers.length > 0 && swarmMode === "overflow") {
    // RAM layers the host cannot hold go to the swarm, in offload order, while the workers cover them.
    for (const layer of order.filter((l) => device.get(l) === "ram")) {
      if (ramTotals().fits) break;
      if (swarmCovers([...layersOn("swarm"), layer])) device.set(layer, "swarm");
    }
  }

  const vram = vramTotals();
  const ram = ramTotals();
  const compute = computeFor();
  const swarmLayers = layersOn("swarm");
  const swarm = workers.length > 0 ? swarmCovers(swarmLayers) : undefined;

  const tensors: PlannedTensor[] = header.tensors.map((t, i) => {
    const { kind, layer } = kinds[i]!;
    let dev: OffloadDevice;
    if (kind === "mtp") dev = "skipped";
    else if (kind === "input") dev = "ram";
    else if (kind === "expert") dev = device.get(layer!)!;
    else dev = "vram";
    return { name: t.name, bytes: t.nbytes, kind, layer, device: dev };
  });
  const weights: Record<OffloadDevice, bigint> = { vram: 0n, ram: 0n, swarm: 0n, skipped: 0n };
  for (const t of tensors) weights[t.device] += t.bytes;

  // The overrides, each checked against every tensor llama.cpp loads (JS RegExp: the pattern uses
  // only syntax that means the same in ECMAScript std::regex).
  const overrides: TensorOverride[] = [];
  const addOverride = (layers: readonly number[], bufferType: string) => {
    if (layers.length === 0) return;
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
  };
  const ramLayers = layersOn("ram");
  addOverride(ramLayers, "CPU");
  addOverride(swarmLayers, swarmBufferType);
  const overrideTensor =
    overrides.length === 0 ? undefined : overrides.map((o) => `${o.pattern}=${o.bufferType}`).join(",");
  const ramNames = new Set(ramLayers.flatMap((l) => expertNames.get(l)!));
  const nCpuMoe = equivalentNCpuMoe(loadedNames, ramNames);

  const llamaArgs = [
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

  const notes: string[] = [];
  const skipped = weights.skipped;
  if (skipped > 0n)
    notes.push(
      `${tensors.filter((t) => t.device === "skipped").length} MTP tensors are not loaded (load_mtp off)`,
    );
  if (tied > 0n)
    notes.push(
      "no output.weight: llama.cpp loads token_embd a second time as the output layer (counted in VRAM)",
    );
  if (!vram.fits)
    notes.push(
      "the dense tensors, caches and compute buffer do not fit in VRAM even with every expert layer offloaded",
    );
  if (!ram.fits) notes.push("the offloaded expert layers do not fit in RAM");
  if (swarmLayers.length > 0) {
    notes.push(`swarm layers need the moeswarm ggml backend (buffer type ${swarmBufferType}) in llama.cpp`);
  }

  return {
    arch: hp.arch,
    blockCount: hp.nLayerAll,
    modelBytes: sum(header.tensors.map((t) => t.nbytes)),
    tensors,
    weights,
    layers: expertLayers.map((l) => ({ layer: l, bytes: expertBytes.get(l)!, device: device.get(l)! })),
    vramLayers: layersOn("vram"),
    ramLayers,
    swarmLayers,
    vram,
    ram,
    context,
    kv,
    recurrent,
    compute,
    computeBytes: vram.compute,
    hostBuffers: ram.compute,
    overrides,
    overrideTensor,
    nCpuMoe,
    llamaArgs,
    swarm,
    fits: vram.fits && ram.fits,
    notes,
  };
}

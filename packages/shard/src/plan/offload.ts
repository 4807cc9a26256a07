import { InvalidArgumentError } from "@moeswarm/core";
import type { GgufHeader } from "../gguf-reader.js";
import { type ModelHparams, modelHparams } from "./hparams.js";
import {
  type ComputeEstimate,
  type ContextShape,
  estimateComputeBuffer,
  estimateHostBuffers,
  KV_CACHE_TYPES,
  type KvCacheSize,
  type KvCacheType,
  kvCacheSize,
  type RecurrentStateSize,
  recurrentStateSize,
} from "./memory.js";
import {
  checkCacheBlocks,
  classifyTensors,
  expertCounts,
  llamaArgsFor,
  placementOverrides,
  planNotes,
  type TensorKind,
  type TensorOverride,
} from "./offload-tensors.js";
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

export type { TensorOverride } from "./offload-tensors.js";

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

/** The memory budgets and swarm settings of the options, validated. */
function resolveBudgets(options: PlanOffloadOptions) {
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
  return { vramCapacity, ramCapacity, margin, reserve, swarmBufferType, workers, maxCopies };
}

/** Bytes that do not move: dense tensors (VRAM), inputs (host) and a tied output layer (VRAM). */
function fixedBytes(header: GgufHeader, kinds: readonly TensorKind[]) {
  const denseBytes = sum(header.tensors.filter((_, i) => kinds[i]!.kind === "dense").map((t) => t.nbytes));
  const inputBytes = sum(header.tensors.filter((_, i) => kinds[i]!.kind === "input").map((t) => t.nbytes));
  // No output.weight: llama.cpp loads token_embd a second time as the output layer (TENSOR_DUPLICATED).
  const tied = header.tensors.some((t) => t.name === "output.weight")
    ? 0n
    : (header.tensors.find((t) => t.name === "token_embd.weight")?.nbytes ?? 0n);
  return { denseBytes, inputBytes, tied };
}

/** Every expert layer in VRAM, except those the options send to the swarm explicitly. */
function initialDevices(
  expertLayers: readonly number[],
  swarmOption: PlanOffloadOptions["swarm"],
  nWorkers: number,
): { device: Map<number, OffloadDevice>; swarmMode: string } {
  const device = new Map<number, OffloadDevice>(expertLayers.map((l) => [l, "vram"]));
  const explicitSwarm = Array.isArray(swarmOption) ? (swarmOption as readonly number[]) : undefined;
  const swarmMode = explicitSwarm ? "list" : ((swarmOption as string | undefined) ?? "offloaded");
  if (!["list", "offloaded", "overflow"].includes(swarmMode)) {
    throw new InvalidArgumentError(
      `swarm must be "offloaded", "overflow" or a list of layers, got ${String(swarmOption)}`,
    );
  }
  if (explicitSwarm) {
    if (nWorkers === 0) throw new InvalidArgumentError("swarm lists layers but there are no workers");
    for (const l of explicitSwarm) {
      if (!device.has(l))
        throw new InvalidArgumentError(`swarm lists layer ${String(l)}, which has no routed experts`);
      device.set(l, "swarm");
    }
  }
  return { device, swarmMode };
}

/** Where each tensor ends up, and the weight bytes per device. */
function plannedTensors(
  header: GgufHeader,
  kinds: readonly TensorKind[],
  device: ReadonlyMap<number, OffloadDevice>,
): { tensors: PlannedTensor[]; weights: Record<OffloadDevice, bigint> } {
  const tensors: PlannedTensor[] = header.tensors.map((t, i) => {
    const { kind, layer } = kinds[i]!;
    let dev: OffloadDevice;
    if (kind === "mtp") dev = "skipped";
    else if (kind === "input") dev = "ram";
    else if (kind === "expert") dev = device.get(layer)!;
    else dev = "vram";
    return { name: t.name, bytes: t.nbytes, kind, layer, device: dev };
  });
  const weights: Record<OffloadDevice, bigint> = { vram: 0n, ram: 0n, swarm: 0n, skipped: 0n };
  for (const t of tensors) weights[t.device] += t.bytes;
  return { tensors, weights };
}

/**
 * The placement search: expert layers leave VRAM in `order` (for the swarm first when it can take
 * them, else host RAM) until the rest fits; with `overflow`, RAM layers the host cannot hold then
 * go to the swarm, in the same order, while the workers cover them.
 */
function moveLayers(
  order: readonly number[],
  device: Map<number, OffloadDevice>,
  s: {
    vramFits(): boolean;
    ramFits(): boolean;
    swarmTakes(layer: number): boolean;
    swarmFirst: boolean;
    overflow: boolean;
  },
): void {
  for (const layer of order) {
    if (s.vramFits()) break;
    if (s.swarmFirst && s.swarmTakes(layer)) device.set(layer, "swarm");
    else device.set(layer, "ram");
  }
  if (!s.overflow) return;
  for (const layer of order.filter((l) => device.get(l) === "ram")) {
    if (s.ramFits()) break;
    if (s.swarmTakes(layer)) device.set(layer, "swarm");
  }
}

/** Per-layer expert shape for the swarm (bytes of one expert over the layer's expert tensors). */
function swarmLayerInfo(
  nExpertByLayer: ReadonlyMap<number, number>,
  expertBytes: ReadonlyMap<number, bigint>,
): (layer: number) => SwarmLayerInfo {
  return (layer) => {
    const nExpert = nExpertByLayer.get(layer)!;
    return { layer, nExpert, bytesPerExpert: expertBytes.get(layer)! / BigInt(nExpert) };
  };
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
  checkCacheBlocks(hp, context);
  const { vramCapacity, ramCapacity, margin, reserve, swarmBufferType, workers, maxCopies } =
    resolveBudgets(options);

  const { kinds, expertNames, expertBytes, expertLayers, loadedNames, allExpertNames } = classifyTensors(
    header,
    hp,
    options.loadMtp ?? false,
  );
  const { denseBytes, inputBytes, tied } = fixedBytes(header, kinds);

  const kv = kvCacheSize(hp, context);
  const recurrent = recurrentStateSize(hp, context);
  const swarmInfo = swarmLayerInfo(expertCounts(header, kinds), expertBytes);
  const nExpertOf = (layer: number) => swarmInfo(layer).nExpert;

  const { device, swarmMode } = initialDevices(expertLayers, options.swarm, workers.length);
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
  moveLayers(order, device, {
    vramFits: () => vramTotals().fits,
    ramFits: () => ramTotals().fits,
    swarmTakes: (layer) => swarmCovers([...layersOn("swarm"), layer]) !== undefined,
    swarmFirst: workers.length > 0 && swarmMode === "offloaded",
    overflow: workers.length > 0 && swarmMode === "overflow",
  });

  const vram = vramTotals();
  const ram = ramTotals();
  const compute = computeFor();
  const swarmLayers = layersOn("swarm");
  const swarm = workers.length > 0 ? swarmCovers(swarmLayers) : undefined;

  const { tensors, weights } = plannedTensors(header, kinds, device);

  const ramLayers = layersOn("ram");
  const { overrides, overrideTensor, nCpuMoe } = placementOverrides(ramLayers, swarmLayers, swarmBufferType, {
    expertNames,
    allExpertNames,
    loadedNames,
  });

  const llamaArgs = llamaArgsFor(context, overrideTensor);

  const notes = planNotes({
    mtpTensors: tensors.filter((t) => t.device === "skipped").length,
    skippedBytes: weights.skipped,
    tied,
    vramFits: vram.fits,
    ramFits: ram.fits,
    swarmLayers: swarmLayers.length,
    swarmBufferType,
  });

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

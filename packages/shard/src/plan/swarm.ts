import { InvalidArgumentError, type Range, toRanges } from "@moeswarm/core";
import { type ByteSize, parseByteSize } from "./units.js";

/** A worker of the swarm that may hold expert slices. */
export interface SwarmWorker {
  /** The worker's peer id (its `hello`/`register` id). */
  readonly id: string;
  /** Bytes of expert weights it can hold. */
  readonly capacity: ByteSize;
  /** At most this many layers in its slice. */
  readonly maxLayers?: number;
  /** At most this many experts per layer in its slice. */
  readonly maxExperts?: number;
}

/**
 * Routing statistics: per layer, how often each expert was selected (index = global expert id).
 * A Map or a plain object keyed by layer.
 */
export type ExpertDemand =
  | ReadonlyMap<number, ArrayLike<number>>
  | Readonly<Record<number, ArrayLike<number>>>;

/**
 * What one worker holds: a block of layers x experts, which is what a `register` frame announces
 * (the same experts for every listed layer) and what one hub `expert-shard` request downloads.
 */
export interface SwarmSlice {
  /** Ascending; consecutive in the offload order of the swarm layers. */
  readonly layers: readonly number[];
  /** Global expert ids, ascending (a contiguous range for a primary slice). */
  readonly experts: readonly number[];
  /** `experts` as half-open ranges. */
  readonly expertRanges: readonly Range[];
  readonly bytes: bigint;
  /** A primary slice covers its experts the first time; a replica holds extra copies of hot experts. */
  readonly role: "primary" | "replica";
}

export interface SwarmAssignment {
  readonly worker: string;
  readonly capacity: bigint;
  /** At most one slice per worker: one registration, one download. */
  readonly slice: SwarmSlice | undefined;
}

export interface SwarmPlan {
  readonly layers: readonly number[];
  readonly assignments: readonly SwarmAssignment[];
  /** Copies of each expert: `copies[layer][expert]`. */
  readonly copies: ReadonlyMap<number, readonly number[]>;
  /** Bytes of one copy of every expert of the swarm layers. */
  readonly bytes: bigint;
  /** Bytes held by the workers, replicas included. */
  readonly heldBytes: bigint;
}

/** Bytes of one expert of a layer (over all its expert tensors), and the expert count. */
export interface SwarmLayerInfo {
  readonly layer: number;
  readonly nExpert: number;
  readonly bytesPerExpert: bigint;
}

/** A worker with its limits resolved. */
export interface ResolvedWorker {
  readonly id: string;
  readonly capacity: bigint;
  readonly maxLayers: number;
  readonly maxExperts: number;
}

interface Worker extends ResolvedWorker {
  slice?: SwarmSlice;
}

export function resolveWorkers(workers: readonly SwarmWorker[]): ResolvedWorker[] {
  if (!Array.isArray(workers)) throw new InvalidArgumentError("workers must be an array");
  const ids = new Set<string>();
  return workers.map((w, i) => {
    if (typeof w !== "object" || w === null)
      throw new InvalidArgumentError(`workers[${i}] must be an object`);
    if (typeof w.id !== "string" || w.id.length === 0 || Buffer.byteLength(w.id) > 128) {
      throw new InvalidArgumentError(`workers[${i}].id must be a string of 1..128 bytes`);
    }
    if (ids.has(w.id)) throw new InvalidArgumentError(`worker id ${JSON.stringify(w.id)} appears twice`);
    ids.add(w.id);
    const limit = (v: number | undefined, what: string) => {
      if (v === undefined) return Number.MAX_SAFE_INTEGER;
      if (!Number.isSafeInteger(v) || v < 1)
        throw new InvalidArgumentError(`workers[${i}].${what} must be a positive integer`);
      return v;
    };
    return {
      id: w.id,
      capacity: parseByteSize(w.capacity, `workers[${i}].capacity`),
      maxLayers: limit(w.maxLayers, "maxLayers"),
      maxExperts: limit(w.maxExperts, "maxExperts"),
    };
  });
}

/** Per-layer expert counts of `demand` as numbers (0 where absent). */
export function demandOf(
  demand: ExpertDemand | undefined,
  layer: number,
  nExpert: number,
): number[] | undefined {
  if (demand === undefined) return undefined;
  const row =
    demand instanceof Map ? demand.get(layer) : (demand as Record<number, ArrayLike<number>>)[layer];
  if (row === undefined) return Array(nExpert).fill(0);
  if (row.length !== nExpert)
    throw new InvalidArgumentError(`demand for layer ${layer} has ${row.length} entries, not ${nExpert}`);
  return Array.from(row, (x, e) => {
    if (typeof x !== "number" || !Number.isFinite(x) || x < 0) {
      throw new InvalidArgumentError(`demand[${layer}][${e}] must be a non-negative number`);
    }
    return x;
  });
}

function sliceOf(
  layers: readonly SwarmLayerInfo[],
  experts: readonly number[],
  role: "primary" | "replica",
): SwarmSlice {
  const bytes = layers.reduce((s, l) => s + l.bytesPerExpert, 0n) * BigInt(experts.length);
  return {
    layers: layers.map((l) => l.layer),
    experts,
    expertRanges: toRanges(experts),
    bytes,
    role,
  };
}

const range = (a: number, b: number) => Array.from({ length: b - a }, (_, i) => a + i);

/**
 * Tiles `layers` x experts with one block per worker, largest workers first: a worker that holds
 * whole layers takes the longest run of whole layers it can, a smaller one a contiguous expert
 * range of the next layer (the best-fitting worker finishes a layer). Returns undefined when the
 * workers cannot cover every expert of every layer once.
 */
function tile(layers: readonly SwarmLayerInfo[], workers: Worker[]): Worker[] | undefined {
  const free = [...workers].sort((a, b) =>
    a.capacity === b.capacity ? 0 : a.capacity > b.capacity ? -1 : 1,
  );
  let i = 0;
  let expertStart = 0;
  while (i < layers.length) {
    const layer = layers[i]!;
    const remaining = layer.nExpert - expertStart;
    if (expertStart === 0) {
      // Whole layers: the largest worker that holds at least this one.
      const w = free.find(
        (x) => x.maxExperts >= layer.nExpert && x.capacity >= layer.bytesPerExpert * BigInt(layer.nExpert),
      );
      if (w) {
        let j = i;
        let used = 0n;
        while (j < layers.length && j - i < w.maxLayers) {
          const l = layers[j]!;
          const b = l.bytesPerExpert * BigInt(l.nExpert);
          if (l.nExpert !== layer.nExpert || used + b > w.capacity) break;
          used += b;
          j++;
        }
        w.slice = sliceOf(layers.slice(i, j), range(0, layer.nExpert), "primary");
        free.splice(free.indexOf(w), 1);
        i = j;
        continue;
      }
    }
    // Part of a layer: the smallest worker that finishes it, else the largest.
    const fits = (x: Worker) =>
      x.maxExperts >= remaining && x.capacity >= layer.bytesPerExpert * BigInt(remaining);
    const finisher = [...free].reverse().find(fits);
    const w = finisher ?? free[0];
    if (!w) return undefined;
    const n = Math.min(
      remaining,
      w.maxExperts,
      Number(w.capacity / (layer.bytesPerExpert > 0n ? layer.bytesPerExpert : 1n)),
    );
    if (n < 1) return undefined;
    w.slice = sliceOf([layer], range(expertStart, expertStart + n), "primary");
    free.splice(free.indexOf(w), 1);
    expertStart += n;
    if (expertStart >= layer.nExpert) {
      expertStart = 0;
      i++;
    }
  }
  return workers;
}

/**
 * Assigns the experts of `layers` to `workers`, one slice each: first every expert once (see
 * `tile`), then, with demand statistics, each worker left over holds a replica of the hottest
 * experts (highest selections per existing copy) of the layer that needs copies most, up to
 * `maxCopies` copies of an expert. Returns undefined when the workers cannot cover the layers.
 */
export function assignSwarm(
  layers: readonly SwarmLayerInfo[],
  workers: readonly SwarmWorker[],
  options: { demand?: ExpertDemand; maxCopies?: number } = {},
): SwarmPlan | undefined {
  return assignResolved(layers, resolveWorkers(workers), options);
}

/** {@link assignSwarm} for workers already resolved. */
export function assignResolved(
  layers: readonly SwarmLayerInfo[],
  resolved: readonly ResolvedWorker[],
  options: { demand?: ExpertDemand; maxCopies?: number } = {},
): SwarmPlan | undefined {
  const workers: Worker[] = resolved.map((w) => ({ ...w }));
  if (layers.length > 0 && !tile(layers, workers)) return undefined;
  const copies = new Map<number, number[]>(layers.map((l) => [l.layer, Array(l.nExpert).fill(1)]));
  const maxCopies = options.maxCopies ?? 2;
  if (options.demand !== undefined && layers.length > 0 && maxCopies > 1) {
    const demand = new Map(layers.map((l) => [l.layer, demandOf(options.demand, l.layer, l.nExpert)!]));
    const idle = workers.filter((w) => !w.slice).sort((a, b) => (a.capacity > b.capacity ? -1 : 1));
    for (const w of idle) {
      // The layer whose hottest not-yet-maxed experts carry the most demand per copy.
      let best: { layer: SwarmLayerInfo; experts: number[]; score: number } | undefined;
      for (const layer of layers) {
        const d = demand.get(layer.layer)!;
        const c = copies.get(layer.layer)!;
        const perByte = layer.bytesPerExpert > 0n ? layer.bytesPerExpert : 1n;
        const n = Math.min(w.maxExperts, layer.nExpert, Number(w.capacity / perByte));
        if (n < 1) continue;
        const candidates = range(0, layer.nExpert)
          .filter((e) => c[e]! < maxCopies && d[e]! > 0)
          .sort((a, b) => d[b]! / c[b]! - d[a]! / c[a]! || a - b)
          .slice(0, n);
        const score = candidates.reduce((s, e) => s + d[e]! / c[e]!, 0);
        if (candidates.length > 0 && (!best || score > best.score))
          best = { layer, experts: candidates, score };
      }
      if (!best) break;
      const experts = [...best.experts].sort((a, b) => a - b);
      w.slice = sliceOf([best.layer], experts, "replica");
      const c = copies.get(best.layer.layer)!;
      for (const e of experts) c[e]!++;
    }
  }
  const bytes = layers.reduce((s, l) => s + l.bytesPerExpert * BigInt(l.nExpert), 0n);
  const heldBytes = workers.reduce((s, w) => s + (w.slice?.bytes ?? 0n), 0n);
  return {
    layers: layers.map((l) => l.layer),
    assignments: workers.map((w) => ({ worker: w.id, capacity: w.capacity, slice: w.slice })),
    copies,
    bytes,
    heldBytes,
  };
}

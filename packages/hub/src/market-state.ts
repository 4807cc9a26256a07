// The coverage market's state and its building blocks: the per-model grid of cells, workers'
// registered slices, and the small checks and copies every section of the market shares.
import { capacityWeightBytes, HubError, InvalidArgumentError, type Range } from "@moeswarm/core";
import { DemandCounters, type DemandPolicy } from "./demand.js";
import type {
  Lease,
  MarketLayer,
  MarketModel,
  MarketOptions,
  StoredDemandRow,
  WorkerCapacity,
} from "./market-types.js";

const MAX_WORKER_ID_BYTES = 128;

export function conflict(message: string, details: Record<string, unknown>): HubError {
  return new HubError("MOESWARM_HUB_CONFLICT", message, { details });
}

/** A peer id as `hello` carries it: a string of 1..128 UTF-8 bytes. */
export function isWorkerId(value: unknown): value is string {
  return typeof value === "string" && value.length > 0 && Buffer.byteLength(value) <= MAX_WORKER_ID_BYTES;
}

/**
 * The weight bytes a capacity offers, checked (InvalidArgumentError when unusable): core's
 * capacityWeightBytes, i.e. `vramBytes` for a GPU backend, `ramBytes + vramBytes` otherwise.
 */
export function capacityBytes(capacity: WorkerCapacity): number {
  if (typeof capacity !== "object" || capacity === null)
    throw new InvalidArgumentError("capacity must be an object");
  const { ramBytes = 0, vramBytes = 0, backend, bandwidthBps } = capacity;
  for (const [name, v] of [
    ["ramBytes", ramBytes],
    ["vramBytes", vramBytes],
  ] as const) {
    if (!Number.isSafeInteger(v) || v < 0)
      throw new InvalidArgumentError(`capacity.${name} must be an integer number of bytes >= 0`);
  }
  if (backend !== undefined && (typeof backend !== "string" || backend.length > 64)) {
    throw new InvalidArgumentError("capacity.backend must be a string of at most 64 characters");
  }
  if (
    bandwidthBps !== undefined &&
    (typeof bandwidthBps !== "number" || !Number.isFinite(bandwidthBps) || bandwidthBps < 0)
  ) {
    throw new InvalidArgumentError("capacity.bandwidthBps must be a number >= 0");
  }
  const total = ramBytes + vramBytes;
  if (total <= 0 || !Number.isSafeInteger(total)) {
    throw new InvalidArgumentError("capacity must offer some bytes (ramBytes + vramBytes > 0)");
  }
  return capacityWeightBytes(capacity);
}

export function copyCapacity(c: WorkerCapacity): WorkerCapacity {
  const out: { -readonly [K in keyof WorkerCapacity]: WorkerCapacity[K] } = {};
  if (c.ramBytes !== undefined) out.ramBytes = c.ramBytes;
  if (c.vramBytes !== undefined) out.vramBytes = c.vramBytes;
  if (c.backend !== undefined) out.backend = c.backend;
  if (c.bandwidthBps !== undefined) out.bandwidthBps = c.bandwidthBps;
  return out;
}

export function copyLease(l: Lease): Lease {
  return { ...l, layers: { ...l.layers }, experts: { ...l.experts }, capacity: copyCapacity(l.capacity) };
}

export const round = (v: number, digits: number) => {
  const f = 10 ** digits;
  return Math.round(v * f) / f;
};

export const compareIds = (a: string, b: string) => (a < b ? -1 : a > b ? 1 : 0);

/** Sorted, unique, non-negative integers (what a register frame should carry; the relay does not enforce it). */
export function normaliseIds(values: readonly number[]): number[] {
  return [...new Set(values.filter((v) => Number.isSafeInteger(v) && v >= 0))].sort((a, b) => a - b);
}

export interface Slice {
  readonly layers: number[];
  readonly experts: number[];
}

export interface WorkerState {
  draining: boolean;
  /** The principal of its token (replicas count distinct owners); its id when unknown. */
  owner: string;
  /** Its compute class (the register frame's backend), when it said. */
  computeClass: string | undefined;
  /** Per model, the slices registered, in order (none identical). */
  slices: Map<string, Slice[]>;
}

export function sameSlice(a: Slice, b: Slice): boolean {
  const same = (x: readonly number[], y: readonly number[]) =>
    x.length === y.length && x.every((v, i) => v === y[i]);
  return same(a.layers, b.layers) && same(a.experts, b.experts);
}

/**
 * The cells of a grid that a worker's slices hold, each once: layer -> ascending experts. Layers
 * and experts the grid does not have are left out, so the work is bounded by the grid, whatever a
 * register frame lists.
 */
export function cellsOf(slices: readonly Slice[], grid: Grid): Map<number, number[]> {
  const masks = new Map<number, Uint8Array>();
  for (const s of slices) {
    for (const layer of s.layers) {
      const r = grid.row.get(layer);
      if (r === undefined) continue;
      const n = (grid.model.layers[r] as MarketLayer).nExpert;
      let mask = masks.get(layer);
      if (!mask) {
        mask = new Uint8Array(n);
        masks.set(layer, mask);
      }
      for (const e of s.experts) {
        if (e >= n) break;
        mask[e] = 1;
      }
    }
  }
  const out = new Map<number, number[]>();
  for (const [layer, mask] of masks) {
    const experts: number[] = [];
    for (let e = 0; e < mask.length; e++) if (mask[e]) experts.push(e);
    if (experts.length > 0) out.set(layer, experts);
  }
  return out;
}

/** The cells of `after` that `before` lacks. */
export function cellsAdded(
  before: Map<number, number[]>,
  after: Map<number, number[]>,
): Map<number, number[]> {
  const out = new Map<number, number[]>();
  for (const [layer, experts] of after) {
    const had = before.get(layer);
    if (!had) {
      out.set(layer, experts);
      continue;
    }
    const set = new Set(had);
    const fresh = experts.filter((e) => !set.has(e));
    if (fresh.length > 0) out.set(layer, fresh);
  }
  return out;
}

/** The per-cell state of one model. */
export class Grid {
  readonly model: MarketModel;
  readonly row = new Map<number, number>();
  readonly offsets: number[] = [];
  readonly cells: number;
  readonly maxExpert: number;
  readonly coverage: Int32Array;
  readonly pending: Int32Array;
  /**
   * Per principal, how many of its workers hold each cell (sparse): `coverage` counts principals,
   * so two ids of one owner are one replica (they could agree on a lie).
   */
  readonly #held = new Map<string, Map<number, number>>();
  demand: DemandCounters;
  version: number;

  constructor(model: MarketModel, now: number) {
    this.model = model;
    let off = 0;
    for (const [i, l] of model.layers.entries()) {
      this.row.set(l.layer, i);
      this.offsets.push(off);
      off += l.nExpert;
    }
    this.cells = off;
    this.maxExpert = Math.max(0, ...model.layers.map((l) => l.nExpert));
    this.coverage = new Int32Array(off);
    this.pending = new Int32Array(off);
    this.demand = new DemandCounters(off, now);
    this.version = Math.max(1, Math.floor(now));
  }

  touch(now: number): void {
    this.version = Math.max(this.version + 1, Math.floor(now));
  }

  /**
   * A worker of principal `owner` gains (delta 1) or loses (-1) the cells (layer -> ascending
   * experts; cells off the grid skipped): a cell's coverage changes when the first of the
   * principal's workers gains it or the last loses it.
   */
  addCells(cells: ReadonlyMap<number, readonly number[]>, delta: 1 | -1, owner: string): void {
    let held = this.#held.get(owner);
    if (!held) {
      held = new Map();
      this.#held.set(owner, held);
    }
    for (const [layer, experts] of cells) {
      const r = this.row.get(layer);
      if (r === undefined) continue;
      const n = (this.model.layers[r] as MarketLayer).nExpert;
      const off = this.offsets[r] as number;
      for (const e of experts) {
        if (e >= n) break;
        const was = held.get(off + e) ?? 0;
        const now = Math.max(0, was + delta);
        if (now === 0) held.delete(off + e);
        else held.set(off + e, now);
        if (was > 0 !== now > 0) this.coverage[off + e] = (this.coverage[off + e] as number) + delta;
      }
    }
    if (held.size === 0) this.#held.delete(owner);
  }

  /** Expert bytes of the cells. */
  bytesOf(cells: ReadonlyMap<number, readonly number[]>): number {
    let bytes = 0;
    for (const [layer, experts] of cells) {
      const r = this.row.get(layer);
      if (r === undefined) continue;
      const l = this.model.layers[r] as MarketLayer;
      let count = 0;
      for (const e of experts) {
        if (e >= l.nExpert) break;
        count++;
      }
      bytes += count * l.bytesPerExpert;
    }
    return bytes;
  }

  addLease(lease: Lease, delta: number): void {
    for (let layer = lease.layers.start; layer < lease.layers.end; layer++) {
      const r = this.row.get(layer);
      if (r === undefined) continue;
      const n = (this.model.layers[r] as MarketLayer).nExpert;
      const off = this.offsets[r] as number;
      for (let e = lease.experts.start; e < Math.min(lease.experts.end, n); e++) {
        this.pending[off + e] = (this.pending[off + e] as number) + delta;
      }
    }
  }
}

/** Everything the market knows; each section of the market (market-*.ts) works on it. */
export interface MarketState {
  readonly policy: DemandPolicy;
  readonly leaseTtlMs: number;
  readonly maxLeaseTtlMs: number;
  readonly newId: () => string;
  readonly onLeaseEnd: MarketOptions["onLeaseEnd"];
  readonly grids: Map<string, Grid>;
  readonly workers: Map<string, WorkerState>;
  /** Pending leases: granted, not yet fulfilled by a registration. */
  readonly leases: Map<string, Lease>;
  /** Leases in service: fulfilled by a registration, kept as its title (market-service.ts). */
  readonly serving: Map<string, Lease>;
  /** Leases in service whose life was extended since the last write. */
  readonly renewedServing: Set<string>;
  /** Demand rows loaded from the store for models not added yet. */
  readonly storedDemand: Map<string, StoredDemandRow[]>;
  readonly credits: Map<string, Map<string, { expertTokens: number; updatedAt: number }>>;
  readonly dirtyDemand: Set<string>;
  readonly dirtyCredits: Set<string>;
  readonly deadLeases: Set<string>;
}

export function gridOf(st: MarketState, id: string): Grid {
  const grid = st.grids.get(id);
  if (!grid) throw new HubError("MOESWARM_HUB_NOT_FOUND", `no model ${JSON.stringify(id)} on this hub`);
  return grid;
}

export function modelIds(st: MarketState): string[] {
  return [...st.grids.keys()].sort(compareIds);
}

export function holds(slice: Slice, lease: Lease): boolean {
  for (let l = lease.layers.start; l < lease.layers.end; l++) if (!slice.layers.includes(l)) return false;
  // experts are sorted and unique: the range is held when its first and last are and nothing is between missing
  const first = slice.experts.indexOf(lease.experts.start);
  if (first < 0) return false;
  const last = first + (lease.experts.end - lease.experts.start) - 1;
  return slice.experts[last] === lease.experts.end - 1;
}

export function overlaps(lease: Lease, layers: Range, experts: Range): boolean {
  return (
    lease.layers.start < layers.end &&
    layers.start < lease.layers.end &&
    lease.experts.start < experts.end &&
    experts.start < lease.experts.end
  );
}

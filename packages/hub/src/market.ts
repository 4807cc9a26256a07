import { randomBytes } from "node:crypto";
import {
  AuthError,
  formatRange,
  GgufError,
  HubError,
  InvalidArgumentError,
  type Range,
  toRanges,
} from "@moeswarm/core";
import {
  cellValue,
  DemandCounters,
  type DemandPolicy,
  decayFactor,
  demandPolicy,
  hotness,
  targetReplicas,
} from "./demand.js";

/*
 * The coverage market (M3), as a pure in-memory state machine: every method that depends on time
 * takes `now` (unix ms), nothing reads a clock or does I/O, so a simulation of many workers runs
 * fast and deterministically. The hub feeds it relay events and HTTP requests and persists what
 * `takeChanges()` reports (market-book.ts).
 *
 * Cells are (layer, expert) pairs of a model's MoE layers. Per cell the market keeps:
 *   coverage: live, non-draining workers one of whose registered slices holds the cell (a worker
 *             counts once per cell, however many of its slices hold it);
 *   pending:  active leases (claims granted, not yet turned into a registration, not expired);
 *   demand:   decayed routing counts reported by backbones.
 * A worker may hold several slices (each register adds one) and several leases. A claim is granted
 * only when every cell of the slice has coverage + pending below its target, none is already the
 * claimant's own, and the slice fits the capacity it declares beside what it already holds
 * (registered slices and other leases), so workers polling at once never take a cell beyond its
 * target and no worker takes more than it offers.
 */

/** One MoE layer of a model as the market sees it. */
export interface MarketLayer {
  /** Block number (what `layers=a:b` selects). */
  readonly layer: number;
  readonly nExpert: number;
  /** Bytes of one expert of this layer (all its tensors), as a slice carries them. */
  readonly bytesPerExpert: number;
}

export interface MarketModel {
  readonly id: string;
  /** The MoE layers, ascending. */
  readonly layers: readonly MarketLayer[];
}

/** What a worker offers when it claims. */
export interface WorkerCapacity {
  /** Host memory offered for expert weights, bytes. */
  readonly ramBytes?: number;
  /** Device memory offered, bytes. The slice must fit `ramBytes + vramBytes`. */
  readonly vramBytes?: number;
  /** "cpu", "cuda", "hip", "vulkan", "metal"... (informative). */
  readonly backend?: string;
  /** Measured download bandwidth, bytes/s (informative). */
  readonly bandwidthBps?: number;
}

/** A claim granted: the worker may download and register this slice before `expiresAt`. */
export interface Lease {
  readonly id: string;
  readonly worker: string;
  readonly model: string;
  /** Half-open block range. */
  readonly layers: Range;
  /** Half-open expert range. */
  readonly experts: Range;
  /** Expert weight bytes of the slice (the manifest's slabs; the mini-GGUF adds its header). */
  readonly bytes: number;
  readonly grantedAt: number;
  readonly expiresAt: number;
  readonly capacity: WorkerCapacity;
}

/** A run of under-covered experts of one layer, all with the same target, coverage and pending. */
export interface DemandRange {
  readonly model: string;
  readonly layer: number;
  readonly experts: Range;
  /** Experts in the range. */
  readonly count: number;
  /** Replicas wanted per expert. */
  readonly target: number;
  /** Live replicas per expert. */
  readonly coverage: number;
  /** Leased (claimed, not yet registered) replicas per expert. */
  readonly pending: number;
  /** `target - coverage - pending` (>= 1). */
  readonly missing: number;
  /** Target above 1. */
  readonly hot: boolean;
  /** Sum of the experts' values (README "Demand"), rounded to 1e-6. */
  readonly value: number;
  /** Expert weight bytes of the range. */
  readonly bytes: number;
  readonly bytesPerExpert: number;
  /** Experts of the layer (all of them, in demand or not): a slice of 0:nExpert is a whole layer. */
  readonly nExpert: number;
}

export interface ClaimRequest {
  readonly worker: string;
  readonly model: string;
  readonly layers: Range;
  readonly experts: Range;
  readonly capacity: WorkerCapacity;
  /** Lease lifetime (default the market's leaseTtlMs; at most maxLeaseTtlMs). */
  readonly ttlMs?: number;
  /**
   * Replace every lease this worker holds (all models), not only those the slice overlaps: a
   * worker that just started holds none, so what the market still has for its id is a previous
   * run's (they are dropped only if this claim is granted).
   */
  readonly replaceLeases?: boolean;
}

export interface AutoClaimRequest {
  readonly worker: string;
  /** Only this model (default: every model the market knows). */
  readonly model?: string;
  readonly capacity: WorkerCapacity;
  readonly ttlMs?: number;
}

/** One registered slice of a worker, as dispatch's `Placement.fromRegistrations` takes it. */
export interface PlacementRegistration {
  id: string;
  model: string;
  layers: number[];
  experts: number[];
}

/** The live placement of one model (GET /api/models/:model/placement). */
export interface PlacementJson {
  model: string;
  /** Changes whenever the registrations change; increases, also across restarts (it is >= the clock). */
  version: number;
  /** The MoE layers. */
  layers: number[];
  /** Experts per layer (the largest layer's). */
  experts: number;
  /**
   * Live, non-draining workers' slices, by worker id then in the order registered, one entry per
   * slice (a worker may have several): `Placement.fromRegistrations(registrations)` merges them.
   */
  registrations: PlacementRegistration[];
  /** The same, per cell: runs of experts of one layer with the same owners. */
  owners: Array<{ layer: number; experts: string; workers: string[] }>;
  /** Experts nobody serves, per layer (`a:b,c:d`), as dispatch's `Placement.missing` reports them. */
  missing: Array<{ layer: number; experts: string; count: number }>;
}

/** Coverage of a model per cell, for the dashboard (rows are the MoE layers in order). */
export interface CoverageGrid {
  model: string;
  layers: number[];
  nExpert: number[];
  replicas: number[][];
  pending: number[][];
  targets: number[][];
  /** Hotness `h` (1 = an average expert of its layer), rounded to 1e-3. */
  load: number[][];
}

export interface CoverageSummary {
  model: string;
  cells: number;
  /** Cells without a live replica. */
  uncovered: number;
  /** Cells with fewer live replicas than their target. */
  belowTarget: number;
  /** Cells whose target is above 1. */
  hot: number;
  leases: number;
  version: number;
}

export interface StoredDemandRow {
  readonly model: string;
  readonly layer: number;
  /** The instant the counts refer to (unix ms). */
  readonly at: number;
  readonly counts: Float64Array;
}

export interface CreditRow {
  readonly worker: string;
  readonly model: string;
  readonly expertTokens: number;
  readonly updatedAt: number;
}

/** What changed since the last `takeChanges()`: what the hub writes to its store. */
export interface MarketChanges {
  demand: StoredDemandRow[];
  /** Leases gone by expiry, fulfilment or their model's removal (grants, renewals and releases are written by the caller at once). */
  deadLeases: string[];
  credits: CreditRow[];
}

export interface MarketOptions extends Partial<DemandPolicy> {
  /** Lease lifetime when a claim asks for none (default 120000 ms). */
  leaseTtlMs?: number;
  /** Longest lease a claim may ask for (default 3600000 ms). */
  maxLeaseTtlMs?: number;
  /** Lease ids (default 16 random bytes, base64url); tests pass a counter. */
  newId?: () => string;
  /** Told of every lease that ends by itself: expired, or fulfilled by a registration. Must not throw. */
  onLeaseEnd?: (lease: Lease, reason: "expired" | "fulfilled") => void;
}

const MAX_WORKER_ID_BYTES = 128;

function conflict(message: string, details: Record<string, unknown>): HubError {
  return new HubError("MOESWARM_HUB_CONFLICT", message, { details });
}

function invalid(message: string): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", message);
}

/** A peer id as `hello` carries it: a string of 1..128 UTF-8 bytes. */
export function isWorkerId(value: unknown): value is string {
  return typeof value === "string" && value.length > 0 && Buffer.byteLength(value) <= MAX_WORKER_ID_BYTES;
}

/** The bytes a capacity offers (`ramBytes + vramBytes`), checked; InvalidArgumentError when unusable. */
export function capacityBytes(capacity: WorkerCapacity): number {
  if (typeof capacity !== "object" || capacity === null) throw invalid("capacity must be an object");
  const { ramBytes = 0, vramBytes = 0, backend, bandwidthBps } = capacity;
  for (const [name, v] of [
    ["ramBytes", ramBytes],
    ["vramBytes", vramBytes],
  ] as const) {
    if (!Number.isSafeInteger(v) || v < 0)
      throw invalid(`capacity.${name} must be an integer number of bytes >= 0`);
  }
  if (backend !== undefined && (typeof backend !== "string" || backend.length > 64)) {
    throw invalid("capacity.backend must be a string of at most 64 characters");
  }
  if (
    bandwidthBps !== undefined &&
    (typeof bandwidthBps !== "number" || !Number.isFinite(bandwidthBps) || bandwidthBps < 0)
  ) {
    throw invalid("capacity.bandwidthBps must be a number >= 0");
  }
  const total = ramBytes + vramBytes;
  if (total <= 0 || !Number.isSafeInteger(total)) {
    throw invalid("capacity must offer some bytes (ramBytes + vramBytes > 0)");
  }
  return total;
}

function copyCapacity(c: WorkerCapacity): WorkerCapacity {
  const out: { -readonly [K in keyof WorkerCapacity]: WorkerCapacity[K] } = {};
  if (c.ramBytes !== undefined) out.ramBytes = c.ramBytes;
  if (c.vramBytes !== undefined) out.vramBytes = c.vramBytes;
  if (c.backend !== undefined) out.backend = c.backend;
  if (c.bandwidthBps !== undefined) out.bandwidthBps = c.bandwidthBps;
  return out;
}

function copyLease(l: Lease): Lease {
  return { ...l, layers: { ...l.layers }, experts: { ...l.experts }, capacity: copyCapacity(l.capacity) };
}

const round = (v: number, digits: number) => {
  const f = 10 ** digits;
  return Math.round(v * f) / f;
};

const compareIds = (a: string, b: string) => (a < b ? -1 : a > b ? 1 : 0);

/** Sorted, unique, non-negative integers (what a register frame should carry; the relay does not enforce it). */
function normaliseIds(values: readonly number[]): number[] {
  return [...new Set(values.filter((v) => Number.isSafeInteger(v) && v >= 0))].sort((a, b) => a - b);
}

interface Slice {
  readonly layers: number[];
  readonly experts: number[];
}

interface WorkerState {
  draining: boolean;
  /** Per model, the slices registered, in order (none identical). */
  slices: Map<string, Slice[]>;
}

function sameSlice(a: Slice, b: Slice): boolean {
  const same = (x: readonly number[], y: readonly number[]) =>
    x.length === y.length && x.every((v, i) => v === y[i]);
  return same(a.layers, b.layers) && same(a.experts, b.experts);
}

/**
 * The cells of a grid that a worker's slices hold, each once: layer -> ascending experts. Layers
 * and experts the grid does not have are left out, so the work is bounded by the grid, whatever a
 * register frame lists.
 */
function cellsOf(slices: readonly Slice[], grid: Grid): Map<number, number[]> {
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
function cellsAdded(before: Map<number, number[]>, after: Map<number, number[]>): Map<number, number[]> {
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
class Grid {
  readonly model: MarketModel;
  readonly row = new Map<number, number>();
  readonly offsets: number[] = [];
  readonly cells: number;
  readonly maxExpert: number;
  readonly coverage: Int32Array;
  readonly pending: Int32Array;
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

  /** Adds `delta` to the coverage of each cell (layer -> ascending experts; cells off the grid skipped). */
  addCells(cells: ReadonlyMap<number, readonly number[]>, delta: number): void {
    for (const [layer, experts] of cells) {
      const r = this.row.get(layer);
      if (r === undefined) continue;
      const n = (this.model.layers[r] as MarketLayer).nExpert;
      const off = this.offsets[r] as number;
      for (const e of experts) {
        if (e >= n) break;
        this.coverage[off + e] = (this.coverage[off + e] as number) + delta;
      }
    }
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

/** Per-cell figures at one instant, as one claimant sees them. */
interface View {
  readonly target: Int32Array;
  readonly coverage: Int32Array;
  readonly pending: Int32Array;
  readonly load: Float64Array;
  readonly value: Float64Array;
  /** 1 for the cells the claimant already holds: registered, or leased (leases it replaces aside). */
  readonly mine: Uint8Array | undefined;
}

/** Whose view: a claimant, and its leases that its claim would replace (not counted). */
interface Claimant {
  readonly worker: string;
  readonly replacing?: ReadonlySet<string>;
}

interface Candidate {
  grid: Grid;
  r0: number;
  rows: number;
  start: number;
  end: number;
  value: number;
  bytes: number;
  /** Every expert of its layers (0:nExpert): one owner answers a token's whole layer. */
  whole: boolean;
}

/**
 * A whole-layer slice wins over a larger part-layer one while it is worth at least this share of
 * it. A token's top-k experts of a layer then sit on one worker: one request per layer, answered
 * with the worker's sum (dispatch mode "auto"), instead of one per owner with every slot's output.
 * A worker that holds whole layers keeps claiming with what capacity is left, so coverage loses
 * little; 0.5 keeps hot experts elsewhere from being starved by the preference.
 */
export const WHOLE_LAYER_SHARE = 0.5;

/**
 * The coverage market: coverage from workers' registrations, demand from backbones' routing
 * counts, leases from claims, credits from receipts. See the module comment and README "Demand".
 */
export class CoverageMarket {
  readonly policy: DemandPolicy;
  readonly leaseTtlMs: number;
  readonly maxLeaseTtlMs: number;
  readonly #newId: () => string;
  readonly #onLeaseEnd: MarketOptions["onLeaseEnd"];
  readonly #grids = new Map<string, Grid>();
  readonly #workers = new Map<string, WorkerState>();
  readonly #leases = new Map<string, Lease>();
  /** Demand rows loaded from the store for models not added yet. */
  readonly #storedDemand = new Map<string, StoredDemandRow[]>();
  readonly #credits = new Map<string, Map<string, { expertTokens: number; updatedAt: number }>>();
  readonly #dirtyDemand = new Set<string>();
  readonly #dirtyCredits = new Set<string>();
  readonly #deadLeases = new Set<string>();

  constructor(options: MarketOptions = {}) {
    const { leaseTtlMs, maxLeaseTtlMs, newId, onLeaseEnd, ...policy } = options;
    this.#onLeaseEnd = onLeaseEnd;
    this.policy = demandPolicy(policy);
    this.maxLeaseTtlMs = maxLeaseTtlMs ?? 3_600_000;
    this.leaseTtlMs = leaseTtlMs ?? Math.min(120_000, this.maxLeaseTtlMs);
    if (!Number.isSafeInteger(this.maxLeaseTtlMs) || this.maxLeaseTtlMs < 1) {
      throw invalid("market option maxLeaseTtlMs must be an integer >= 1");
    }
    if (
      !Number.isSafeInteger(this.leaseTtlMs) ||
      this.leaseTtlMs < 1 ||
      this.leaseTtlMs > this.maxLeaseTtlMs
    ) {
      throw invalid("market option leaseTtlMs must be an integer in 1..maxLeaseTtlMs");
    }
    this.#newId = newId ?? (() => randomBytes(16).toString("base64url"));
  }

  // --- models ---------------------------------------------------------------------------------

  /** Adds (or replaces) a model; coverage is rebuilt from the registrations and leases known. */
  addModel(model: MarketModel, now: number): void {
    if (typeof model?.id !== "string" || !Array.isArray(model.layers)) {
      throw invalid("a market model needs an id and layers");
    }
    let last = -1;
    for (const l of model.layers) {
      if (!Number.isSafeInteger(l.layer) || l.layer <= last) throw invalid("model layers must ascend");
      if (!Number.isSafeInteger(l.nExpert) || l.nExpert < 1) throw invalid("nExpert must be >= 1");
      if (!Number.isSafeInteger(l.bytesPerExpert) || l.bytesPerExpert < 0) {
        throw invalid("bytesPerExpert must be an integer >= 0");
      }
      last = l.layer;
    }
    const frozen: MarketModel = { id: model.id, layers: model.layers.map((l) => ({ ...l })) };
    const previous = this.#grids.get(model.id);
    const grid = new Grid(frozen, now);
    if (previous) grid.version = Math.max(grid.version, previous.version + 1);
    for (const w of this.#workers.values()) {
      const list = w.slices.get(model.id);
      if (list && list.length > 0 && !w.draining) grid.addCells(cellsOf(list, grid), 1);
    }
    for (const lease of this.#leases.values()) if (lease.model === model.id) grid.addLease(lease, 1);
    const rows = this.#storedDemand.get(model.id);
    if (rows) {
      this.#storedDemand.delete(model.id);
      this.#loadDemand(grid, rows);
    }
    this.#grids.set(model.id, grid);
  }

  #loadDemand(grid: Grid, rows: readonly StoredDemandRow[]): void {
    const usable = rows.filter((r) => {
      const i = grid.row.get(r.layer);
      return i !== undefined && r.counts.length === (grid.model.layers[i] as MarketLayer).nExpert;
    });
    if (usable.length === 0) return;
    // rows written together share an instant; if they do not, bring them all to the latest
    const at = Math.max(...usable.map((r) => r.at));
    grid.demand = new DemandCounters(grid.cells, at);
    for (const r of usable) {
      const f = decayFactor(at - r.at, this.policy.halfLifeMs);
      const off = grid.offsets[grid.row.get(r.layer) as number] as number;
      for (let e = 0; e < r.counts.length; e++) grid.demand.counts[off + e] = (r.counts[e] as number) * f;
    }
  }

  /** Forgets a model: its leases end (reported as dead), its demand is dropped. */
  removeModel(id: string): boolean {
    const had = this.#grids.delete(id);
    for (const lease of [...this.#leases.values()]) {
      if (lease.model === id) {
        this.#leases.delete(lease.id);
        this.#deadLeases.add(lease.id);
      }
    }
    this.#dirtyDemand.delete(id);
    return had;
  }

  hasModel(id: string): boolean {
    return this.#grids.has(id);
  }

  modelIds(): string[] {
    return [...this.#grids.keys()].sort(compareIds);
  }

  #grid(id: string): Grid {
    const grid = this.#grids.get(id);
    if (!grid) throw new HubError("MOESWARM_HUB_NOT_FOUND", `no model ${JSON.stringify(id)} on this hub`);
    return grid;
  }

  // --- coverage (from the relay) ----------------------------------------------------------------

  #worker(id: string): WorkerState {
    let w = this.#workers.get(id);
    if (!w) {
      w = { draining: false, slices: new Map() };
      this.#workers.set(id, w);
    }
    return w;
  }

  /** Withdraws every slice of a worker from the coverage (drain, leave). */
  #withdrawAll(w: WorkerState, now: number): void {
    for (const [model, list] of w.slices) {
      const grid = this.#grids.get(model);
      if (!grid || list.length === 0) continue;
      grid.addCells(cellsOf(list, grid), -1);
      grid.touch(now);
    }
  }

  /** A worker's connection ended, or a new one replaced it: its slices no longer count. */
  workerGone(id: string, now: number): void {
    const w = this.#workers.get(id);
    if (!w) return;
    if (!w.draining) this.#withdrawAll(w, now);
    this.#workers.delete(id);
  }

  /**
   * A worker registered a slice of `model`: it adds to the slices it already has (the same slice
   * again changes nothing; a register also ends a drain, as on the relay). Leases of this worker
   * and model that the slice holds are fulfilled: returned, and no longer pending.
   */
  register(
    id: string,
    model: string,
    layers: readonly number[],
    experts: readonly number[],
    now: number,
  ): Lease[] {
    const w = this.#worker(id);
    const slice: Slice = { layers: normaliseIds(layers), experts: normaliseIds(experts) };
    // a drain withdrew and forgot every slice: this register starts a new set
    w.draining = false;
    const grid = this.#grids.get(model);
    let list = w.slices.get(model);
    if (!list) {
      list = [];
      w.slices.set(model, list);
    }
    if (!list.some((s) => sameSlice(s, slice))) {
      const before = grid && cellsOf(list, grid);
      list.push(slice);
      if (grid && before) {
        // a worker counts once per cell: only cells none of its other slices holds are new coverage
        grid.addCells(cellsAdded(before, cellsOf(list, grid)), 1);
        grid.touch(now);
      }
    }
    const fulfilled: Lease[] = [];
    for (const lease of [...this.#leases.values()]) {
      if (lease.worker !== id || lease.model !== model || !holds(slice, lease)) continue;
      this.#dropLease(lease);
      this.#deadLeases.add(lease.id);
      fulfilled.push(copyLease(lease));
      this.#onLeaseEnd?.(copyLease(lease), "fulfilled");
    }
    return fulfilled;
  }

  /**
   * A worker drains (it said so, or the hub asked it): it takes no new dispatches, so its slices
   * are withdrawn and forgotten, as on the relay (a later register starts a new set).
   */
  drain(id: string, now: number): void {
    const w = this.#workers.get(id);
    if (!w || w.draining) return;
    w.draining = true;
    this.#withdrawAll(w, now);
    w.slices.clear();
  }

  /** Expert bytes a worker holds: its registered slices and its leases (but `replacing`), all models. */
  #heldBytes(worker: string, replacing?: ReadonlySet<string>): number {
    let bytes = 0;
    const w = this.#workers.get(worker);
    if (w) {
      for (const [model, list] of w.slices) {
        const grid = this.#grids.get(model);
        if (grid && list.length > 0) bytes += grid.bytesOf(cellsOf(list, grid));
      }
    }
    for (const lease of this.#leases.values()) {
      if (lease.worker === worker && !replacing?.has(lease.id)) bytes += lease.bytes;
    }
    return bytes;
  }

  // --- demand -----------------------------------------------------------------------------------

  /**
   * Adds a backbone's routing counts of `model` (per MoE layer, one count per expert: how many
   * (token, slot) selections chose it since its previous report), after decaying the model's
   * counters to `now`. InvalidArgumentError for a layer that is not a MoE layer or a wrong length.
   */
  addCounts(model: string, counts: ReadonlyMap<number, ArrayLike<number>>, now: number): void {
    const grid = this.#grid(model);
    for (const [layer, values] of counts) {
      const r = grid.row.get(layer);
      if (r === undefined) throw invalid(`layer ${layer} of ${model} has no routed experts`);
      const n = (grid.model.layers[r] as MarketLayer).nExpert;
      if (values.length !== n)
        throw invalid(`layer ${layer} of ${model} has ${n} experts, not ${values.length}`);
      for (let i = 0; i < values.length; i++) {
        const v = values[i] as number;
        if (!(v >= 0) || !Number.isFinite(v)) throw invalid("counts must be finite numbers >= 0");
      }
    }
    for (const [layer, values] of counts) {
      grid.demand.add(
        grid.offsets[grid.row.get(layer) as number] as number,
        values,
        now,
        this.policy.halfLifeMs,
      );
    }
    if (counts.size > 0) this.#dirtyDemand.add(model);
  }

  #view(grid: Grid, now: number, claimant?: Claimant): View {
    const { cells } = grid;
    const coverage = grid.coverage;
    let pending = grid.pending;
    let mine: Uint8Array | undefined;
    if (claimant !== undefined) {
      mine = new Uint8Array(cells);
      const w = this.#workers.get(claimant.worker);
      const list = w?.slices.get(grid.model.id);
      if (w && list && !w.draining) {
        for (const [layer, experts] of cellsOf(list, grid)) {
          const r = grid.row.get(layer);
          if (r === undefined) continue;
          const n = (grid.model.layers[r] as MarketLayer).nExpert;
          const off = grid.offsets[r] as number;
          for (const e of experts) {
            if (e >= n) break;
            mine[off + e] = 1;
          }
        }
      }
      for (const lease of this.#leases.values()) {
        if (lease.worker !== claimant.worker || lease.model !== grid.model.id) continue;
        const replaced = claimant.replacing?.has(lease.id) === true;
        // a lease the claim replaces is neither pending nor the claimant's any more
        if (replaced && pending === grid.pending) pending = grid.pending.slice();
        for (let layer = lease.layers.start; layer < lease.layers.end; layer++) {
          const r = grid.row.get(layer);
          if (r === undefined) continue;
          const n = (grid.model.layers[r] as MarketLayer).nExpert;
          const off = grid.offsets[r] as number;
          for (let e = lease.experts.start; e < Math.min(lease.experts.end, n); e++) {
            if (replaced) pending[off + e] = (pending[off + e] as number) - 1;
            else mine[off + e] = 1;
          }
        }
      }
    }
    const target = new Int32Array(cells);
    const load = new Float64Array(cells);
    const value = new Float64Array(cells);
    const f = decayFactor(now - grid.demand.at, this.policy.halfLifeMs);
    const counts = grid.demand.counts;
    for (const [r, l] of grid.model.layers.entries()) {
      const off = grid.offsets[r] as number;
      let total = 0;
      for (let e = 0; e < l.nExpert; e++) total += (counts[off + e] as number) * f;
      for (let e = 0; e < l.nExpert; e++) {
        const i = off + e;
        const h = hotness((counts[i] as number) * f, total, l.nExpert, this.policy.prior);
        const t = targetReplicas(h, this.policy);
        load[i] = h;
        target[i] = t;
        value[i] = cellValue(h, t, (coverage[i] as number) + (pending[i] as number), this.policy);
      }
    }
    return { target, coverage, pending, load, value, mine };
  }

  /**
   * The under-covered ranges, most valuable per byte first (then by value, model, layer and first
   * expert): runs of consecutive experts of one layer with `coverage + pending < target` and the
   * same target, coverage and pending.
   */
  demand(now: number, options: { model?: string } = {}): DemandRange[] {
    this.expire(now);
    const grids =
      options.model === undefined ? this.modelIds().map((id) => this.#grid(id)) : [this.#grid(options.model)];
    const out: DemandRange[] = [];
    for (const grid of grids) {
      const v = this.#view(grid, now);
      for (const [r, l] of grid.model.layers.entries()) {
        const off = grid.offsets[r] as number;
        let e = 0;
        while (e < l.nExpert) {
          const i = off + e;
          const t = v.target[i] as number;
          const c = v.coverage[i] as number;
          const p = v.pending[i] as number;
          if (c + p >= t) {
            e++;
            continue;
          }
          let end = e + 1;
          let value = v.value[i] as number;
          while (
            end < l.nExpert &&
            v.target[off + end] === t &&
            v.coverage[off + end] === c &&
            v.pending[off + end] === p
          ) {
            value += v.value[off + end] as number;
            end++;
          }
          const count = end - e;
          out.push({
            model: grid.model.id,
            layer: l.layer,
            experts: { start: e, end },
            count,
            target: t,
            coverage: c,
            pending: p,
            missing: t - c - p,
            hot: t > 1,
            value: round(value, 6),
            bytes: count * l.bytesPerExpert,
            bytesPerExpert: l.bytesPerExpert,
            nExpert: l.nExpert,
          });
          e = end;
        }
      }
    }
    const perByte = (d: DemandRange) => (d.bytes > 0 ? d.value / d.bytes : Number.POSITIVE_INFINITY);
    return out.sort(
      (a, b) =>
        perByte(b) - perByte(a) ||
        b.value - a.value ||
        compareIds(a.model, b.model) ||
        a.layer - b.layer ||
        a.experts.start - b.experts.start,
    );
  }

  // --- claims -----------------------------------------------------------------------------------

  #ttl(ttlMs: number | undefined): number {
    const ttl = ttlMs ?? this.leaseTtlMs;
    if (!Number.isSafeInteger(ttl) || ttl < 1 || ttl > this.maxLeaseTtlMs) {
      throw invalid(`ttlMs must be an integer in 1..${this.maxLeaseTtlMs}`);
    }
    return ttl;
  }

  /** Checks a slice against the model: every layer a MoE layer, experts within every layer. */
  #rows(grid: Grid, layers: Range, experts: Range): number[] {
    for (const [name, r] of [
      ["layers", layers],
      ["experts", experts],
    ] as const) {
      if (
        !Number.isSafeInteger(r?.start) ||
        !Number.isSafeInteger(r?.end) ||
        r.start < 0 ||
        r.end <= r.start
      ) {
        throw new InvalidArgumentError(
          "MOESWARM_INVALID_RANGE",
          `${name} must be a half-open range a:b with a < b`,
        );
      }
    }
    const rows: number[] = [];
    for (let layer = layers.start; layer < layers.end; layer++) {
      const r = grid.row.get(layer);
      if (r === undefined) {
        throw new GgufError(
          "MOESWARM_GGUF_NOT_MOE",
          `layer ${layer} of ${grid.model.id} has no routed experts`,
          {
            details: { layer, moeLayers: toRanges(grid.model.layers.map((l) => l.layer)).map(formatRange) },
          },
        );
      }
      const n = (grid.model.layers[r] as MarketLayer).nExpert;
      if (experts.end > n) {
        throw new InvalidArgumentError(
          "MOESWARM_INVALID_RANGE",
          `experts ${formatRange(experts)}: layer ${layer} of ${grid.model.id} has ${n} experts`,
          { details: { max: n } },
        );
      }
      rows.push(r);
    }
    return rows;
  }

  /**
   * Grants a lease on `layers x experts` of a model, or throws HubError MOESWARM_HUB_CONFLICT
   * with `details.reason`: "capacity" (the slice, with what the worker already holds, is larger
   * than the capacity offered), "held" (the worker already serves some of these cells),
   * "covered" (an expert already has its target of live replicas), "leased" (live replicas and
   * other workers' leases reach the target; `details.retryAfterMs` says when the first of those
   * leases expires). A worker may hold several leases; a claim that overlaps one of its leases of
   * the same model replaces that lease.
   */
  claim(request: ClaimRequest, now: number): Lease {
    if (!isWorkerId(request?.worker)) throw invalid("worker must be an id of 1..128 bytes");
    const offered = capacityBytes(request.capacity);
    const ttl = this.#ttl(request.ttlMs);
    this.expire(now);
    const grid = this.#grid(request.model);
    const { layers, experts } = request;
    const rows = this.#rows(grid, layers, experts);
    const width = experts.end - experts.start;
    const bytes = rows.reduce((n, r) => n + (grid.model.layers[r] as MarketLayer).bytesPerExpert * width, 0);
    const slice = `layers ${formatRange(layers)} experts ${formatRange(experts)} of ${grid.model.id}`;
    if (bytes > offered) {
      throw conflict(`${slice} needs ${bytes} bytes, more than the ${offered} offered`, {
        reason: "capacity",
        bytes,
        capacity: offered,
      });
    }
    // the claimant's overlapping leases of this model are replaced by this one
    const replacing = new Set<string>();
    for (const lease of this.#leases.values()) {
      if (lease.worker !== request.worker) continue;
      if (
        request.replaceLeases === true ||
        (lease.model === grid.model.id && overlaps(lease, layers, experts))
      ) {
        replacing.add(lease.id);
      }
    }
    const v = this.#view(grid, now, { worker: request.worker, replacing });
    const mine = v.mine as Uint8Array;
    const held: Array<{ layer: number; experts: number[] }> = [];
    const covered: Array<{ layer: number; experts: number[] }> = [];
    const leased: Array<{ layer: number; experts: number[] }> = [];
    for (const r of rows) {
      const off = grid.offsets[r] as number;
      const layer = (grid.model.layers[r] as MarketLayer).layer;
      const h: number[] = [];
      const c: number[] = [];
      const p: number[] = [];
      for (let e = experts.start; e < experts.end; e++) {
        const i = off + e;
        const t = v.target[i] as number;
        if (mine[i]) h.push(e);
        else if ((v.coverage[i] as number) >= t) c.push(e);
        else if ((v.coverage[i] as number) + (v.pending[i] as number) >= t) p.push(e);
      }
      if (h.length > 0) held.push({ layer, experts: h });
      if (c.length > 0) covered.push({ layer, experts: c });
      if (p.length > 0) leased.push({ layer, experts: p });
    }
    const describe = (list: Array<{ layer: number; experts: number[] }>) =>
      list
        .slice(0, 16)
        .map((x) => ({ layer: x.layer, experts: toRanges(x.experts).map(formatRange).join(",") }));
    if (held.length > 0) {
      throw conflict(`${slice}: worker ${request.worker} already serves some of these experts`, {
        reason: "held",
        cells: describe(held),
      });
    }
    const used = this.#heldBytes(request.worker, replacing);
    if (bytes + used > offered) {
      throw conflict(
        `${slice} needs ${bytes} bytes; with the ${used} this worker already holds that is more than the ${offered} offered`,
        { reason: "capacity", bytes, capacity: offered, held: used },
      );
    }
    if (covered.length > 0) {
      throw conflict(`${slice} is already covered to its target by live workers`, {
        reason: "covered",
        cells: describe(covered),
      });
    }
    if (leased.length > 0) {
      let first = Number.POSITIVE_INFINITY;
      for (const lease of this.#leases.values()) {
        if (
          lease.model === grid.model.id &&
          lease.worker !== request.worker &&
          overlaps(lease, layers, experts)
        ) {
          first = Math.min(first, lease.expiresAt);
        }
      }
      throw conflict(`${slice} is leased to its target by other workers`, {
        reason: "leased",
        cells: describe(leased),
        ...(Number.isFinite(first) ? { retryAfterMs: Math.max(0, first - now) } : {}),
      });
    }
    for (const id of replacing) {
      const old = this.#leases.get(id) as Lease;
      this.#dropLease(old);
      this.#deadLeases.add(old.id);
    }
    let id = this.#newId();
    while (this.#leases.has(id)) id = this.#newId();
    const lease: Lease = {
      id,
      worker: request.worker,
      model: grid.model.id,
      layers: { start: layers.start, end: layers.end },
      experts: { start: experts.start, end: experts.end },
      bytes,
      grantedAt: now,
      expiresAt: now + ttl,
      capacity: copyCapacity(request.capacity),
    };
    this.#leases.set(id, lease);
    this.#deadLeases.delete(id);
    grid.addLease(lease, 1);
    return copyLease(lease);
  }

  /**
   * The slice the market would grant this worker now, or undefined: the rectangle (consecutive
   * MoE layers x consecutive experts, every cell below target and not already the worker's) that
   * fits the capacity left beside what the worker holds (registered slices and leases): whole
   * layers first while worth {@link WHOLE_LAYER_SHARE} of the best part-layer slice, then the most
   * total value; ties go to more value per byte, then fewer layers, then the model, layer and
   * first expert in ascending order.
   */
  bestSlice(
    request: AutoClaimRequest,
    now: number,
  ): { model: string; layers: Range; experts: Range; value: number; bytes: number } | undefined {
    this.expire(now);
    const offered = capacityBytes(request.capacity) - this.#heldBytes(request.worker);
    if (offered <= 0) return undefined;
    const grids =
      request.model === undefined ? this.modelIds().map((id) => this.#grid(id)) : [this.#grid(request.model)];
    let best: Candidate | undefined;
    for (const grid of grids) {
      const v = this.#view(grid, now, { worker: request.worker });
      const mine = v.mine as Uint8Array;
      const L = grid.model.layers;
      for (let r0 = 0; r0 < L.length; r0++) {
        const colValue = new Float64Array(grid.maxExpert);
        let width = Number.POSITIVE_INFINITY;
        let rowBytes = 0;
        const open = new Uint8Array(grid.maxExpert).fill(1);
        let maxNExpert = 0;
        for (let r1 = r0; r1 < L.length; r1++) {
          const l = L[r1] as MarketLayer;
          if (r1 > r0 && l.layer !== (L[r1 - 1] as MarketLayer).layer + 1) break;
          width = Math.min(width, l.nExpert);
          maxNExpert = Math.max(maxNExpert, l.nExpert);
          rowBytes += l.bytesPerExpert;
          const off = grid.offsets[r1] as number;
          let any = false;
          for (let e = 0; e < width; e++) {
            const i = off + e;
            if (mine[i] || (v.coverage[i] as number) + (v.pending[i] as number) >= (v.target[i] as number)) {
              open[e] = 0;
            }
            colValue[e] = (colValue[e] as number) + (v.value[i] as number);
            if (open[e]) any = true;
          }
          if (!any) break;
          const fit = rowBytes > 0 ? Math.floor(offered / rowBytes) : width;
          if (fit < 1) break;
          const rows = r1 - r0 + 1;
          let e = 0;
          while (e < width) {
            if (!open[e]) {
              e++;
              continue;
            }
            let end = e;
            while (end < width && open[end]) end++;
            // best window of at most `fit` experts in [e, end): all of it, or a sliding window
            const w = Math.min(fit, end - e);
            let sum = 0;
            for (let k = e; k < e + w; k++) sum += colValue[k] as number;
            let bestSum = sum;
            let bestStart = e;
            for (let s = e + 1; s + w <= end; s++) {
              sum += (colValue[s + w - 1] as number) - (colValue[s - 1] as number);
              if (sum > bestSum) {
                bestSum = sum;
                bestStart = s;
              }
            }
            const c: Candidate = {
              grid,
              r0,
              rows,
              start: bestStart,
              end: bestStart + w,
              value: bestSum,
              bytes: rowBytes * w,
              whole: bestStart === 0 && bestStart + w === maxNExpert && width === maxNExpert,
            };
            if (!best || better(c, best)) best = c;
            e = end;
          }
        }
      }
    }
    if (!best || !(best.value > 0)) return undefined;
    const first = (best.grid.model.layers[best.r0] as MarketLayer).layer;
    return {
      model: best.grid.model.id,
      layers: { start: first, end: first + best.rows },
      experts: { start: best.start, end: best.end },
      value: round(best.value, 6),
      bytes: best.bytes,
    };
  }

  /**
   * Claims the best slice for the capacity (see `bestSlice`). HubError MOESWARM_HUB_CONFLICT with
   * `details.reason` "capacity" (demand exists but no expert of it fits) or "covered" (nothing
   * is below target).
   */
  autoClaim(request: AutoClaimRequest, now: number): Lease {
    if (!isWorkerId(request?.worker)) throw invalid("worker must be an id of 1..128 bytes");
    const ttl = this.#ttl(request.ttlMs);
    const pick = this.bestSlice(request, now);
    if (!pick) {
      const wanted = this.demand(now, request.model === undefined ? {} : { model: request.model });
      if (wanted.length > 0) {
        const smallest = Math.min(...wanted.map((d) => d.bytesPerExpert));
        throw conflict("no expert in demand fits the capacity offered", {
          reason: "capacity",
          bytes: smallest,
          capacity: capacityBytes(request.capacity),
          held: this.#heldBytes(request.worker),
        });
      }
      throw conflict("every expert is covered or leased to its target", { reason: "covered" });
    }
    return this.claim(
      {
        worker: request.worker,
        model: pick.model,
        layers: pick.layers,
        experts: pick.experts,
        capacity: request.capacity,
        ttlMs: ttl,
      },
      now,
    );
  }

  #owned(id: string, worker: string | undefined, now: number): Lease {
    this.expire(now);
    const lease = this.#leases.get(id);
    if (!lease)
      throw new HubError(
        "MOESWARM_HUB_NOT_FOUND",
        "no such lease (it expired, was released or was fulfilled)",
      );
    if (worker !== undefined && lease.worker !== worker) {
      throw new AuthError("MOESWARM_AUTH_ROLE", "the lease belongs to another worker");
    }
    return lease;
  }

  lease(id: string, worker: string | undefined, now: number): Lease {
    return copyLease(this.#owned(id, worker, now));
  }

  /** Extends a lease to `now + ttl` (a worker renews while it downloads). `worker` undefined: any (admin). */
  renew(id: string, worker: string | undefined, now: number, ttlMs?: number): Lease {
    const ttl = this.#ttl(ttlMs);
    const lease = this.#owned(id, worker, now);
    const renewed: Lease = { ...lease, expiresAt: Math.max(lease.expiresAt, now + ttl) };
    this.#leases.set(id, renewed);
    return copyLease(renewed);
  }

  /** Gives a lease up; its cells are in demand again. */
  release(id: string, worker: string | undefined, now: number): Lease {
    const lease = this.#owned(id, worker, now);
    this.#dropLease(lease);
    return copyLease(lease);
  }

  #dropLease(lease: Lease): void {
    this.#leases.delete(lease.id);
    this.#grids.get(lease.model)?.addLease(lease, -1);
  }

  /** Ends the leases whose time is up (at `expiresAt`); returns them. */
  expire(now: number): Lease[] {
    const gone: Lease[] = [];
    for (const lease of [...this.#leases.values()]) {
      if (lease.expiresAt <= now) {
        this.#dropLease(lease);
        this.#deadLeases.add(lease.id);
        gone.push(copyLease(lease));
        this.#onLeaseEnd?.(copyLease(lease), "expired");
      }
    }
    return gone;
  }

  /** Active leases, oldest first. */
  leases(options: { model?: string } = {}): Lease[] {
    return [...this.#leases.values()]
      .filter((l) => options.model === undefined || l.model === options.model)
      .sort((a, b) => a.grantedAt - b.grantedAt || compareIds(a.id, b.id))
      .map(copyLease);
  }

  // --- credits ----------------------------------------------------------------------------------

  /** Adds expert-tokens a worker served for a model (from a backbone's receipts). */
  credit(model: string, worker: string, expertTokens: number, now: number): void {
    if (!Number.isSafeInteger(expertTokens) || expertTokens < 0)
      throw invalid("expertTokens must be an integer >= 0");
    if (expertTokens === 0) return;
    let byModel = this.#credits.get(worker);
    if (!byModel) {
      byModel = new Map();
      this.#credits.set(worker, byModel);
    }
    const had = byModel.get(model)?.expertTokens ?? 0;
    byModel.set(model, {
      expertTokens: Math.min(Number.MAX_SAFE_INTEGER, had + expertTokens),
      updatedAt: now,
    });
    this.#dirtyCredits.add(`${worker}\0${model}`);
  }

  /** A worker's expert-tokens served, per model and in all. */
  creditsOf(worker: string): { expertTokens: number; byModel: Record<string, number> } {
    const byModel: Record<string, number> = {};
    let total = 0;
    for (const [model, c] of [...(this.#credits.get(worker) ?? new Map()).entries()].sort((a, b) =>
      compareIds(a[0], b[0]),
    )) {
      byModel[model] = c.expertTokens;
      total = Math.min(Number.MAX_SAFE_INTEGER, total + c.expertTokens);
    }
    return { expertTokens: total, byModel };
  }

  /** Every credit row, by worker then model. */
  credits(): CreditRow[] {
    const out: CreditRow[] = [];
    for (const worker of [...this.#credits.keys()].sort(compareIds)) {
      const byModel = this.#credits.get(worker) as Map<string, { expertTokens: number; updatedAt: number }>;
      for (const model of [...byModel.keys()].sort(compareIds)) {
        const c = byModel.get(model) as { expertTokens: number; updatedAt: number };
        out.push({ worker, model, expertTokens: c.expertTokens, updatedAt: c.updatedAt });
      }
    }
    return out;
  }

  // --- placement and views ----------------------------------------------------------------------

  version(model: string): number {
    return this.#grid(model).version;
  }

  /** The live placement of a model (see PlacementJson). */
  placement(model: string): PlacementJson {
    const grid = this.#grid(model);
    const registrations: PlacementRegistration[] = [];
    for (const id of [...this.#workers.keys()].sort(compareIds)) {
      const w = this.#workers.get(id) as WorkerState;
      if (w.draining) continue;
      for (const s of w.slices.get(model) ?? []) {
        // only what the model has: a register frame may list more, and backbones poll this
        const layers = s.layers.filter((l) => grid.row.has(l));
        let end = s.experts.length;
        while (end > 0 && (s.experts[end - 1] as number) >= grid.maxExpert) end--;
        if (layers.length === 0 || end === 0) continue;
        registrations.push({ id, model, layers, experts: s.experts.slice(0, end) });
      }
    }
    const owners: PlacementJson["owners"] = [];
    const missing: PlacementJson["missing"] = [];
    for (const l of grid.model.layers) {
      const cell: string[][] = Array.from({ length: l.nExpert }, () => []);
      for (const r of registrations) {
        if (!r.layers.includes(l.layer)) continue;
        for (const e of r.experts) {
          if (e >= l.nExpert) break;
          // a worker whose slices overlap is still one owner
          const who = cell[e] as string[];
          if (who[who.length - 1] !== r.id) who.push(r.id);
        }
      }
      const absent: number[] = [];
      let e = 0;
      while (e < l.nExpert) {
        const who = cell[e] as string[];
        let end = e + 1;
        const key = who.join("\0");
        while (end < l.nExpert && (cell[end] as string[]).join("\0") === key) end++;
        if (who.length > 0) owners.push({ layer: l.layer, experts: `${e}:${end}`, workers: [...who] });
        else for (let k = e; k < end; k++) absent.push(k);
        e = end;
      }
      if (absent.length > 0) {
        missing.push({
          layer: l.layer,
          experts: toRanges(absent).map(formatRange).join(","),
          count: absent.length,
        });
      }
    }
    return {
      model,
      version: grid.version,
      layers: grid.model.layers.map((l) => l.layer),
      experts: grid.maxExpert,
      registrations,
      owners,
      missing,
    };
  }

  /** Per-cell replicas, leases, targets and load of a model at `now`. */
  coverage(model: string, now: number): CoverageGrid {
    this.expire(now);
    const grid = this.#grid(model);
    const v = this.#view(grid, now);
    const rows = <T extends ArrayLike<number>>(a: T, map: (x: number) => number = (x) => x) =>
      grid.model.layers.map((l, r) => {
        const off = grid.offsets[r] as number;
        return Array.from({ length: l.nExpert }, (_, e) => map(a[off + e] as number));
      });
    return {
      model,
      layers: grid.model.layers.map((l) => l.layer),
      nExpert: grid.model.layers.map((l) => l.nExpert),
      replicas: rows(grid.coverage),
      pending: rows(grid.pending),
      targets: rows(v.target),
      load: rows(v.load, (x) => round(x, 3)),
    };
  }

  summary(model: string, now: number): CoverageSummary {
    this.expire(now);
    const grid = this.#grid(model);
    const v = this.#view(grid, now);
    let uncovered = 0;
    let belowTarget = 0;
    let hot = 0;
    for (let i = 0; i < grid.cells; i++) {
      const c = grid.coverage[i] as number;
      const t = v.target[i] as number;
      if (c === 0) uncovered++;
      if (c < t) belowTarget++;
      if (t > 1) hot++;
    }
    let leases = 0;
    for (const l of this.#leases.values()) if (l.model === model) leases++;
    return { model, cells: grid.cells, uncovered, belowTarget, hot, leases, version: grid.version };
  }

  /** Whether a worker's slices of a model count as live coverage now. */
  serves(worker: string, model: string): boolean {
    const w = this.#workers.get(worker);
    return w !== undefined && !w.draining && (w.slices.get(model)?.length ?? 0) > 0;
  }

  // --- persistence ------------------------------------------------------------------------------

  /** Restores what the store kept (before or after the models are added). */
  load(state: {
    leases?: readonly Lease[];
    demand?: readonly StoredDemandRow[];
    credits?: readonly CreditRow[];
  }): void {
    for (const lease of state.leases ?? []) {
      if (this.#leases.has(lease.id)) continue;
      const copy = copyLease(lease);
      this.#leases.set(copy.id, copy);
      this.#grids.get(copy.model)?.addLease(copy, 1);
    }
    const byModel = new Map<string, StoredDemandRow[]>();
    for (const row of state.demand ?? []) {
      const list = byModel.get(row.model);
      if (list) list.push(row);
      else byModel.set(row.model, [row]);
    }
    for (const [model, rows] of byModel) {
      const grid = this.#grids.get(model);
      if (grid) this.#loadDemand(grid, rows);
      else this.#storedDemand.set(model, rows);
    }
    for (const c of state.credits ?? []) {
      let m = this.#credits.get(c.worker);
      if (!m) {
        m = new Map();
        this.#credits.set(c.worker, m);
      }
      m.set(c.model, { expertTokens: c.expertTokens, updatedAt: c.updatedAt });
    }
  }

  /** What changed since the last call (demand rows of changed models, dead leases, changed credits). */
  takeChanges(): MarketChanges {
    const demand: StoredDemandRow[] = [];
    for (const model of this.#dirtyDemand) {
      const grid = this.#grids.get(model);
      if (!grid) continue;
      for (const [r, l] of grid.model.layers.entries()) {
        const off = grid.offsets[r] as number;
        demand.push({
          model,
          layer: l.layer,
          at: grid.demand.at,
          counts: grid.demand.counts.slice(off, off + l.nExpert),
        });
      }
    }
    const credits: CreditRow[] = [];
    for (const key of this.#dirtyCredits) {
      const [worker, model] = key.split("\0") as [string, string];
      const c = this.#credits.get(worker)?.get(model);
      if (c) credits.push({ worker, model, expertTokens: c.expertTokens, updatedAt: c.updatedAt });
    }
    const changes = { demand, deadLeases: [...this.#deadLeases], credits };
    this.#dirtyDemand.clear();
    this.#dirtyCredits.clear();
    this.#deadLeases.clear();
    return changes;
  }

  /** Puts changes back after a failed write (retried at the next flush). */
  restoreChanges(changes: MarketChanges): void {
    for (const d of changes.demand) if (this.#grids.has(d.model)) this.#dirtyDemand.add(d.model);
    for (const c of changes.credits) this.#dirtyCredits.add(`${c.worker}\0${c.model}`);
    for (const id of changes.deadLeases) if (!this.#leases.has(id)) this.#deadLeases.add(id);
  }
}

function holds(slice: Slice, lease: Lease): boolean {
  for (let l = lease.layers.start; l < lease.layers.end; l++) if (!slice.layers.includes(l)) return false;
  // experts are sorted and unique: the range is held when its first and last are and nothing is between missing
  const first = slice.experts.indexOf(lease.experts.start);
  if (first < 0) return false;
  const last = first + (lease.experts.end - lease.experts.start) - 1;
  return slice.experts[last] === lease.experts.end - 1;
}

function overlaps(lease: Lease, layers: Range, experts: Range): boolean {
  return (
    lease.layers.start < layers.end &&
    layers.start < lease.layers.end &&
    lease.experts.start < experts.end &&
    experts.start < lease.experts.end
  );
}

function better(a: Candidate, b: Candidate): boolean {
  if (a.whole !== b.whole) {
    const [w, o] = a.whole ? [a, b] : [b, a];
    if (w.value >= WHOLE_LAYER_SHARE * o.value) return a.whole;
  }
  if (a.value !== b.value) return a.value > b.value;
  const pa = a.bytes > 0 ? a.value / a.bytes : Number.POSITIVE_INFINITY;
  const pb = b.bytes > 0 ? b.value / b.bytes : Number.POSITIVE_INFINITY;
  if (pa !== pb) return pa > pb;
  if (a.rows !== b.rows) return a.rows < b.rows;
  const m = compareIds(a.grid.model.id, b.grid.model.id);
  if (m !== 0) return m < 0;
  if (a.r0 !== b.r0) return a.r0 < b.r0;
  return a.start < b.start;
}

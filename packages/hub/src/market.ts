import { randomBytes } from "node:crypto";
import { type DirectEndpointJson, InvalidArgumentError, type Range } from "@moeswarm/core";
import { type DemandPolicy, demandPolicy } from "./demand.js";
import {
  addCredit,
  creditRows,
  creditsOf,
  loadState,
  restoreChanges,
  takeChanges,
} from "./market-accounting.js";
import { autoClaim, bestSlice, claim } from "./market-claims.js";
import { addCounts, type Claimant, checkCounts, demandRanges, loadDemand } from "./market-demand.js";
import { dropLease, expireLeases, leaseList, ownedLease, renewLease } from "./market-leases.js";
import { coveringLease, endService, putInService, servingList } from "./market-service.js";
import {
  cellsAdded,
  cellsOf,
  copyLease,
  Grid,
  gridOf,
  holds,
  type MarketState,
  modelIds,
  normaliseIds,
  type Slice,
  sameSlice,
  type WorkerState,
} from "./market-state.js";
import type {
  AutoClaimRequest,
  ClaimRequest,
  CoverageGrid,
  CoverageSummary,
  CreditRow,
  DemandRange,
  Lease,
  MarketChanges,
  MarketModel,
  MarketOptions,
  PlacementJson,
  StoredDemandRow,
} from "./market-types.js";
import { coverageOf, placementOf, summaryOf } from "./market-views.js";

export { WHOLE_LAYER_SHARE } from "./market-claims.js";
export { capacityBytes, isWorkerId } from "./market-state.js";
export type {
  AutoClaimRequest,
  ClaimRequest,
  CoverageGrid,
  CoverageSummary,
  CreditRow,
  DemandRange,
  Lease,
  MarketChanges,
  MarketLayer,
  MarketModel,
  MarketOptions,
  PlacementJson,
  PlacementRegistration,
  StoredDemandRow,
  WorkerCapacity,
} from "./market-types.js";

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
 *
 * The sections live in modules named for them, as functions over one MarketState: leases
 * (market-leases.ts), demand (market-demand.ts), claims and the auto-claim search
 * (market-claims.ts), placement and views (market-views.ts), credits and persistence
 * (market-accounting.ts); models and coverage from the relay stay here.
 */

/**
 * The coverage market: coverage from workers' registrations, demand from backbones' routing
 * counts, leases from claims, credits from receipts. See the module comment and README "Demand".
 */
export class CoverageMarket {
  readonly policy: DemandPolicy;
  readonly leaseTtlMs: number;
  readonly maxLeaseTtlMs: number;
  readonly #st: MarketState;
  /** Workers' direct endpoints, by worker id (setDirect). */
  readonly #directs = new Map<string, DirectEndpointJson>();
  /** Paused workers, by id (setPaused): left out of placements, apart from their connection. */
  readonly #paused = new Set<string>();
  /** Connected workers' activation dtypes (their hello's caps.dtypes), by id (setDtypes). */
  readonly #dtypes = new Map<string, readonly string[]>();

  constructor(options: MarketOptions = {}) {
    const { leaseTtlMs, maxLeaseTtlMs, newId, onLeaseEnd, ...policy } = options;
    this.policy = demandPolicy(policy);
    this.maxLeaseTtlMs = maxLeaseTtlMs ?? 3_600_000;
    this.leaseTtlMs = leaseTtlMs ?? Math.min(120_000, this.maxLeaseTtlMs);
    if (!Number.isSafeInteger(this.maxLeaseTtlMs) || this.maxLeaseTtlMs < 1) {
      throw new InvalidArgumentError("market option maxLeaseTtlMs must be an integer >= 1");
    }
    if (
      !Number.isSafeInteger(this.leaseTtlMs) ||
      this.leaseTtlMs < 1 ||
      this.leaseTtlMs > this.maxLeaseTtlMs
    ) {
      throw new InvalidArgumentError("market option leaseTtlMs must be an integer in 1..maxLeaseTtlMs");
    }
    this.#st = {
      policy: this.policy,
      leaseTtlMs: this.leaseTtlMs,
      maxLeaseTtlMs: this.maxLeaseTtlMs,
      newId: newId ?? (() => randomBytes(16).toString("base64url")),
      onLeaseEnd,
      grids: new Map(),
      workers: new Map(),
      leases: new Map(),
      serving: new Map(),
      renewedServing: new Set(),
      storedDemand: new Map(),
      credits: new Map(),
      dirtyDemand: new Set(),
      dirtyCredits: new Set(),
      deadLeases: new Set(),
    };
  }

  // --- models ---------------------------------------------------------------------------------

  /** Adds (or replaces) a model; coverage is rebuilt from the registrations and leases known. */
  addModel(model: MarketModel, now: number): void {
    if (typeof model?.id !== "string" || !Array.isArray(model.layers)) {
      throw new InvalidArgumentError("a market model needs an id and layers");
    }
    let last = -1;
    for (const l of model.layers) {
      if (!Number.isSafeInteger(l.layer) || l.layer <= last)
        throw new InvalidArgumentError("model layers must ascend");
      if (!Number.isSafeInteger(l.nExpert) || l.nExpert < 1)
        throw new InvalidArgumentError("nExpert must be >= 1");
      if (!Number.isSafeInteger(l.bytesPerExpert) || l.bytesPerExpert < 0) {
        throw new InvalidArgumentError("bytesPerExpert must be an integer >= 0");
      }
      last = l.layer;
    }
    const frozen: MarketModel = { id: model.id, layers: model.layers.map((l) => ({ ...l })) };
    const previous = this.#st.grids.get(model.id);
    const grid = new Grid(frozen, now);
    if (previous) grid.version = Math.max(grid.version, previous.version + 1);
    for (const w of this.#st.workers.values()) {
      const list = w.slices.get(model.id);
      if (list && list.length > 0 && !w.draining) grid.addCells(cellsOf(list, grid), 1, w.owner);
    }
    for (const lease of this.#st.leases.values()) if (lease.model === model.id) grid.addLease(lease, 1);
    const rows = this.#st.storedDemand.get(model.id);
    if (rows) {
      this.#st.storedDemand.delete(model.id);
      loadDemand(this.#st, grid, rows);
    }
    this.#st.grids.set(model.id, grid);
  }

  /** Forgets a model: its leases end (reported as dead), its demand is dropped. */
  removeModel(id: string): boolean {
    const had = this.#st.grids.delete(id);
    for (const map of [this.#st.leases, this.#st.serving]) {
      for (const lease of [...map.values()]) {
        if (lease.model === id) {
          map.delete(lease.id);
          this.#st.deadLeases.add(lease.id);
        }
      }
    }
    this.#st.dirtyDemand.delete(id);
    return had;
  }

  hasModel(id: string): boolean {
    return this.#st.grids.has(id);
  }

  modelIds(): string[] {
    return modelIds(this.#st);
  }

  // --- coverage (from the relay) ----------------------------------------------------------------

  #worker(id: string, owner: string | undefined): WorkerState {
    let w = this.#st.workers.get(id);
    if (!w) {
      w = { draining: false, slices: new Map(), owner: owner ?? id, computeClass: undefined };
      this.#st.workers.set(id, w);
    }
    return w;
  }

  /** Withdraws every slice of a worker from the coverage (drain, leave). */
  #withdrawAll(w: WorkerState, now: number): void {
    for (const [model, list] of w.slices) {
      const grid = this.#st.grids.get(model);
      if (!grid || list.length === 0) continue;
      grid.addCells(cellsOf(list, grid), -1, w.owner);
      grid.touch(now);
    }
  }

  /** The principal a connected worker's token named (undefined: not connected). */
  ownerOf(id: string): string | undefined {
    return this.#st.workers.get(id)?.owner;
  }

  /** A worker's connection ended, or a new one replaced it: its slices no longer count. */
  workerGone(id: string, now: number): void {
    const w = this.#st.workers.get(id);
    if (!w) return;
    if (!w.draining) this.#withdrawAll(w, now);
    this.#st.workers.delete(id);
  }

  /**
   * A worker registered a slice of `model`: it adds to the slices it already has (the same slice
   * again changes nothing; a register also ends a drain, as on the relay). Leases of this worker
   * and model that the slice holds are fulfilled: returned, no longer pending, and kept in service
   * as the registration's title (see `servingLeases`; the hub's relay accepts a register only for
   * a slice a live lease covers).
   */
  register(
    id: string,
    model: string,
    layers: readonly number[],
    experts: readonly number[],
    now: number,
    identity: { owner?: string; computeClass?: string } = {},
  ): Lease[] {
    // the owner is the token's, fixed for a connection (a new one starts with workerGone)
    const w = this.#worker(id, identity.owner);
    if (identity.computeClass !== undefined) w.computeClass = identity.computeClass;
    const slice: Slice = { layers: normaliseIds(layers), experts: normaliseIds(experts) };
    // a drain withdrew and forgot every slice: this register starts a new set
    w.draining = false;
    const grid = this.#st.grids.get(model);
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
        grid.addCells(cellsAdded(before, cellsOf(list, grid)), 1, w.owner);
        grid.touch(now);
      }
    }
    const fulfilled: Lease[] = [];
    for (const lease of [...this.#st.leases.values()]) {
      if (lease.worker !== id || lease.model !== model || !holds(slice, lease)) continue;
      putInService(this.#st, lease);
      fulfilled.push(copyLease(lease));
      this.#st.onLeaseEnd?.(copyLease(lease), "fulfilled");
    }
    return fulfilled;
  }

  /**
   * A worker drains (it said so, or the hub asked it): it takes no new dispatches, so its slices
   * are withdrawn and forgotten, as on the relay (a later register starts a new set).
   */
  drain(id: string, now: number): void {
    const w = this.#st.workers.get(id);
    if (w && !w.draining) {
      w.draining = true;
      this.#withdrawAll(w, now);
      w.slices.clear();
    }
    // the titles of the withdrawn registrations end with them: serving again takes a new claim
    for (const lease of servingList(this.#st, id)) {
      if (endService(this.#st, lease.id)) this.#st.onLeaseEnd?.(lease, "revoked");
    }
  }

  /** A slice the relay withdrew (its lease ended): it no longer counts as coverage. */
  unregister(
    id: string,
    model: string,
    layers: readonly number[],
    experts: readonly number[],
    now: number,
  ): void {
    const w = this.#st.workers.get(id);
    const list = w?.slices.get(model);
    if (!w || !list) return;
    const slice: Slice = { layers: normaliseIds(layers), experts: normaliseIds(experts) };
    const i = list.findIndex((s) => sameSlice(s, slice));
    if (i < 0) return;
    const grid = this.#st.grids.get(model);
    const before = grid && !w.draining ? cellsOf(list, grid) : undefined;
    list.splice(i, 1);
    if (grid && before) {
      grid.addCells(cellsAdded(cellsOf(list, grid), before), -1, w.owner);
      grid.touch(now);
    }
  }

  /**
   * Whether a live lease of `worker` (pending or in service) covers the slice: every layer and
   * expert inside its ranges. The hub's relay registers nothing else.
   */
  covers(
    worker: string,
    model: string,
    layers: readonly number[],
    experts: readonly number[],
    now: number,
  ): boolean {
    expireLeases(this.#st, now);
    return coveringLease(this.#st, worker, model, layers, experts) !== undefined;
  }

  /** Ends every lease of a worker, pending and in service (a quarantine); returns them. */
  revokeWorker(id: string): Lease[] {
    const ended: Lease[] = [];
    for (const lease of leaseList(this.#st, undefined)) {
      if (lease.worker !== id) continue;
      dropLease(this.#st, lease);
      this.#st.deadLeases.add(lease.id);
      ended.push(lease);
    }
    for (const lease of servingList(this.#st, id)) if (endService(this.#st, lease.id)) ended.push(lease);
    for (const lease of ended) this.#st.onLeaseEnd?.(lease, "revoked");
    return ended;
  }

  /** Leases in service: fulfilled by a registration and kept as its title, oldest first. */
  servingLeases(options: { worker?: string } = {}): Lease[] {
    return servingList(this.#st, options.worker);
  }

  // --- demand -----------------------------------------------------------------------------------

  /**
   * Adds a backbone's routing counts of `model` (per MoE layer, one count per expert: how many
   * (token, slot) selections chose it since its previous report), after decaying the model's
   * counters to `now`. InvalidArgumentError for a layer that is not a MoE layer or a wrong length.
   */
  addCounts(model: string, counts: ReadonlyMap<number, ArrayLike<number>>, now: number): void {
    addCounts(this.#st, model, counts, now);
  }

  /** Checks routing counts as addCounts does (InvalidArgumentError), adding nothing. */
  checkCounts(model: string, counts: ReadonlyMap<number, ArrayLike<number>>): void {
    checkCounts(this.#st, model, counts);
  }

  /**
   * The under-covered ranges, most valuable per byte first (then by value, model, layer and first
   * expert): runs of consecutive experts of one layer with `coverage + pending < target` and the
   * same target, coverage and pending. With `claimant`, the demand that worker sees: without the
   * cells it holds, nor those another worker of its owner holds.
   */
  demand(now: number, options: { model?: string; claimant?: Claimant } = {}): DemandRange[] {
    return demandRanges(this.#st, now, options);
  }

  // --- claims (market-claims.ts) and leases (market-leases.ts) ----------------------------------

  /**
   * Grants a lease on `layers x experts` of a model, or throws HubError MOESWARM_HUB_CONFLICT
   * with `details.reason`: "capacity" (the slice, with what the worker already holds, is larger
   * than the capacity offered), "held" (the worker already serves some of these cells), "owner" (another worker of its
   * principal holds some: one owner's second copy is no replica),
   * "covered" (an expert already has its target of live replicas), "leased" (live replicas and
   * other workers' leases reach the target; `details.retryAfterMs` says when the first of those
   * leases expires). A worker may hold several leases; a claim that overlaps one of its leases of
   * the same model replaces that lease.
   */
  claim(request: ClaimRequest, now: number): Lease {
    return claim(this.#st, request, now);
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
    return bestSlice(this.#st, request, now);
  }

  /**
   * Claims the best slice for the capacity (see `bestSlice`). HubError MOESWARM_HUB_CONFLICT with
   * `details.reason` "capacity" (demand exists but no expert of it fits) or "covered" (nothing
   * is below target).
   */
  autoClaim(request: AutoClaimRequest, now: number): Lease {
    return autoClaim(this.#st, request, now);
  }

  lease(id: string, worker: string | undefined, now: number): Lease {
    return copyLease(ownedLease(this.#st, id, worker, now));
  }

  /** Extends a lease to `now + ttl` (a worker renews while it downloads). `worker` undefined: any (admin). */
  renew(id: string, worker: string | undefined, now: number, ttlMs?: number): Lease {
    return renewLease(this.#st, id, worker, now, ttlMs);
  }

  /** Gives a lease up; its cells are in demand again. */
  release(id: string, worker: string | undefined, now: number): Lease {
    const lease = ownedLease(this.#st, id, worker, now);
    if (!endService(this.#st, id)) dropLease(this.#st, lease);
    this.#st.deadLeases.delete(id); // the caller deletes it from the store itself
    return copyLease(lease);
  }

  /** Ends the leases whose time is up (at `expiresAt`); returns them. */
  expire(now: number): Lease[] {
    return expireLeases(this.#st, now);
  }

  /** Active leases, oldest first. */
  leases(options: { model?: string } = {}): Lease[] {
    return leaseList(this.#st, options.model);
  }

  // --- credits (market-accounting.ts) -----------------------------------------------------------

  /** Adds expert-tokens a worker served for a model (from a backbone's receipts). */
  credit(model: string, worker: string, expertTokens: number, now: number): void {
    addCredit(this.#st, model, worker, expertTokens, now);
  }

  /** A worker's expert-tokens served, per model and in all. */
  creditsOf(worker: string): { expertTokens: number; byModel: Record<string, number> } {
    return creditsOf(this.#st, worker);
  }

  /** Every credit row, by worker then model. */
  credits(): CreditRow[] {
    return creditRows(this.#st);
  }

  // --- placement and views (market-views.ts) ----------------------------------------------------

  version(model: string): number {
    return gridOf(this.#st, model).version;
  }

  /** The live placement of a model (see PlacementJson). */
  placement(model: string): PlacementJson {
    return placementOf(this.#st, model, this.#directs, this.#paused, this.#dtypes);
  }

  /**
   * Pauses or resumes a worker: while paused, placements leave its slices out (backbones route it
   * nothing new) but it keeps them, its leases and its coverage. Kept by worker id, apart from its
   * connection. The placements it is in get a new version; false when nothing changed.
   */
  setPaused(id: string, paused: boolean, now: number): boolean {
    if (paused === this.#paused.has(id)) return false;
    if (paused) this.#paused.add(id);
    else this.#paused.delete(id);
    for (const model of this.#st.workers.get(id)?.slices.keys() ?? []) this.#st.grids.get(model)?.touch(now);
    return true;
  }

  /** Whether placements leave this worker out (setPaused). */
  isPaused(id: string): boolean {
    return this.#paused.has(id);
  }

  /**
   * A worker's direct endpoints (undefined withdraws them). Kept by worker id, apart from its
   * connection: it tells them before it connects, and placement shows them for its live slices.
   * The placements it is in get a new version, so backbones see the change.
   */
  setDirect(id: string, direct: DirectEndpointJson | undefined, now: number): void {
    if (direct) this.#directs.set(id, direct);
    else this.#directs.delete(id);
    for (const model of this.#st.workers.get(id)?.slices.keys() ?? []) this.#st.grids.get(model)?.touch(now);
  }

  /**
   * The activation dtypes a worker's connection said its compute takes (undefined: it did not say,
   * or it is gone). Set at its hello, before it registers anything: the placements that first list
   * its slices already carry them, so no version changes here.
   */
  setDtypes(id: string, dtypes: readonly string[] | undefined): void {
    if (dtypes) this.#dtypes.set(id, [...dtypes]);
    else this.#dtypes.delete(id);
  }

  /** Per-cell replicas, leases, targets and load of a model at `now`. */
  coverage(model: string, now: number): CoverageGrid {
    return coverageOf(this.#st, model, now);
  }

  summary(model: string, now: number): CoverageSummary {
    return summaryOf(this.#st, model, now);
  }

  /** Whether a worker's slices of a model count as live coverage now. */
  serves(worker: string, model: string): boolean {
    const w = this.#st.workers.get(worker);
    return w !== undefined && !w.draining && (w.slices.get(model)?.length ?? 0) > 0;
  }

  // --- persistence (market-accounting.ts) -------------------------------------------------------

  /** Restores what the store kept (before or after the models are added). */
  load(state: {
    leases?: readonly Lease[];
    demand?: readonly StoredDemandRow[];
    credits?: readonly CreditRow[];
  }): void {
    loadState(this.#st, state);
  }

  /** What changed since the last call (demand rows of changed models, dead leases, changed credits). */
  takeChanges(): MarketChanges {
    return takeChanges(this.#st);
  }

  /** Puts changes back after a failed write (retried at the next flush). */
  restoreChanges(changes: MarketChanges): void {
    restoreChanges(this.#st, changes);
  }
}

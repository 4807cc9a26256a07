// The coverage market's public shapes: models, capacities, leases, demand, placement and what it
// persists (the market itself is market.ts).
import type { ClaimCapacityJson, PlacementJson, PlacementRegistrationJson, Range } from "@moeswarm/core";
import type { DemandPolicy } from "./demand.js";

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

/** What a worker offers when it claims: the claim body's capacity (one definition, in core). */
export type WorkerCapacity = ClaimCapacityJson;

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
  /**
   * The claimant's principal (its token's `own`), when the claim said: a cell this owner already
   * holds through another worker is not granted to it again (a second copy of one owner is not a
   * replica). Persisted with the lease (SQLite schema 5): it holds across a restart.
   */
  readonly owner?: string;
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
  /** Target above the least (`replicas`): demand made it hot. */
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
  /** The claimant's principal (its token's `own`; default: the owner it registered with, else its id). */
  readonly owner?: string;
}

export interface AutoClaimRequest {
  readonly worker: string;
  /** Only this model (default: every model the market knows). */
  readonly model?: string;
  readonly capacity: WorkerCapacity;
  readonly ttlMs?: number;
  /** As ClaimRequest.owner. */
  readonly owner?: string;
}

/** One slice of a worker in a placement (core's body type). */
export type PlacementRegistration = PlacementRegistrationJson;

/** The live placement of one model (GET /api/models/:model/placement): core's body type. */
export type { PlacementJson };

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
  /** Cells whose target is above the least (`replicas`). */
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
  /** Leases in service whose life their registration extended (written again). */
  leases: Lease[];
}

export interface MarketOptions extends Partial<DemandPolicy> {
  /** Lease lifetime when a claim asks for none (default 120000 ms). */
  leaseTtlMs?: number;
  /** Longest lease a claim may ask for (default 3600000 ms). */
  maxLeaseTtlMs?: number;
  /** Lease ids (default 16 random bytes, base64url); tests pass a counter. */
  newId?: () => string;
  /**
   * Told of every lease that ends by itself: expired, fulfilled by a registration (it then stays in
   * service as the registration's title, see `servingLeases`), or revoked (its worker drained or
   * was quarantined). Must not throw.
   */
  onLeaseEnd?: (lease: Lease, reason: "expired" | "fulfilled" | "revoked") => void;
}

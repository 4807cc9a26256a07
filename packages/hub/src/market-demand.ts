// Demand in the coverage market: backbones' routing counts, decayed, turned per cell into a
// target, a hotness and a value (README "Demand"), and the under-covered ranges workers claim.

import { InvalidArgumentError } from "@moeswarm/core";
import { cellValue, DemandCounters, decayFactor, hotness, targetReplicas } from "./demand.js";
import { expireLeases } from "./market-leases.js";
import { cellsOf, compareIds, type Grid, gridOf, type MarketState, modelIds, round } from "./market-state.js";
import type { DemandRange, MarketLayer, StoredDemandRow } from "./market-types.js";

/** Per-cell figures at one instant, as one claimant sees them. */
export interface View {
  readonly target: Int32Array;
  readonly coverage: Int32Array;
  readonly pending: Int32Array;
  readonly load: Float64Array;
  readonly value: Float64Array;
  /** 1 for the cells the claimant already holds: registered, or leased (leases it replaces aside). */
  readonly mine: Uint8Array | undefined;
  /**
   * 1 for the cells another worker of the claimant's owner holds (registered or leased): a second
   * copy of one owner adds no replica, so those cells are not in demand for this claimant.
   */
  readonly owned: Uint8Array | undefined;
}

/** Whose view: a claimant, and its leases that its claim would replace (not counted). */
export interface Claimant {
  readonly worker: string;
  readonly replacing?: ReadonlySet<string>;
  /** Its principal (default: the owner it registered with, else its id). */
  readonly owner?: string;
}

/** The principal of a worker: the claim's, else the one it registered with, else its id. */
export function ownerOf(st: MarketState, worker: string, claimed?: string): string {
  return claimed ?? st.workers.get(worker)?.owner ?? worker;
}

/** Marks, in `out`, the cells that other workers of `owner` hold (registered or leased). */
function markOwned(st: MarketState, grid: Grid, worker: string, owner: string, out: Uint8Array): void {
  const mark = (layer: number, from: number, to: number) => {
    const r = grid.row.get(layer);
    if (r === undefined) return;
    const n = (grid.model.layers[r] as MarketLayer).nExpert;
    const off = grid.offsets[r] as number;
    for (let e = from; e < Math.min(to, n); e++) out[off + e] = 1;
  };
  for (const [id, w] of st.workers) {
    if (id === worker || w.owner !== owner || w.draining) continue;
    for (const [layer, experts] of cellsOf(w.slices.get(grid.model.id) ?? [], grid)) {
      for (const e of experts) mark(layer, e, e + 1);
    }
  }
  for (const lease of st.leases.values()) {
    if (lease.worker === worker || lease.model !== grid.model.id) continue;
    if (ownerOf(st, lease.worker, lease.owner) !== owner) continue;
    for (let layer = lease.layers.start; layer < lease.layers.end; layer++) {
      mark(layer, lease.experts.start, lease.experts.end);
    }
  }
}

/**
 * Adds a backbone's routing counts of `model` (per MoE layer, one count per expert: how many
 * (token, slot) selections chose it since its previous report), after decaying the model's
 * counters to `now`. InvalidArgumentError for a layer that is not a MoE layer or a wrong length.
 */
export function addCounts(
  st: MarketState,
  model: string,
  counts: ReadonlyMap<number, ArrayLike<number>>,
  now: number,
): void {
  const grid = checkCounts(st, model, counts);
  for (const [layer, values] of counts) {
    grid.demand.add(grid.offsets[grid.row.get(layer) as number] as number, values, now, st.policy.halfLifeMs);
  }
  if (counts.size > 0) st.dirtyDemand.add(model);
}

/** Checks routing counts against the model (see addCounts) without adding them. */
export function checkCounts(
  st: MarketState,
  model: string,
  counts: ReadonlyMap<number, ArrayLike<number>>,
): Grid {
  const grid = gridOf(st, model);
  for (const [layer, values] of counts) {
    const r = grid.row.get(layer);
    if (r === undefined) throw new InvalidArgumentError(`layer ${layer} of ${model} has no routed experts`);
    const n = (grid.model.layers[r] as MarketLayer).nExpert;
    if (values.length !== n)
      throw new InvalidArgumentError(`layer ${layer} of ${model} has ${n} experts, not ${values.length}`);
    for (let i = 0; i < values.length; i++) {
      const v = values[i] as number;
      if (!(v >= 0) || !Number.isFinite(v))
        throw new InvalidArgumentError("counts must be finite numbers >= 0");
    }
  }
  return grid;
}

/** The per-cell figures of a grid at `now`, as `claimant` (if any) sees them. */
export function viewOf(st: MarketState, grid: Grid, now: number, claimant?: Claimant): View {
  const { cells } = grid;
  const coverage = grid.coverage;
  let pending = grid.pending;
  let mine: Uint8Array | undefined;
  let owned: Uint8Array | undefined;
  if (claimant !== undefined) {
    owned = new Uint8Array(cells);
    markOwned(st, grid, claimant.worker, ownerOf(st, claimant.worker, claimant.owner), owned);
    mine = new Uint8Array(cells);
    const w = st.workers.get(claimant.worker);
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
    for (const lease of st.leases.values()) {
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
  const f = decayFactor(now - grid.demand.at, st.policy.halfLifeMs);
  const counts = grid.demand.counts;
  for (const [r, l] of grid.model.layers.entries()) {
    const off = grid.offsets[r] as number;
    let total = 0;
    for (let e = 0; e < l.nExpert; e++) total += (counts[off + e] as number) * f;
    for (let e = 0; e < l.nExpert; e++) {
      const i = off + e;
      const h = hotness((counts[i] as number) * f, total, l.nExpert, st.policy.prior);
      const t = targetReplicas(h, st.policy);
      load[i] = h;
      target[i] = t;
      value[i] = cellValue(h, t, (coverage[i] as number) + (pending[i] as number), st.policy);
    }
  }
  return { target, coverage, pending, load, value, mine, owned };
}

/**
 * The under-covered ranges, most valuable per byte first (then by value, model, layer and first
 * expert): runs of consecutive experts of one layer with `coverage + pending < target` and the
 * same target, coverage and pending. With `claimant`, as that worker sees them: cells it holds, and
 * cells another worker of its owner holds (no replica to add), are not in its demand.
 */
export function demandRanges(
  st: MarketState,
  now: number,
  options: { model?: string; claimant?: Claimant } = {},
): DemandRange[] {
  expireLeases(st, now);
  const grids =
    options.model === undefined ? modelIds(st).map((id) => gridOf(st, id)) : [gridOf(st, options.model)];
  const out: DemandRange[] = [];
  for (const grid of grids) {
    const v = viewOf(st, grid, now, options.claimant);
    // not this claimant's to add: what it holds, and what its owner holds through another worker
    const theirs = (i: number) => v.mine?.[i] === 1 || v.owned?.[i] === 1;
    for (const [r, l] of grid.model.layers.entries()) {
      const off = grid.offsets[r] as number;
      let e = 0;
      while (e < l.nExpert) {
        const i = off + e;
        const t = v.target[i] as number;
        const c = v.coverage[i] as number;
        const p = v.pending[i] as number;
        if (c + p >= t || theirs(i)) {
          e++;
          continue;
        }
        let end = e + 1;
        let value = v.value[i] as number;
        while (
          end < l.nExpert &&
          !theirs(off + end) &&
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
          hot: t > st.policy.replicas,
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

/** Puts stored demand rows (those that fit the grid) into a grid's counters, decayed to the latest row. */
export function loadDemand(st: MarketState, grid: Grid, rows: readonly StoredDemandRow[]): void {
  const usable = rows.filter((r) => {
    const i = grid.row.get(r.layer);
    return i !== undefined && r.counts.length === (grid.model.layers[i] as MarketLayer).nExpert;
  });
  if (usable.length === 0) return;
  // rows written together share an instant; if they do not, bring them all to the latest
  const at = Math.max(...usable.map((r) => r.at));
  grid.demand = new DemandCounters(grid.cells, at);
  for (const r of usable) {
    const f = decayFactor(at - r.at, st.policy.halfLifeMs);
    const off = grid.offsets[grid.row.get(r.layer) as number] as number;
    for (let e = 0; e < r.counts.length; e++) grid.demand.counts[off + e] = (r.counts[e] as number) * f;
  }
}

// Accounting in the coverage market: credits (expert-tokens served, from backbones' receipts) and
// what the hub persists: restoring the stored state, and the changes to write since the last flush.
import { InvalidArgumentError } from "@moeswarm/core";
import { loadDemand } from "./market-demand.js";
import { takeRenewedService } from "./market-service.js";
import { compareIds, copyLease, type MarketState } from "./market-state.js";
import type { CreditRow, Lease, MarketChanges, StoredDemandRow } from "./market-types.js";

/** Adds expert-tokens a worker served for a model (from a backbone's receipts). */
export function addCredit(
  st: MarketState,
  model: string,
  worker: string,
  expertTokens: number,
  now: number,
): void {
  if (!Number.isSafeInteger(expertTokens) || expertTokens < 0)
    throw new InvalidArgumentError("expertTokens must be an integer >= 0");
  if (expertTokens === 0) return;
  let byModel = st.credits.get(worker);
  if (!byModel) {
    byModel = new Map();
    st.credits.set(worker, byModel);
  }
  const had = byModel.get(model)?.expertTokens ?? 0;
  byModel.set(model, {
    expertTokens: Math.min(Number.MAX_SAFE_INTEGER, had + expertTokens),
    updatedAt: now,
  });
  st.dirtyCredits.add(`${worker}\0${model}`);
}

/** A worker's expert-tokens served, per model and in all. */
export function creditsOf(
  st: MarketState,
  worker: string,
): { expertTokens: number; byModel: Record<string, number> } {
  const byModel: Record<string, number> = {};
  let total = 0;
  for (const [model, c] of [...(st.credits.get(worker) ?? new Map()).entries()].sort((a, b) =>
    compareIds(a[0], b[0]),
  )) {
    byModel[model] = c.expertTokens;
    total = Math.min(Number.MAX_SAFE_INTEGER, total + c.expertTokens);
  }
  return { expertTokens: total, byModel };
}

/** Every credit row, by worker then model. */
export function creditRows(st: MarketState): CreditRow[] {
  const out: CreditRow[] = [];
  for (const worker of [...st.credits.keys()].sort(compareIds)) {
    const byModel = st.credits.get(worker) as Map<string, { expertTokens: number; updatedAt: number }>;
    for (const model of [...byModel.keys()].sort(compareIds)) {
      const c = byModel.get(model) as { expertTokens: number; updatedAt: number };
      out.push({ worker, model, expertTokens: c.expertTokens, updatedAt: c.updatedAt });
    }
  }
  return out;
}

/** Restores what the store kept (before or after the models are added). */
export function loadState(
  st: MarketState,
  state: {
    leases?: readonly Lease[];
    demand?: readonly StoredDemandRow[];
    credits?: readonly CreditRow[];
  },
): void {
  for (const lease of state.leases ?? []) {
    // a lease in service is stored as a lease: loaded pending, a returning worker's registration puts it back in service
    if (st.leases.has(lease.id) || st.serving.has(lease.id)) continue;
    const copy = copyLease(lease);
    st.leases.set(copy.id, copy);
    st.grids.get(copy.model)?.addLease(copy, 1);
  }
  const byModel = new Map<string, StoredDemandRow[]>();
  for (const row of state.demand ?? []) {
    const list = byModel.get(row.model);
    if (list) list.push(row);
    else byModel.set(row.model, [row]);
  }
  for (const [model, rows] of byModel) {
    const grid = st.grids.get(model);
    if (grid) loadDemand(st, grid, rows);
    else st.storedDemand.set(model, rows);
  }
  for (const c of state.credits ?? []) {
    let m = st.credits.get(c.worker);
    if (!m) {
      m = new Map();
      st.credits.set(c.worker, m);
    }
    m.set(c.model, { expertTokens: c.expertTokens, updatedAt: c.updatedAt });
  }
}

/** What changed since the last call (demand rows of changed models, dead leases, changed credits). */
export function takeChanges(st: MarketState): MarketChanges {
  const demand: StoredDemandRow[] = [];
  for (const model of st.dirtyDemand) {
    const grid = st.grids.get(model);
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
  for (const key of st.dirtyCredits) {
    const [worker, model] = key.split("\0") as [string, string];
    const c = st.credits.get(worker)?.get(model);
    if (c) credits.push({ worker, model, expertTokens: c.expertTokens, updatedAt: c.updatedAt });
  }
  const changes = { demand, deadLeases: [...st.deadLeases], credits, leases: takeRenewedService(st) };
  st.dirtyDemand.clear();
  st.dirtyCredits.clear();
  st.deadLeases.clear();
  return changes;
}

/** Puts changes back after a failed write (retried at the next flush). */
export function restoreChanges(st: MarketState, changes: MarketChanges): void {
  for (const d of changes.demand) if (st.grids.has(d.model)) st.dirtyDemand.add(d.model);
  for (const c of changes.credits) st.dirtyCredits.add(`${c.worker}\0${c.model}`);
  for (const id of changes.deadLeases) if (!st.leases.has(id) && !st.serving.has(id)) st.deadLeases.add(id);
  for (const l of changes.leases) if (st.serving.has(l.id)) st.renewedServing.add(l.id);
}

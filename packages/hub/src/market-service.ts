// Leases in service: a lease that a registration fulfilled stays, no longer pending, as the
// registration's title. A registration stands only while a live lease of its worker (pending or in
// service) covers it (the relay asks `coveringLease` before it accepts a register, and withdraws
// what no lease covers once one ends). A lease in service is kept alive by its registration: while
// the worker serves a slice it covers, every expiry sweep pushes it to `now + leaseTtlMs`; once the
// worker is gone it has that long to come back (a reconnect replays its registrations), then it
// expires like any lease.
import { copyLease, type MarketState, normaliseIds } from "./market-state.js";
import type { Lease } from "./market-types.js";

/** Whether a lease's rectangle holds every layer and expert of a slice (an empty slice: never). */
export function leaseCovers(lease: Lease, layers: readonly number[], experts: readonly number[]): boolean {
  if (layers.length === 0 || experts.length === 0) return false;
  const within = (r: Lease["layers"], v: number) => Number.isSafeInteger(v) && v >= r.start && v < r.end;
  return layers.every((l) => within(lease.layers, l)) && experts.every((e) => within(lease.experts, e));
}

/** The live lease (pending or in service) of `worker` that covers the slice, if any. */
export function coveringLease(
  st: MarketState,
  worker: string,
  model: string,
  layers: readonly number[],
  experts: readonly number[],
): Lease | undefined {
  for (const map of [st.serving, st.leases]) {
    for (const lease of map.values()) {
      if (lease.worker === worker && lease.model === model && leaseCovers(lease, layers, experts)) {
        return lease;
      }
    }
  }
  return undefined;
}

/**
 * A registration fulfilled this pending lease: it leaves the pending cells and serves as the title.
 * As a pending lease it is dead; it is written again in service (a flush deletes, then puts).
 */
export function putInService(st: MarketState, lease: Lease): void {
  st.leases.delete(lease.id);
  st.grids.get(lease.model)?.addLease(lease, -1);
  st.serving.set(lease.id, copyLease(lease));
  st.deadLeases.add(lease.id);
  st.renewedServing.add(lease.id);
}

/** Ends a lease in service (release, replacement, revocation, expiry); true when there was one. */
export function endService(st: MarketState, id: string): Lease | undefined {
  const lease = st.serving.get(id);
  if (!lease) return undefined;
  st.serving.delete(id);
  st.renewedServing.delete(id);
  st.deadLeases.add(id);
  return copyLease(lease);
}

/** Whether the worker registered (and is not draining) a slice this lease covers. */
function inUse(st: MarketState, lease: Lease): boolean {
  const w = st.workers.get(lease.worker);
  if (!w || w.draining) return false;
  return (w.slices.get(lease.model) ?? []).some((s) =>
    leaseCovers(lease, normaliseIds(s.layers), normaliseIds(s.experts)),
  );
}

/**
 * Keeps the leases in service whose registration stands alive, and ends (returns) those whose
 * worker has been gone for their whole remaining life. A kept lease is written again when less
 * than half its life is left (so a restarted hub still holds it).
 */
export function sweepService(st: MarketState, now: number): Lease[] {
  const gone: Lease[] = [];
  for (const lease of [...st.serving.values()]) {
    if (inUse(st, lease)) {
      if (lease.expiresAt - now < st.leaseTtlMs / 2) {
        st.serving.set(lease.id, { ...lease, expiresAt: now + st.leaseTtlMs });
        st.renewedServing.add(lease.id);
      }
      continue;
    }
    if (lease.expiresAt <= now) {
      const ended = endService(st, lease.id);
      if (ended) gone.push(ended);
    }
  }
  return gone;
}

/** The leases in service that were kept alive since the last call (to be written). */
export function takeRenewedService(st: MarketState): Lease[] {
  const out: Lease[] = [];
  for (const id of st.renewedServing) {
    const lease = st.serving.get(id);
    if (lease) out.push(copyLease(lease));
  }
  st.renewedServing.clear();
  return out;
}

/** Leases in service, oldest first. */
export function servingList(st: MarketState, worker?: string): Lease[] {
  return [...st.serving.values()]
    .filter((l) => worker === undefined || l.worker === worker)
    .sort((a, b) => a.grantedAt - b.grantedAt || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0))
    .map(copyLease);
}

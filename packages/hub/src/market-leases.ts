// Leases of the coverage market: lifetime, ownership, renewal, release and expiry, and the bytes
// a worker holds (registered slices and leases) that its next claim must fit beside.
import { AuthError, HubError, InvalidArgumentError } from "@moeswarm/core";
import { sweepService } from "./market-service.js";
import { cellsOf, compareIds, copyLease, type MarketState } from "./market-state.js";
import type { Lease } from "./market-types.js";

/** A lease lifetime asked for (default the market's), checked against the longest allowed. */
export function ttlOf(st: MarketState, ttlMs: number | undefined): number {
  const ttl = ttlMs ?? st.leaseTtlMs;
  if (!Number.isSafeInteger(ttl) || ttl < 1 || ttl > st.maxLeaseTtlMs) {
    throw new InvalidArgumentError(`ttlMs must be an integer in 1..${st.maxLeaseTtlMs}`);
  }
  return ttl;
}

/** The live lease `id` (after expiring what is due), if `worker` (undefined: any) holds it. */
export function ownedLease(st: MarketState, id: string, worker: string | undefined, now: number): Lease {
  expireLeases(st, now);
  const lease = st.leases.get(id) ?? st.serving.get(id);
  if (!lease)
    throw new HubError("MOESWARM_HUB_NOT_FOUND", "no such lease (it expired, was released or was fulfilled)");
  if (worker !== undefined && lease.worker !== worker) {
    throw new AuthError("MOESWARM_AUTH_ROLE", "the lease belongs to another worker");
  }
  return lease;
}

export function renewLease(
  st: MarketState,
  id: string,
  worker: string | undefined,
  now: number,
  ttlMs?: number,
): Lease {
  const ttl = ttlOf(st, ttlMs);
  const lease = ownedLease(st, id, worker, now);
  const renewed: Lease = { ...lease, expiresAt: Math.max(lease.expiresAt, now + ttl) };
  (st.serving.has(id) ? st.serving : st.leases).set(id, renewed);
  return copyLease(renewed);
}

/** Forgets a lease and takes it off its model's pending cells. */
export function dropLease(st: MarketState, lease: Lease): void {
  st.leases.delete(lease.id);
  st.grids.get(lease.model)?.addLease(lease, -1);
}

/** Ends the leases whose time is up (at `expiresAt`); returns them. */
export function expireLeases(st: MarketState, now: number): Lease[] {
  const gone: Lease[] = [];
  for (const lease of [...st.leases.values()]) {
    if (lease.expiresAt <= now) {
      dropLease(st, lease);
      st.deadLeases.add(lease.id);
      gone.push(copyLease(lease));
      st.onLeaseEnd?.(copyLease(lease), "expired");
    }
  }
  for (const lease of sweepService(st, now)) {
    gone.push(lease);
    st.onLeaseEnd?.(copyLease(lease), "expired");
  }
  return gone;
}

/** Active leases, oldest first. */
export function leaseList(st: MarketState, model: string | undefined): Lease[] {
  return [...st.leases.values()]
    .filter((l) => model === undefined || l.model === model)
    .sort((a, b) => a.grantedAt - b.grantedAt || compareIds(a.id, b.id))
    .map(copyLease);
}

/** Expert bytes a worker holds: its registered slices and its leases (but `replacing`), all models. */
export function heldBytes(st: MarketState, worker: string, replacing?: ReadonlySet<string>): number {
  let bytes = 0;
  const w = st.workers.get(worker);
  if (w) {
    for (const [model, list] of w.slices) {
      const grid = st.grids.get(model);
      if (grid && list.length > 0) bytes += grid.bytesOf(cellsOf(list, grid));
    }
  }
  for (const lease of st.leases.values()) {
    if (lease.worker === worker && !replacing?.has(lease.id)) bytes += lease.bytes;
  }
  return bytes;
}

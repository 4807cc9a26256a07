import { isMoeswarmError, type LeaseJson, type Range } from "@moeswarm/core";
import type { SliceRect } from "./choose.js";
import type { WorkerEventBody } from "./events.js";
import type { Settings } from "./options.js";
import { listCachedSlices } from "./slice-cache.js";

// Claiming slices from the hub: cached ones first (no download), then what the run chose; giving
// leases back.

function overlap(a: SliceRect, b: { layers: Range; experts: Range }): boolean {
  return (
    a.layers.start < b.layers.end &&
    b.layers.start < a.layers.end &&
    a.experts.start < b.experts.end &&
    b.experts.start < a.experts.end
  );
}

/** What claiming needs from the run. */
export interface ClaimContext {
  readonly s: Settings;
  emit(body: WorkerEventBody): void;
  readonly stop: AbortSignal;
  /** The slices held now. */
  heldRects(): SliceRect[];
  /** The download rate measured so far, bytes/s (offered to the hub with the capacity). */
  bandwidthBps(): number | undefined;
}

/** The run's claims: remembers which cached slices it tried and whether it holds a lease yet. */
export class Claims {
  readonly #ctx: ClaimContext;
  /** Cached slice files already tried in this run. */
  readonly #cachedTried = new Set<string>();
  /** No lease granted yet in this run. */
  #fresh = true;

  constructor(ctx: ClaimContext) {
    this.#ctx = ctx;
  }

  /**
   * Claims the newest cached slice, not tried yet in this run and not overlapping what the worker
   * holds, that the hub still needs below its target; undefined when none.
   */
  async claimCached(): Promise<LeaseJson | undefined> {
    const { s } = this.#ctx;
    for (const c of await listCachedSlices(s.cacheDir, s.model)) {
      if (this.#cachedTried.has(c.path)) continue;
      this.#cachedTried.add(c.path);
      if (this.#ctx.heldRects().some((h) => h.model === c.model && overlap(h, c))) continue;
      this.#ctx.emit({
        event: "cached",
        model: c.model,
        layers: c.meta.layers,
        experts: c.meta.experts,
        path: c.path,
      });
      const lease = await this.tryClaim(c.model, c.layers, c.experts);
      if (lease) return lease;
    }
    return undefined;
  }

  /** POST /api/claims; undefined when the hub refuses it (409, or the model is gone). */
  async tryClaim(model: string, layers: Range, experts: Range): Promise<LeaseJson | undefined> {
    const { s } = this.#ctx;
    const fields = {
      model,
      layers: `${layers.start}:${layers.end}`,
      experts: `${experts.start}:${experts.end}`,
    };
    const bandwidthBps = this.#ctx.bandwidthBps();
    try {
      const lease = await s.hub.claim(
        {
          ...fields,
          capacity: { ...s.capacity, ...(bandwidthBps ? { bandwidthBps: Math.round(bandwidthBps) } : {}) },
          worker: s.id,
          ...(s.leaseTtlMs !== undefined ? { ttlMs: s.leaseTtlMs } : {}),
          // until its first lease, whatever the hub still holds for this id is a previous run's
          ...(this.#fresh ? { replaceLeases: true } : {}),
        },
        this.#ctx.stop,
      );
      this.#fresh = false;
      return lease;
    } catch (error) {
      if (
        isMoeswarmError(error, "MOESWARM_HUB_CONFLICT") ||
        isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND")
      ) {
        const d = error.details ?? {};
        this.#ctx.emit({
          event: "claim-refused",
          ...fields,
          reason:
            typeof d.reason === "string"
              ? d.reason
              : error.code === "MOESWARM_HUB_NOT_FOUND"
                ? "not-found"
                : "conflict",
          retryAfterMs: typeof d.retryAfterMs === "number" ? d.retryAfterMs : undefined,
        });
        return undefined;
      }
      throw error;
    }
  }

  /** Gives a lease back (best effort, bounded: the hub expires it anyway). */
  async release(lease: LeaseJson): Promise<void> {
    try {
      await this.#ctx.s.hub.release(lease.leaseId, AbortSignal.timeout(5000));
      this.#ctx.emit({ event: "lease-released", leaseId: lease.leaseId });
    } catch {
      // gone already, or the hub is unreachable: it expires by itself
    }
  }
}

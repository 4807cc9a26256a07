import { isMoeswarmError, type LeaseJson, type Range } from "@moeswarm/core";
import type { SliceChoice, SliceRect } from "./choose.js";
import type { WorkerEventBody } from "./events.js";
import type { Settings } from "./options.js";
import { type CachedSlice, listCachedSlices } from "./slice-cache.js";

// Claiming slices from the hub: what a fresh worker would choose, with its bytes taken from the
// cache when they are there; giving leases back.

function overlap(a: SliceRect, b: { layers: Range; experts: Range }): boolean {
  return (
    a.layers.start < b.layers.end &&
    b.layers.start < a.layers.end &&
    a.experts.start < b.experts.end &&
    b.experts.start < a.experts.end
  );
}

/** The claim {@link pickClaim} chose. */
export interface ClaimPick {
  model: string;
  layers: Range;
  experts: Range;
  /** The chooser's value of the slice, when it came from the demand. */
  value: number | undefined;
  /** The cached slice whose bytes it reuses, if any. */
  cached: CachedSlice | undefined;
  /** "demand": the fresh choice; "cached-same-shape": a cached slice of the fresh choice's shape;
   * "cached-fresh": the previous run's largest slice, claimed first in a run. */
  kind: "demand" | "cached-same-shape" | "cached-fresh";
}

const key = (r: SliceRect) =>
  `${r.model}|${r.layers.start}:${r.layers.end}|${r.experts.start}:${r.experts.end}`;
const area = (r: SliceRect) => (r.layers.end - r.layers.start) * (r.experts.end - r.experts.start);
/** A cached slice of the same shape stands in for the best choice while worth this share of it. */
const SAME_SHAPE_SHARE = 0.9;

/**
 * Which slice to claim, given the demand's choices (best first, as chooseSlices ranks them for
 * the room left) and the complete cached slices that do not overlap what the worker holds.
 *
 * The cache never decides the placement's shape, only where the bytes come from: a cache filled by
 * earlier runs (hot experts' replica slices, a different capacity) would otherwise be re-claimed
 * slice by slice, newest first, and a worker that should own whole layers ends up holding dozens
 * of small slices while every layer goes to two workers. So:
 * 1. The best choice, or a choice of exactly its shape (whole or not, as many layers and experts,
 *    worth at least {@link SAME_SHAPE_SHARE} of it) whose slice is cached: reuse those bytes.
 * 2. Only as the first claim of a run (`fresh`): the largest cached slice when it is at least as
 *    large as the best choice, or when the demand offers nothing. A restarted worker's previous
 *    leases still count as pending in the demand until its first claim (which replaces them), so
 *    the demand alone would send it elsewhere or leave it idle.
 * 3. The best choice, downloaded.
 * `tried`: cached slice paths not to offer again (the hub refused them in this run).
 */
export function pickClaim(
  choices: readonly SliceChoice[],
  cached: readonly CachedSlice[],
  options: { fresh: boolean; tried?: ReadonlySet<string> },
): ClaimPick | undefined {
  const usable = cached.filter((c) => !options.tried?.has(c.path));
  const byKey = new Map(usable.map((c) => [key(c), c]));
  const top = choices[0];
  if (top) {
    const topLayers = top.layers.end - top.layers.start;
    const topExperts = top.experts.end - top.experts.start;
    for (const c of choices) {
      const same =
        c === top ||
        (c.whole === top.whole &&
          c.layers.end - c.layers.start === topLayers &&
          c.experts.end - c.experts.start === topExperts &&
          c.value >= SAME_SHAPE_SHARE * top.value);
      if (!same) continue;
      const hit = byKey.get(key(c));
      if (hit) {
        const kind = c === top ? "demand" : "cached-same-shape";
        return { model: c.model, layers: c.layers, experts: c.experts, value: c.value, cached: hit, kind };
      }
    }
  }
  if (options.fresh && usable.length > 0) {
    // the largest; ties to the most recently used or saved
    const largest = [...usable].sort(
      (a, b) =>
        area(b) - area(a) ||
        b.meta.fileBytes - a.meta.fileBytes ||
        (b.meta.usedAt ?? b.meta.savedAt) - (a.meta.usedAt ?? a.meta.savedAt),
    )[0] as CachedSlice;
    if (!top || area(largest) >= area(top)) {
      return {
        model: largest.model,
        layers: largest.layers,
        experts: largest.experts,
        value: undefined,
        cached: largest,
        kind: "cached-fresh",
      };
    }
  }
  if (!top) return undefined;
  return {
    model: top.model,
    layers: top.layers,
    experts: top.experts,
    value: top.value,
    cached: undefined,
    kind: "demand",
  };
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
  /** Cached slice files already claimed (granted or refused) in this run. */
  readonly #cachedTried = new Set<string>();
  /** The one claim of a previous run's largest slice was made already (see pickClaim). */
  #freshCachedTried = false;
  /** No lease granted yet in this run. */
  #fresh = true;

  constructor(ctx: ClaimContext) {
    this.#ctx = ctx;
  }

  /**
   * The claim to make now: see {@link pickClaim}. Cached slices that overlap what the worker holds
   * are never offered; a cached slice the hub refused once in this run is not offered again.
   */
  async pick(choices: readonly SliceChoice[]): Promise<ClaimPick | undefined> {
    const { s } = this.#ctx;
    const held = this.#ctx.heldRects();
    const cached = (await listCachedSlices(s.cacheDir, s.model)).filter(
      (c) => !held.some((h) => h.model === c.model && overlap(h, c)),
    );
    const pick = pickClaim(choices, cached, {
      fresh: this.#fresh && !this.#freshCachedTried,
      tried: this.#cachedTried,
    });
    if (pick?.cached) {
      this.#cachedTried.add(pick.cached.path);
      if (pick.kind === "cached-fresh") this.#freshCachedTried = true;
      this.#ctx.emit({
        event: "cached",
        model: pick.cached.model,
        layers: pick.cached.meta.layers,
        experts: pick.cached.meta.experts,
        path: pick.cached.path,
      });
    }
    return pick;
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

// Claims in the coverage market: checking a claimed slice against the cells and the worker's
// capacity and granting its lease, and the search for the best slice an auto-claim takes.
import { formatRange, GgufError, InvalidArgumentError, type Range, toRanges } from "@moeswarm/core";
import { demandRanges, ownerOf, type View, viewOf } from "./market-demand.js";
import { dropLease, expireLeases, heldBytes, ttlOf } from "./market-leases.js";
import { endService } from "./market-service.js";
import {
  capacityBytes,
  compareIds,
  conflict,
  copyCapacity,
  copyLease,
  type Grid,
  gridOf,
  isWorkerId,
  type MarketState,
  modelIds,
  overlaps,
  round,
} from "./market-state.js";
import type { AutoClaimRequest, ClaimRequest, Lease, MarketLayer } from "./market-types.js";

/**
 * A whole-layer slice wins over a larger part-layer one while it is worth at least this share of
 * it. A token's top-k experts of a layer then sit on one worker: one request per layer, answered
 * with the worker's sum (dispatch mode "auto"), instead of one per owner with every slot's output.
 * A worker that holds whole layers keeps claiming with what capacity is left, so coverage loses
 * little; 0.5 keeps hot experts elsewhere from being starved by the preference.
 */
export const WHOLE_LAYER_SHARE = 0.5;

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

type CellList = Array<{ layer: number; experts: number[] }>;

/** Checks a slice against the model: every layer a MoE layer, experts within every layer. */
function rowsOf(grid: Grid, layers: Range, experts: Range): number[] {
  for (const [name, r] of [
    ["layers", layers],
    ["experts", experts],
  ] as const) {
    if (!Number.isSafeInteger(r?.start) || !Number.isSafeInteger(r?.end) || r.start < 0 || r.end <= r.start) {
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
 * than the capacity offered), "held" (the worker already serves some of these cells), "owner" (another worker of its
   * principal holds some: one owner's second copy is no replica),
 * "covered" (an expert already has its target of live replicas), "leased" (live replicas and
 * other workers' leases reach the target; `details.retryAfterMs` says when the first of those

/** See CoverageMarket.claim. */
export function claim(st: MarketState, request: ClaimRequest, now: number): Lease {
  if (!isWorkerId(request?.worker)) throw new InvalidArgumentError("worker must be an id of 1..128 bytes");
  const offered = capacityBytes(request.capacity);
  const ttl = ttlOf(st, request.ttlMs);
  expireLeases(st, now);
  const grid = gridOf(st, request.model);
  const { layers, experts } = request;
  const rows = rowsOf(grid, layers, experts);
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
  for (const lease of st.leases.values()) {
    if (lease.worker !== request.worker) continue;
    if (
      request.replaceLeases === true ||
      (lease.model === grid.model.id && overlaps(lease, layers, experts))
    ) {
      replacing.add(lease.id);
    }
  }
  const cells = classify(
    grid,
    viewOf(st, grid, now, {
      worker: request.worker,
      replacing,
      ...(request.owner !== undefined ? { owner: request.owner } : {}),
    }),
    rows,
    experts,
  );
  if (request.replaceLeases === true) {
    // a worker that starts afresh gives up its previous run's titles too (their registrations go)
    for (const lease of st.serving.values()) if (lease.worker === request.worker) replacing.add(lease.id);
  }
  const describe = (list: CellList) =>
    list
      .slice(0, 16)
      .map((x) => ({ layer: x.layer, experts: toRanges(x.experts).map(formatRange).join(",") }));
  if (cells.held.length > 0) {
    throw conflict(`${slice}: worker ${request.worker} already serves some of these experts`, {
      reason: "held",
      cells: describe(cells.held),
    });
  }
  if (cells.owned.length > 0) {
    // a second copy held by the same principal is no replica: it would only cost a download
    throw conflict(
      `${slice}: another worker of owner ${JSON.stringify(ownerOf(st, request.worker, request.owner))} already holds some of these experts; a copy of the same owner is not a replica`,
      { reason: "owner", cells: describe(cells.owned) },
    );
  }
  const used = heldBytes(st, request.worker, replacing);
  if (bytes + used > offered) {
    throw conflict(
      `${slice} needs ${bytes} bytes; with the ${used} this worker already holds that is more than the ${offered} offered`,
      { reason: "capacity", bytes, capacity: offered, held: used },
    );
  }
  if (cells.covered.length > 0) {
    throw conflict(`${slice} is already covered to its target by live workers`, {
      reason: "covered",
      cells: describe(cells.covered),
    });
  }
  if (cells.leased.length > 0) {
    const first = firstExpiry(st, grid.model.id, request.worker, layers, experts);
    throw conflict(`${slice} is leased to its target by other workers`, {
      reason: "leased",
      cells: describe(cells.leased),
      ...(Number.isFinite(first) ? { retryAfterMs: Math.max(0, first - now) } : {}),
    });
  }
  return grant(st, grid, request, { bytes, ttl, replacing }, now);
}

/** The slice's cells the claimant holds already, those covered to target, and those leased to it. */
function classify(
  grid: Grid,
  v: View,
  rows: readonly number[],
  experts: Range,
): { held: CellList; owned: CellList; covered: CellList; leased: CellList } {
  const mine = v.mine as Uint8Array;
  const ownedBy = v.owned as Uint8Array;
  const held: CellList = [];
  const owned: CellList = [];
  const covered: CellList = [];
  const leased: CellList = [];
  for (const r of rows) {
    const off = grid.offsets[r] as number;
    const layer = (grid.model.layers[r] as MarketLayer).layer;
    const h: number[] = [];
    const o: number[] = [];
    const c: number[] = [];
    const p: number[] = [];
    for (let e = experts.start; e < experts.end; e++) {
      const i = off + e;
      const t = v.target[i] as number;
      if (mine[i]) h.push(e);
      else if (ownedBy[i]) o.push(e);
      else if ((v.coverage[i] as number) >= t) c.push(e);
      else if ((v.coverage[i] as number) + (v.pending[i] as number) >= t) p.push(e);
    }
    if (h.length > 0) held.push({ layer, experts: h });
    if (o.length > 0) owned.push({ layer, experts: o });
    if (c.length > 0) covered.push({ layer, experts: c });
    if (p.length > 0) leased.push({ layer, experts: p });
  }
  return { held, owned, covered, leased };
}

/** When the first of other workers' leases on the slice expires (infinity: none). */
function firstExpiry(st: MarketState, model: string, worker: string, layers: Range, experts: Range): number {
  let first = Number.POSITIVE_INFINITY;
  for (const lease of st.leases.values()) {
    if (lease.model === model && lease.worker !== worker && overlaps(lease, layers, experts)) {
      first = Math.min(first, lease.expiresAt);
    }
  }
  return first;
}

/** Drops the leases the claim replaces and grants the new one. */
function grant(
  st: MarketState,
  grid: Grid,
  request: ClaimRequest,
  terms: { bytes: number; ttl: number; replacing: ReadonlySet<string> },
  now: number,
): Lease {
  for (const id of terms.replacing) {
    const old = st.leases.get(id);
    if (old) {
      dropLease(st, old);
      st.deadLeases.add(old.id);
    } else endService(st, id);
  }
  let id = st.newId();
  while (st.leases.has(id) || st.serving.has(id)) id = st.newId();
  const { layers, experts } = request;
  const lease: Lease = {
    id,
    worker: request.worker,
    model: grid.model.id,
    layers: { start: layers.start, end: layers.end },
    experts: { start: experts.start, end: experts.end },
    bytes: terms.bytes,
    grantedAt: now,
    expiresAt: now + terms.ttl,
    capacity: copyCapacity(request.capacity),
    ...(request.owner !== undefined ? { owner: request.owner } : {}),
  };
  st.leases.set(id, lease);
  st.deadLeases.delete(id);
  grid.addLease(lease, 1);
  return copyLease(lease);
}

/** See CoverageMarket.bestSlice. */
export function bestSlice(
  st: MarketState,
  request: AutoClaimRequest,
  now: number,
): { model: string; layers: Range; experts: Range; value: number; bytes: number } | undefined {
  expireLeases(st, now);
  const offered = capacityBytes(request.capacity) - heldBytes(st, request.worker);
  if (offered <= 0) return undefined;
  const grids =
    request.model === undefined ? modelIds(st).map((id) => gridOf(st, id)) : [gridOf(st, request.model)];
  let best: Candidate | undefined;
  for (const grid of grids) {
    const claimant = {
      worker: request.worker,
      ...(request.owner !== undefined ? { owner: request.owner } : {}),
    };
    best = bestInGrid(grid, viewOf(st, grid, now, claimant), offered, best);
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
 * The best candidate of `best` and this grid's rectangles: for each run of consecutive layers
 * from each first layer, the open experts (below target, not the claimant's) in runs, and in each
 * run the window of at most what fits with the most value.
 */
function bestInGrid(
  grid: Grid,
  v: View,
  offered: number,
  best: Candidate | undefined,
): Candidate | undefined {
  const mine = v.mine as Uint8Array;
  const owned = v.owned as Uint8Array;
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
        if (
          mine[i] ||
          owned[i] ||
          (v.coverage[i] as number) + (v.pending[i] as number) >= (v.target[i] as number)
        ) {
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
  return best;
}

/** See CoverageMarket.autoClaim. */
export function autoClaim(st: MarketState, request: AutoClaimRequest, now: number): Lease {
  if (!isWorkerId(request?.worker)) throw new InvalidArgumentError("worker must be an id of 1..128 bytes");
  const ttl = ttlOf(st, request.ttlMs);
  const pick = bestSlice(st, request, now);
  if (!pick) {
    const wanted = demandRanges(st, now, request.model === undefined ? {} : { model: request.model });
    // "" is nobody's principal (owners and ids have 1..128 bytes): the search as a stranger would see it
    if (wanted.length > 0 && request.owner !== undefined && bestSlice(st, { ...request, owner: "" }, now)) {
      // something would fit, but only cells the claimant's owner already holds: no replica to add
      throw conflict(
        `every expert in demand that fits is already held by another worker of owner ${JSON.stringify(request.owner)}; a copy of the same owner is not a replica`,
        { reason: "owner" },
      );
    }
    if (wanted.length > 0) {
      const smallest = Math.min(...wanted.map((d) => d.bytesPerExpert));
      throw conflict("no expert in demand fits the capacity offered", {
        reason: "capacity",
        bytes: smallest,
        capacity: capacityBytes(request.capacity),
        held: heldBytes(st, request.worker),
      });
    }
    throw conflict("every expert is covered or leased to its target", { reason: "covered" });
  }
  return claim(
    st,
    {
      worker: request.worker,
      model: pick.model,
      layers: pick.layers,
      experts: pick.experts,
      capacity: request.capacity,
      ttlMs: ttl,
      ...(request.owner !== undefined ? { owner: request.owner } : {}),
    },
    now,
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

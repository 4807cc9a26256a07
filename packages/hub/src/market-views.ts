// What the coverage market shows: a model's live placement (what backbones route by), its
// coverage grid (the dashboard's heatmap) and its summary (metrics, status).
import { type DirectEndpointJson, formatRange, toRanges } from "@moeswarm/core";
import { viewOf } from "./market-demand.js";
import { expireLeases } from "./market-leases.js";
import { compareIds, type Grid, gridOf, type MarketState, round, type WorkerState } from "./market-state.js";
import type { CoverageGrid, CoverageSummary, PlacementJson, PlacementRegistration } from "./market-types.js";

/** See CoverageMarket.placement. */
export function placementOf(
  st: MarketState,
  model: string,
  directs: ReadonlyMap<string, DirectEndpointJson> = new Map(),
  paused: ReadonlySet<string> = new Set(),
  dtypes: ReadonlyMap<string, readonly string[]> = new Map(),
): PlacementJson {
  const grid = gridOf(st, model);
  const registrations = registrationsOf(st, grid, model, paused).map((r) => {
    const direct = directs.get(r.id);
    const said = dtypes.get(r.id);
    return {
      ...r,
      ...(said ? { dtypes: [...said] } : {}),
      ...(direct
        ? {
            direct: {
              endpoints: [...direct.endpoints],
              fingerprint: direct.fingerprint,
              ...(direct.native ? { native: [...direct.native] } : {}),
            },
          }
        : {}),
    };
  });
  const { owners, missing } = ownersOf(grid, registrations);
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

/**
 * Live, non-draining, unpaused workers' slices of the model, by worker id, cut to what the model
 * has. A paused worker keeps its slices and leases (and counts as coverage: a pause is not a
 * departure), it is only left out of what backbones route by.
 */
function registrationsOf(
  st: MarketState,
  grid: Grid,
  model: string,
  paused: ReadonlySet<string>,
): PlacementRegistration[] {
  const registrations: PlacementRegistration[] = [];
  for (const id of [...st.workers.keys()].sort(compareIds)) {
    const w = st.workers.get(id) as WorkerState;
    if (w.draining || paused.has(id)) continue;
    for (const s of w.slices.get(model) ?? []) {
      // only what the model has: a register frame may list more, and backbones poll this
      const layers = s.layers.filter((l) => grid.row.has(l));
      let end = s.experts.length;
      while (end > 0 && (s.experts[end - 1] as number) >= grid.maxExpert) end--;
      if (layers.length === 0 || end === 0) continue;
      registrations.push({
        id,
        model,
        layers,
        experts: s.experts.slice(0, end),
        owner: w.owner,
        ...(w.computeClass !== undefined ? { computeClass: w.computeClass } : {}),
      });
    }
  }
  return registrations;
}

/** Per layer, runs of experts with the same owners, and the experts nobody serves. */
function ownersOf(
  grid: Grid,
  registrations: readonly PlacementRegistration[],
): Pick<PlacementJson, "owners" | "missing"> {
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
  return { owners, missing };
}

/** See CoverageMarket.coverage. */
export function coverageOf(st: MarketState, model: string, now: number): CoverageGrid {
  expireLeases(st, now);
  const grid = gridOf(st, model);
  const v = viewOf(st, grid, now);
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

/** See CoverageMarket.summary. */
export function summaryOf(st: MarketState, model: string, now: number): CoverageSummary {
  expireLeases(st, now);
  const grid = gridOf(st, model);
  const v = viewOf(st, grid, now);
  let uncovered = 0;
  let belowTarget = 0;
  let hot = 0;
  for (let i = 0; i < grid.cells; i++) {
    const c = grid.coverage[i] as number;
    const t = v.target[i] as number;
    if (c === 0) uncovered++;
    if (c < t) belowTarget++;
    if (t > st.policy.replicas) hot++;
  }
  let leases = 0;
  for (const l of st.leases.values()) if (l.model === model) leases++;
  return { model, cells: grid.cells, uncovered, belowTarget, hot, leases, version: grid.version };
}

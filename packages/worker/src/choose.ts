import { InvalidArgumentError, parseRange, type Range } from "@moeswarm/core";

/** One under-covered range as `GET /api/demand` lists it (the fields the choice reads). */
export interface DemandRangeInput {
  model: string;
  layer: number;
  /** Half-open "a:b". */
  experts: string;
  /** Sum of the range's cells' values. */
  value: number;
  /** Bytes of one expert of this layer. */
  bytesPerExpert: number;
  /** Experts of the layer, in demand or not (hubs that list it): 0:nExpert is a whole layer. */
  nExpert?: number;
}

/** A rectangle of one model's cells: consecutive layers x consecutive experts (half-open). */
export interface SliceRect {
  model: string;
  layers: Range;
  experts: Range;
}

/** A slice worth claiming: a rectangle of consecutive layers x consecutive experts, all in demand. */
export interface SliceChoice {
  model: string;
  layers: Range;
  experts: Range;
  /** Expert weight bytes (what the hub compares with the capacity). */
  bytes: number;
  /** Sum of its cells' values (each cell valued as its range's mean). */
  value: number;
  /** value / bytes. */
  valuePerByte: number;
  /** Every expert of its layers: one owner answers a token's whole layer (one request, its sum). */
  whole: boolean;
}

/** As the hub's market: a whole-layer slice wins while worth this share of a part-layer one. */
export const WHOLE_LAYER_SHARE = 0.5;

interface LayerRow {
  layer: number;
  bytesPerExpert: number;
  /** The layer's expert count when the hub listed it. */
  nExpert: number | undefined;
  /** Value of each expert in demand, NaN for the others. */
  values: Float64Array;
}

/** a and b differ beyond float rounding (sums taken in different orders must still tie). */
function differ(a: number, b: number): boolean {
  return Math.abs(a - b) > 1e-9 * Math.max(Math.abs(a), Math.abs(b));
}

function better(a: SliceChoice, b: SliceChoice): boolean {
  if (a.whole !== b.whole) {
    const [w, o] = a.whole ? [a, b] : [b, a];
    if (w.value >= WHOLE_LAYER_SHARE * o.value) return a.whole;
  }
  if (differ(a.value, b.value)) return a.value > b.value;
  if (differ(a.valuePerByte, b.valuePerByte)) return a.valuePerByte > b.valuePerByte;
  const la = a.layers.end - a.layers.start;
  const lb = b.layers.end - b.layers.start;
  if (la !== lb) return la < lb;
  if (a.model !== b.model) return a.model < b.model;
  if (a.layers.start !== b.layers.start) return a.layers.start < b.layers.start;
  return a.experts.start < b.experts.start;
}

/** Orders choices best first (the order `chooseSlice` prefers). */
export function compareChoices(a: SliceChoice, b: SliceChoice): number {
  if (better(a, b)) return -1;
  if (better(b, a)) return 1;
  return 0;
}

/**
 * The slices a worker with `capacityBytes` should claim, best first: every rectangle of
 * consecutive MoE layers x consecutive experts whose cells are all in demand, clipped to the
 * widest run of experts that fits, ranked whole layers first (while worth
 * {@link WHOLE_LAYER_SHARE} of the other: a token's layer then needs one request), then by the
 * value it adds to the swarm, then by value per byte, then fewer layers, then model, first layer
 * and first expert (deterministic).
 *
 * Why value first: every uncovered cell is worth `uncoveredValue` (100) plus its load, so value per
 * byte barely differs between uncovered ranges; ranking by it alone would send a 2 GiB worker to a
 * single hot expert of 50 MB while a whole uncovered layer that fits waits. Value per byte decides
 * between slices of equal value (the cheaper download wins). This is the hub's own rule for
 * `POST /api/claims/auto`, applied to the demand list the worker read.
 *
 * Each layer's experts are valued at their range's mean (the hub publishes per-range sums).
 * At most one choice per (model, first layer, last layer) is returned, `limit` in all.
 * `exclude`: cells the worker already holds (its slices and leases), never chosen again even when
 * the demand lists them (a hot expert's missing replica cannot be one it serves already).
 */
export function chooseSlices(
  ranges: readonly DemandRangeInput[],
  capacityBytes: number,
  options: { limit?: number; maxLayers?: number; exclude?: readonly SliceRect[] } = {},
): SliceChoice[] {
  if (!Number.isFinite(capacityBytes) || capacityBytes < 0) {
    throw new InvalidArgumentError("capacityBytes must be a number >= 0");
  }
  const limit = options.limit ?? 8;
  const maxLayers = options.maxLayers ?? Number.POSITIVE_INFINITY;
  const byModel = new Map<
    string,
    Map<number, { bytesPerExpert: number; nExpert: number | undefined; cells: Array<[Range, number]> }>
  >();
  for (const r of ranges) {
    if (
      typeof r.model !== "string" ||
      !Number.isInteger(r.layer) ||
      r.layer < 0 ||
      !(r.bytesPerExpert > 0) ||
      !(r.value >= 0)
    ) {
      continue; // a range this worker cannot reason about is not one it claims
    }
    let experts: Range;
    try {
      experts = parseRange(r.experts, { max: 65_536 });
    } catch {
      continue;
    }
    let layers = byModel.get(r.model);
    if (!layers) {
      layers = new Map();
      byModel.set(r.model, layers);
    }
    let row = layers.get(r.layer);
    if (!row) {
      row = { bytesPerExpert: r.bytesPerExpert, nExpert: undefined, cells: [] };
      layers.set(r.layer, row);
    }
    if (Number.isInteger(r.nExpert) && (r.nExpert as number) > 0) row.nExpert = r.nExpert;
    row.cells.push([experts, r.value / (experts.end - experts.start)]);
  }

  const out: SliceChoice[] = [];
  for (const [model, layerMap] of byModel) {
    const rows: LayerRow[] = [...layerMap.entries()]
      .sort((a, b) => a[0] - b[0])
      .map(([layer, { bytesPerExpert, nExpert, cells }]) => {
        const width = Math.max(...cells.map(([e]) => e.end));
        const values = new Float64Array(width).fill(Number.NaN);
        for (const [e, v] of cells) values.fill(v, e.start, e.end);
        for (const x of options.exclude ?? []) {
          if (x.model !== model || layer < x.layers.start || layer >= x.layers.end) continue;
          values.fill(Number.NaN, Math.max(0, x.experts.start), Math.min(width, x.experts.end));
        }
        return { layer, bytesPerExpert, nExpert, values };
      });
    for (let i = 0; i < rows.length; i++) {
      // columns every layer of rows[i..j] has in demand, with their summed value
      let column = Float64Array.from(rows[i]!.values);
      let bytesPerColumn = 0;
      for (let j = i; j < rows.length && j - i < maxLayers; j++) {
        const row = rows[j]!;
        if (j > i && row.layer !== rows[j - 1]!.layer + 1) break; // slices are consecutive layers
        if (j > i) {
          const next = new Float64Array(Math.min(column.length, row.values.length));
          for (let e = 0; e < next.length; e++) next[e] = column[e]! + row.values[e]!;
          column = next;
        }
        bytesPerColumn += row.bytesPerExpert;
        const width = Math.floor(capacityBytes / bytesPerColumn);
        if (width < 1) break; // more layers only cost more per column
        const best = bestWindow(column, width);
        if (!best) break; // no column is in demand in every layer: more layers cannot add one
        const bytes = (best.end - best.start) * bytesPerColumn;
        const span = rows.slice(i, j + 1);
        const n0 = span[0]!.nExpert;
        const whole =
          n0 !== undefined && best.start === 0 && best.end === n0 && span.every((r) => r.nExpert === n0);
        out.push({
          model,
          layers: { start: rows[i]!.layer, end: row.layer + 1 },
          experts: { start: best.start, end: best.end },
          bytes,
          value: best.value,
          valuePerByte: best.value / bytes,
          whole,
        });
      }
    }
  }
  return out.sort(compareChoices).slice(0, limit);
}

/** The highest-value run of at most `width` consecutive columns that are all in demand (not NaN). */
function bestWindow(
  column: Float64Array,
  width: number,
): { start: number; end: number; value: number } | undefined {
  let best: { start: number; end: number; value: number } | undefined;
  let e = 0;
  while (e < column.length) {
    if (Number.isNaN(column[e]!)) {
      e++;
      continue;
    }
    const runStart = e;
    while (e < column.length && !Number.isNaN(column[e]!)) e++;
    const runEnd = e;
    const w = Math.min(width, runEnd - runStart);
    let sum = 0;
    for (let k = runStart; k < runStart + w; k++) sum += column[k]!;
    let bestHere = { start: runStart, end: runStart + w, value: sum };
    for (let s = runStart + 1; s + w <= runEnd; s++) {
      sum += column[s + w - 1]! - column[s - 1]!;
      if (sum > bestHere.value && differ(sum, bestHere.value))
        bestHere = { start: s, end: s + w, value: sum };
    }
    if (!best || (bestHere.value > best.value && differ(bestHere.value, best.value))) best = bestHere;
  }
  if (best) {
    // the running sum drifted by rounding: sum the chosen window afresh
    let value = 0;
    for (let k = best.start; k < best.end; k++) value += column[k]!;
    best.value = value;
  }
  return best;
}

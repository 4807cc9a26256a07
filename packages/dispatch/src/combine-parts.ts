import type { Precision } from "./call-state.js";
import { combineSlotsF32, combineSlotsF64, type SlotSources } from "./combine.js";
import type { Part } from "./part.js";
import type { Routing } from "./route.js";

// The answered parts into one output row per token, in the router's k order (combine.ts holds the
// f32/f64 slot combines; this file lays the parts out for them).

/**
 * The parts combined into `out` (`[n x embd]`) as the call's mode says: "each" slot by slot,
 * "sum" partial by partial, "auto" each token from its one "sum" row or its "each" slots.
 */
export function combineParts(
  out: Float32Array | Float64Array,
  mode: "each" | "sum" | "auto",
  precision: Precision,
  routing: Routing,
  embd: number,
  parts: Part[],
): void {
  const { n, k, ids, weights } = routing;
  if (mode === "auto") {
    combineAuto(out as Float32Array, n, k, embd, ids, weights, parts);
  } else if (mode === "each") {
    if (precision === "f32") {
      const sources = sourcesFromParts<Float32Array>(parts, n, k, embd);
      combineSlotsF32(out as Float32Array, n, k, embd, weights, sources);
    } else {
      combineSlotsF64(out as Float64Array, n, k, embd, weights, sourcesFromParts(parts, n, k, embd));
    }
  } else {
    combinePartials(out, n, k, embd, ids, sourcesFromParts(parts, n, k, embd));
  }
}

/**
 * llama4 weights the expert *input* (llama-graph.cpp:1965, 2104-2109): each (token, slot) becomes its own
 * row `fround(w * x)` with one slot of weight 1, so dispatch and combine need no special case;
 * the per-slot outputs are then added in slot order.
 */
export function expandWeightBeforeFfn(
  hidden: Float32Array | Float64Array,
  routing: Routing,
  embd: number,
  precision: Precision,
): { hidden: Float32Array | Float64Array; routing: Routing } {
  const { n, k, ids, weights } = routing;
  const x = precision === "f32" ? new Float32Array(n * k * embd) : new Float64Array(n * k * embd);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < k; j++) {
      const w = weights[i * k + j]!;
      const o = (i * k + j) * embd;
      for (let c = 0; c < embd; c++) x[o + c] = w * hidden[i * embd + c]!;
    }
  }
  return {
    hidden: x,
    routing: { n: n * k, k: 1, ids: ids.slice(), weights: new Float32Array(n * k).fill(1) },
  };
}

function sourcesFromParts<T extends Float32Array | Float64Array>(
  parts: Part[],
  n: number,
  k: number,
  embd: number,
): SlotSources<T> & { part: Int32Array } {
  const src: (T | undefined)[] = new Array(n * k);
  const off = new Float64Array(n * k);
  const part = new Int32Array(n * k).fill(-1);
  parts.forEach((p, pi) => {
    for (let r = 0; r < p.tokens.length; r++) {
      const i = p.tokens[r]!;
      for (let j = 0; j < k; j++) {
        if (p.ids[r * k + j]! < 0) continue;
        const s = i * k + j;
        src[s] = p.y as T;
        off[s] = p.mode === "each" ? (r * k + j) * embd : r * embd;
        part[s] = pi;
      }
    }
  });
  return { src, off, part };
}

/** mode "sum": per token, each part's partial once, in the order of the part's first slot. */
function combinePartials(
  out: Float32Array | Float64Array,
  n: number,
  k: number,
  embd: number,
  ids: Int32Array,
  sources: SlotSources<Float32Array | Float64Array> & { part: Int32Array },
): void {
  const seen = new Set<number>();
  for (let i = 0; i < n; i++) {
    seen.clear();
    const o = i * embd;
    let first = true;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      if (ids[s]! < 0) continue;
      const pi = sources.part[s]!;
      if (seen.has(pi)) continue;
      seen.add(pi);
      const y = sources.src[s]!;
      const yo = sources.off[s]!;
      if (first) {
        for (let c = 0; c < embd; c++) out[o + c] = y[yo + c]!;
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[o + c]! += y[yo + c]!;
      }
    }
  }
}

/**
 * mode "auto": a token whose slots one "sum" part answered takes that part's row as it is (the
 * worker's sum is this combine's, bit for bit); every other token is combined from its "each" slots.
 */
function combineAuto(
  out: Float32Array,
  n: number,
  k: number,
  embd: number,
  ids: Int32Array,
  weights: Float32Array,
  parts: Part[],
): void {
  const sources = sourcesFromParts<Float32Array>(parts, n, k, embd);
  const sumRow = new Int32Array(n).fill(-1);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      if (ids[s]! < 0) continue;
      const p = parts[sources.part[s]!]!;
      if (p.mode === "sum") {
        // a "sum" part holds every filled slot of the token: its row, once
        sumRow[i] = s;
        for (let jj = 0; jj < k; jj++) sources.src[i * k + jj] = undefined;
      }
      break;
    }
  }
  combineSlotsF32(out, n, k, embd, weights, sources);
  for (let i = 0; i < n; i++) {
    const s = sumRow[i]!;
    if (s < 0) continue;
    const p = parts[sources.part[s]!]!;
    const off = sources.off[s]!;
    out.set(p.y.subarray(off, off + embd), i * embd);
  }
}

/** llama4: add the per-slot rows of the expanded routing back into one row per token. */
export function foldSlots<T extends Float32Array | Float64Array>(
  rows: T,
  ids: Int32Array,
  n: number,
  k: number,
  embd: number,
  make: (len: number) => T,
): T {
  const out = make(n * embd);
  for (let i = 0; i < n; i++) {
    let first = true;
    for (let j = 0; j < k; j++) {
      if (ids[i * k + j]! < 0) continue;
      const ro = (i * k + j) * embd;
      if (first) {
        out.set(rows.subarray(ro, ro + embd), i * embd);
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[i * embd + c]! += rows[ro + c]!;
      }
    }
  }
  return out;
}

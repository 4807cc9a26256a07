import { InvalidArgumentError } from "@moeswarm/core";
import { combineSlotsWasm } from "./combine-slots-wasm.js";
import { combineWasm } from "./combine-wasm.js";

// The weighted combine `out_i = sum_j w_ij * y_ij`, in the router's slot order, as llama.cpp's
// build_moe_ffn does it (src/llama-graph.cpp:2261-2290): `experts * weights` (ggml_mul, each
// product rounded to f32), then the k views added left to right (ggml_add, each sum rounded to
// f32), starting from slot 0's product itself rather than from zero (which keeps the sign of a
// -0 product, as ggml does).
//
// A Float32Array store rounds to f32, so `out[c] = w * y[c]` is `fround(w * y)` (the exact
// product of two f32 fits a double) and `out[c] += fround(w * y[c])` is an f32 add (double
// rounding of a sum of two f32 through f64 is innocuous: 53 >= 2*24 + 2).

/** Where each slot's expert output lives: `src[s]` at `off[s]`, or `src[s] === undefined` for none. */
export interface SlotSources<T extends Float32Array | Float64Array> {
  readonly src: (T | undefined)[];
  readonly off: Float64Array;
}

/**
 * f32 combine of per-slot outputs into `out` ([n x embd]); slots without a source are skipped (a
 * token with none keeps its row as it was). WebAssembly SIMD where the runtime has it, else JS:
 * the same bits either way (combine-wasm.ts says why).
 */
export function combineSlotsF32(
  out: Float32Array,
  n: number,
  k: number,
  embd: number,
  weights: Float32Array,
  slots: SlotSources<Float32Array>,
): void {
  const wasm = combineWasm();
  if (wasm) combineSlotsWasm(wasm, out, n, k, embd, weights, slots);
  else combineSlotsF32Js(out, n, k, embd, weights, slots);
}

/**
 * {@link combineSlotsF32} in plain JS: the fallback, and the reference the WASM path is tested
 * against. Reshaped into monomorphic per-row loops (hoisted `w`, one Float32Array and its offset
 * each) it measured no faster (old/new 1.06, 0.82, 1.06 at 1, 8, 64 tokens with
 * MOESWARM_COMBINE=js in `pnpm bench combine`), so it stays as it was.
 */
export function combineSlotsF32Js(
  out: Float32Array,
  n: number,
  k: number,
  embd: number,
  weights: Float32Array,
  slots: SlotSources<Float32Array>,
): void {
  for (let i = 0; i < n; i++) {
    const o = i * embd;
    let first = true;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      const y = slots.src[s];
      if (y === undefined) continue;
      const w = weights[s]!;
      const yo = slots.off[s]!;
      if (first) {
        for (let c = 0; c < embd; c++) out[o + c] = w * y[yo + c]!;
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[o + c]! += Math.fround(w * y[yo + c]!);
      }
    }
  }
}

/** f64 combine (the oracle path): the same order, no rounding. */
export function combineSlotsF64(
  out: Float64Array,
  n: number,
  k: number,
  embd: number,
  weights: Float32Array,
  slots: SlotSources<Float32Array | Float64Array>,
): void {
  for (let i = 0; i < n; i++) {
    const o = i * embd;
    let first = true;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      const y = slots.src[s];
      if (y === undefined) continue;
      const w = weights[s]!;
      const yo = slots.off[s]!;
      if (first) {
        for (let c = 0; c < embd; c++) out[o + c] = w * y[yo + c]!;
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[o + c]! += w * y[yo + c]!;
      }
    }
  }
}

/**
 * The combine arithmetic alone on a worker's mode-"each" layout: `y` is `[n x k x embd]` (slot
 * (i, j) at `(i*k + j) * embd`), `weights` `[n x k]`. Slots whose id is -1 in `ids` are skipped.
 * Returns `[n x embd]` f32, bit-identical to llama.cpp's combine of the same products.
 */
export function combineEach(
  y: Float32Array,
  weights: Float32Array,
  shape: { n: number; k: number; embd: number; ids?: Int32Array },
): Float32Array {
  const { n, k, embd, ids } = shape;
  if (y.length !== n * k * embd || weights.length !== n * k || (ids !== undefined && ids.length !== n * k)) {
    throw new InvalidArgumentError("combineEach: y, weights and ids disagree with n, k, embd");
  }
  const out = new Float32Array(n * embd);
  const src: (Float32Array | undefined)[] = new Array(n * k);
  const off = new Float64Array(n * k);
  for (let s = 0; s < n * k; s++) {
    if (ids !== undefined && ids[s]! < 0) continue;
    src[s] = y;
    off[s] = s * embd;
  }
  combineSlotsF32(out, n, k, embd, weights, { src, off });
  return out;
}

/**
 * What a worker computes in mode "sum" from its mode-"each" outputs: per token
 * `sum_j fround(w_ij * y_ij)` over its non-empty slots, in f32 in slot order (the `result`
 * frame's definition). Equal to {@link combineEach}.
 */
export const partialSumF32 = combineEach;

import type { ExpertHandler, ExpertRequest, ExpertResult } from "@moeswarm/core";
import { InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import { type ActivationSpec, normalizeActivation } from "./activation.js";
import {
  type ExpertMatrices,
  type ExpertShape,
  type ExpertWeights,
  expertForwardF64,
  expertShape,
} from "./oracle.js";

export interface ReferenceWorkerOptions {
  /** Default "silu". */
  readonly activation?: ActivationSpec;
  /** Experts this worker serves; a request for another is rejected (default: whatever `experts` has). */
  readonly owns?: (layer: number, expert: number) => boolean;
}

function bad(message: string): InvalidArgumentError {
  return new InvalidArgumentError(`reference worker: ${message}`);
}

/** Checks a request's sizes the way a worker must before touching its tensors. */
export function validateExpertRequest(request: ExpertRequest, nEmbd?: number): void {
  const { n, k, embd, x, ids, w, mode } = request;
  if (!Number.isInteger(n) || n < 1 || n > 65_536) throw bad(`n ${n} out of range`);
  if (!Number.isInteger(k) || k < 1 || k > 256) throw bad(`k ${k} out of range`);
  if (!Number.isInteger(embd) || embd < 1 || embd > 65_536) throw bad(`embd ${embd} out of range`);
  if (nEmbd !== undefined && embd !== nEmbd) throw bad(`embd ${embd}, this worker's experts have ${nEmbd}`);
  if (mode !== "each" && mode !== "sum") throw bad(`unknown mode ${String(mode)}`);
  const xOk =
    request.dtype === "f64"
      ? x instanceof Float64Array
      : request.dtype === "f32" && x instanceof Float32Array;
  if (!xOk || x.length !== n * embd) throw bad(`x must be ${request.dtype} with n*embd values`);
  if (!(ids instanceof Int32Array) || ids.length !== n * k) throw bad("ids must be an Int32Array of n*k");
  if (mode === "sum" && (!(w instanceof Float32Array) || w.length !== n * k)) {
    throw bad('mode "sum" needs w, a Float32Array of n*k');
  }
}

/**
 * A worker in TypeScript: computes each requested slot with {@link expertForwardF64} (f64 from
 * the dequantised weights) and answers like a native worker would: f32 outputs for "f32"
 * requests (each slot rounded once), f64 for "f64" requests; mode "sum" adds
 * `fround(w * y)` in f32 in slot order. Used by tests, the examples and as a local fallback.
 */
export function createReferenceWorker(
  experts: ExpertWeights,
  options: ReferenceWorkerOptions = {},
): ExpertHandler {
  const act = normalizeActivation(options.activation);
  const cache = new Map<string, { m: ExpertMatrices; shape: ExpertShape }>();
  const get = (layer: number, id: number) => {
    const key = `${layer}:${id}`;
    let entry = cache.get(key);
    if (!entry) {
      if (options.owns && !options.owns(layer, id))
        throw bad(`expert ${id} of layer ${layer} is not in this worker's slice`);
      const m = experts.expert(layer, id);
      entry = { m, shape: expertShape(m, experts.nEmbd) };
      cache.set(key, entry);
    }
    return entry;
  };
  return (request: ExpertRequest, { signal }): ExpertResult => {
    throwIfAborted(signal);
    validateExpertRequest(request, experts.nEmbd);
    const t0 = performance.now();
    const { n, k, embd, x, ids, layer, mode } = request;
    const f64 = request.dtype === "f64";
    const slot = new Float64Array(embd);
    const y =
      mode === "each"
        ? f64
          ? new Float64Array(n * k * embd)
          : new Float32Array(n * k * embd)
        : f64
          ? new Float64Array(n * embd)
          : new Float32Array(n * embd);
    for (let i = 0; i < n; i++) {
      let first = true;
      for (let j = 0; j < k; j++) {
        const id = ids[i * k + j]!;
        if (id < 0) continue;
        const { m, shape } = get(layer, id);
        expertForwardF64(x, i * embd, embd, m, act, slot, 0, { shape });
        if (mode === "each") {
          y.set(slot, (i * k + j) * embd);
          continue;
        }
        const wt = request.w![i * k + j]!;
        const o = i * embd;
        for (let c = 0; c < embd; c++) {
          const p = f64 ? wt * slot[c]! : Math.fround(wt * Math.fround(slot[c]!));
          if (first) y[o + c] = p;
          else y[o + c]! += p;
        }
        first = false;
      }
    }
    return { mode, n, k, embd, y, ms: performance.now() - t0 };
  };
}

import { InvalidArgumentError } from "@moeswarm/core";
import { type ActivationSpec, activate, type ExpertActivation, normalizeActivation } from "./activation.js";
import type { Routing } from "./route.js";

/**
 * One expert's dequantised weights in ggml layout. A 2-D weight with ne0 columns and ne1 rows is
 * row-major: `y[r] = sum_c W[r * ne0 + c] * x[c]`. gate/up: ne0 = nEmbd, ne1 = nFf; down:
 * ne0 = nFf, ne1 = nEmbd; merged gateUp: ne0 = nEmbd, ne1 = 2 * nFf (gate rows first, then up,
 * as llama-graph.cpp:2129-2131 views them).
 */
export interface ExpertMatrices {
  /** `ffn_gate_exps` slab; absent for up-only experts (bert, nemotron-h, some llama/mistral3). */
  readonly gate?: Float64Array;
  /** `ffn_up_exps` slab (absent when `gateUp` is given). */
  readonly up?: Float64Array;
  /** `ffn_gate_up_exps` slab, replacing gate and up. */
  readonly gateUp?: Float64Array;
  readonly down: Float64Array;
  /**
   * Per-expert scalars `ffn_{gate,up,down}_exps.scale[e]`, multiplied into the matmul output
   * before the bias (build_lora_mm_id, llama-graph.cpp:1549-1556). With `gateUp`, `upScale` scales the
   * merged output, as llama.cpp passes `up_exps_s` there.
   */
  readonly gateScale?: number;
  readonly upScale?: number;
  readonly downScale?: number;
  /** Per-expert bias rows `ffn_{gate,up,down}_exps.bias[:, e]` (gpt-oss), added after the scale. */
  readonly gateBias?: Float64Array;
  readonly upBias?: Float64Array;
  readonly gateUpBias?: Float64Array;
  readonly downBias?: Float64Array;
}

/**
 * Where the oracle and reference workers get weights: a dequantised GGUF slice, a synthetic model
 * or arrays built by a test. `expert` may throw for an expert it does not hold.
 */
export interface ExpertWeights {
  /** Hidden size of the expert input and output. */
  readonly nEmbd: number;
  expert(layer: number, expert: number): ExpertMatrices;
}

function shapeError(message: string): InvalidArgumentError {
  return new InvalidArgumentError(message);
}

/** Validated shape of one expert: the FFN width and which path it takes. */
export interface ExpertShape {
  readonly nFf: number;
  readonly merged: boolean;
  readonly hasGate: boolean;
}

export function expertShape(m: ExpertMatrices, nEmbd: number): ExpertShape {
  if (!(m.down instanceof Float64Array) || m.down.length === 0 || m.down.length % nEmbd !== 0) {
    throw shapeError(`expert down matrix must be a Float64Array of nFf*nEmbd values (nEmbd ${nEmbd})`);
  }
  const nFf = m.down.length / nEmbd;
  const merged = m.gateUp !== undefined;
  if (merged) {
    if (m.gate !== undefined || m.up !== undefined)
      throw shapeError("give either gateUp or gate/up, not both");
    if (m.gateUp.length !== 2 * nFf * nEmbd) throw shapeError("gateUp must have 2*nFf*nEmbd values");
  } else {
    if (m.up === undefined || m.up.length !== nFf * nEmbd) throw shapeError("up must have nFf*nEmbd values");
    if (m.gate !== undefined && m.gate.length !== nFf * nEmbd)
      throw shapeError("gate must have nFf*nEmbd values");
  }
  const checkBias = (b: Float64Array | undefined, len: number, name: string) => {
    if (b !== undefined && b.length !== len) throw shapeError(`${name} must have ${len} values`);
  };
  checkBias(m.gateBias, nFf, "gateBias");
  checkBias(m.upBias, nFf, "upBias");
  checkBias(m.gateUpBias, 2 * nFf, "gateUpBias");
  checkBias(m.downBias, nEmbd, "downBias");
  return { nFf, merged, hasGate: merged || m.gate !== undefined };
}

function matvecRow(w: Float64Array, row: number, cols: number, x: ArrayLike<number>, xOff: number): number {
  const o = row * cols;
  let s = 0;
  for (let c = 0; c < cols; c++) s += w[o + c]! * x[xOff + c]!;
  return s;
}

/**
 * One expert FFN in f64, as build_moe_ffn computes it: gate/up matmuls (scale, bias), the
 * activation, down matmul (scale, bias). Reads `x[xOff .. xOff+nEmbd)`, multiplied by
 * `inputScale` first (llama4's weight-before-FFN), and adds `outScale * y` into `out[outOff ..]`
 * when `accumulate`, else stores `y`.
 */
export function expertForwardF64(
  x: ArrayLike<number>,
  xOff: number,
  nEmbd: number,
  m: ExpertMatrices,
  activation: ExpertActivation,
  out: Float64Array,
  outOff: number,
  options: { inputScale?: number; outScale?: number; accumulate?: boolean; shape?: ExpertShape } = {},
): void {
  const shape = options.shape ?? expertShape(m, nEmbd);
  const { nFf, merged, hasGate } = shape;
  let input: ArrayLike<number> = x;
  let inOff = xOff;
  if (options.inputScale !== undefined) {
    const scaled = new Float64Array(nEmbd);
    for (let c = 0; c < nEmbd; c++) scaled[c] = options.inputScale * x[xOff + c]!;
    input = scaled;
    inOff = 0;
  }
  // the swiglu limit applies only with a separate gate tensor (llama-graph.cpp:2168)
  const act: ExpertActivation =
    merged && activation.kind === "silu" && activation.limit !== undefined ? { kind: "silu" } : activation;
  const h = new Float64Array(nFf);
  for (let r = 0; r < nFf; r++) {
    let g: number | undefined;
    let u: number;
    if (merged) {
      const gu = m.gateUp!;
      const s = m.upScale ?? 1;
      g = matvecRow(gu, r, nEmbd, input, inOff) * s + (m.gateUpBias ? m.gateUpBias[r]! : 0);
      u = matvecRow(gu, nFf + r, nEmbd, input, inOff) * s + (m.gateUpBias ? m.gateUpBias[nFf + r]! : 0);
    } else {
      u = matvecRow(m.up!, r, nEmbd, input, inOff) * (m.upScale ?? 1) + (m.upBias ? m.upBias[r]! : 0);
      if (hasGate) {
        g =
          matvecRow(m.gate!, r, nEmbd, input, inOff) * (m.gateScale ?? 1) + (m.gateBias ? m.gateBias[r]! : 0);
      }
    }
    h[r] = activate(act, g, u);
  }
  const ds = m.downScale ?? 1;
  const os = options.outScale ?? 1;
  for (let c = 0; c < nEmbd; c++) {
    const y = matvecRow(m.down, c, nFf, h, 0) * ds + (m.downBias ? m.downBias[c]! : 0);
    if (options.accumulate) out[outOff + c]! += os * y;
    else out[outOff + c] = os * y;
  }
}

export interface ReferenceMoeOptions {
  readonly layer: number;
  /** Default "silu". */
  readonly activation?: ActivationSpec;
}

/** Checks n, k, ids and weights of a routing against a hidden-state buffer; returns n_embd. */
export function checkRouting(hidden: ArrayLike<number>, routing: Routing, what: string): number {
  const { n, k, ids, weights } = routing ?? ({} as Routing);
  if (!Number.isInteger(n) || n < 0 || !Number.isInteger(k) || k < 1 || k > 256) {
    throw new InvalidArgumentError(`${what}: routing n/k invalid (n ${n}, k ${k})`);
  }
  if (!(ids instanceof Int32Array) || ids.length !== n * k) {
    throw new InvalidArgumentError(`${what}: routing.ids must be an Int32Array of n*k`);
  }
  if (!(weights instanceof Float32Array) || weights.length !== n * k) {
    throw new InvalidArgumentError(`${what}: routing.weights must be a Float32Array of n*k`);
  }
  if (n === 0) {
    if (hidden.length !== 0) throw new InvalidArgumentError(`${what}: n = 0 but hidden is not empty`);
    return 0;
  }
  if (hidden.length === 0 || hidden.length % n !== 0) {
    throw new InvalidArgumentError(`${what}: hidden has ${hidden.length} values, not n (${n}) rows`);
  }
  for (let i = 0; i < ids.length; i++) {
    if (ids[i]! < -1) throw new InvalidArgumentError(`${what}: ids[${i}] = ${ids[i]}`);
    if (!Number.isFinite(weights[i]!)) {
      throw new InvalidArgumentError("MOESWARM_NUMERIC", `${what}: weights[${i}] is not finite`);
    }
  }
  return hidden.length / n;
}

/**
 * The f64 ground truth of one MoE layer: `out[i] = sum_j w_ij * FFN_{ids_ij}(x_i)` over the
 * routing's slots in k order (empty slots, id -1, skipped), every operation in f64 on the
 * dequantised weights. With `routing.weightBeforeFfn` (llama4): `sum_j FFN_{ids_ij}(w_ij * x_i)`.
 */
export function referenceMoe(
  x: ArrayLike<number>,
  routing: Routing,
  experts: ExpertWeights,
  options: ReferenceMoeOptions,
): Float64Array {
  const nEmbd = checkRouting(x, routing, "referenceMoe");
  if (routing.n > 0 && nEmbd !== experts.nEmbd) {
    throw new InvalidArgumentError(
      `referenceMoe: hidden rows have ${nEmbd} values, experts expect ${experts.nEmbd}`,
    );
  }
  const act = normalizeActivation(options.activation);
  const { n, k, ids, weights } = routing;
  const out = new Float64Array(n * nEmbd);
  const cache = new Map<number, { m: ExpertMatrices; shape: ExpertShape }>();
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < k; j++) {
      const id = ids[i * k + j]!;
      if (id < 0) continue;
      let entry = cache.get(id);
      if (!entry) {
        const m = experts.expert(options.layer, id);
        entry = { m, shape: expertShape(m, nEmbd) };
        cache.set(id, entry);
      }
      const w = weights[i * k + j]!;
      expertForwardF64(
        x,
        i * nEmbd,
        nEmbd,
        entry.m,
        act,
        out,
        i * nEmbd,
        routing.weightBeforeFfn
          ? { inputScale: w, accumulate: true, shape: entry.shape }
          : { outScale: w, accumulate: true, shape: entry.shape },
      );
    }
  }
  return out;
}

import { DispatchError, InvalidArgumentError } from "@moeswarm/core";
import { sigmoidF32, softmaxRowF32, softplusF32, sqrtF32, sumF32 } from "./ggml-f32.js";

/**
 * How router logits become expert probabilities: llama.cpp's `llama_expert_gating_func_type`
 * (src/llama-hparams.h:16). The GGUF key `<arch>.expert_gating_func` stores 1..4 in this order.
 */
export type GatingFunction = "softmax" | "sigmoid" | "softmax_weight" | "sqrt_softplus";

/** GGUF `expert_gating_func` values, as in llama-hparams.h (0 = none). */
export const GATING_FUNCTION_IDS: Readonly<Record<GatingFunction, number>> = Object.freeze({
  softmax: 1,
  sigmoid: 2,
  softmax_weight: 3,
  sqrt_softplus: 4,
});

/**
 * What the top-k runs over. "probs": the gated probabilities plus the selection bias (every arch
 * but two); "logits": the raw logits (llama4, llama-graph.cpp:2017); "sigmoid": sigmoid of the
 * logits while the weights come from the softmax (grovemoe, llama-graph.cpp:2021).
 */
export type SelectionSource = "probs" | "logits" | "sigmoid";

/** One MoE layer's routing, with the meaning of llama.cpp's `build_moe_ffn` arguments. */
export interface RoutingConfig {
  /** Routed experts in the layer (`n_expert`). */
  readonly nExpert: number;
  /** Experts per token, k (`n_expert_used`). */
  readonly nExpertUsed: number;
  readonly gating: GatingFunction;
  /** Divide the k weights by their (clamped) sum (`norm_w`). Default false. */
  readonly normalize?: boolean;
  /** Multiply the weights by this (`w_scale`); 0 and 1 mean no scaling, as in llama.cpp. */
  readonly scale?: number;
  /** Expert groups (`n_expert_groups`); 0 or 1 means none. */
  readonly nExpertGroups?: number;
  /** Groups kept per token (`n_group_used`). */
  readonly nGroupUsed?: number;
  /**
   * `exp_probs_b` (DeepSeek-V3): added to the probabilities for the selection only; the weights
   * come from the unbiased probabilities. Length nExpert.
   */
  readonly selectionBias?: ArrayLike<number>;
  /** `ffn_gate_inp.bias` (gpt-oss): added to the logits before gating. Length nExpert. */
  readonly logitBias?: ArrayLike<number>;
  /** Default "probs". */
  readonly selectOn?: SelectionSource;
  /**
   * llama4: the weights multiply the expert *input* and the outputs are summed unweighted
   * (llama-graph.cpp:1965, 2104). Carried into the routing for dispatch and the oracle.
   */
  readonly weightBeforeFfn?: boolean;
}

/** Routing of n tokens: k expert ids and weights per token, token-major ([n x k]). */
export interface Routing {
  readonly n: number;
  readonly k: number;
  /** Global expert ids; -1 marks an empty slot (never produced by `route`). */
  readonly ids: Int32Array;
  readonly weights: Float32Array;
  readonly weightBeforeFfn?: boolean;
}

/** The router's input: f32 logits `[n x nExpert]`, or hidden states and the router matrix. */
export type RouterInput =
  | Float32Array
  | {
      /** `[n x nEmbd]`, token-major. */
      readonly hidden: ArrayLike<number>;
      /**
       * `ffn_gate_inp.weight` in ggml layout: ne0 = nEmbd, ne1 = nExpert, i.e.
       * `logit[e] = sum_c gateWeights[e * nEmbd + c] * hidden[c]`.
       */
      readonly gateWeights: ArrayLike<number>;
    };

export interface RouteOptions {
  /**
   * Expert ids chosen elsewhere (`selected_experts_in`, e.g. DeepSeek-V4's hash-routed layers):
   * `[n x k]`; the weights are still taken from the gated probabilities.
   */
  readonly selected?: Int32Array;
}

/** Clamp on the weight sum before normalising: the smallest normal f16 (llama-graph.cpp:2086). */
export const WEIGHT_SUM_CLAMP = 6.103515625e-5;

const MAX_EXPERTS = 65_536;
const MAX_K = 256;

function configError(message: string, details?: Record<string, unknown>): DispatchError {
  return new DispatchError("MOESWARM_ROUTING_CONFIG", message, details ? { details } : {});
}

function isCount(v: unknown, min: number, max: number): v is number {
  return typeof v === "number" && Number.isInteger(v) && v >= min && v <= max;
}

/** Checks a config eagerly; throws DispatchError MOESWARM_ROUTING_CONFIG naming the field. */
export function validateRoutingConfig(config: RoutingConfig): void {
  if (typeof config !== "object" || config === null) throw configError("routing config must be an object");
  const { nExpert, nExpertUsed } = config;
  if (!isCount(nExpert, 1, MAX_EXPERTS)) {
    throw configError(`nExpert must be an integer in 1..${MAX_EXPERTS}`, { nExpert });
  }
  if (!isCount(nExpertUsed, 1, Math.min(nExpert, MAX_K))) {
    throw configError(`nExpertUsed must be an integer in 1..min(nExpert, ${MAX_K})`, {
      nExpert,
      nExpertUsed,
    });
  }
  if (!Object.hasOwn(GATING_FUNCTION_IDS, config.gating)) {
    throw configError(`unknown gating function ${JSON.stringify(config.gating)}`);
  }
  if (config.scale !== undefined && !Number.isFinite(config.scale)) {
    throw configError("scale must be a finite number", { scale: config.scale });
  }
  if (config.selectOn !== undefined && !["probs", "logits", "sigmoid"].includes(config.selectOn)) {
    throw configError(`unknown selectOn ${JSON.stringify(config.selectOn)}`);
  }
  const groups = config.nExpertGroups ?? 0;
  if (!isCount(groups, 0, nExpert)) throw configError("nExpertGroups must be a non-negative integer");
  if (groups > 1) {
    const used = config.nGroupUsed ?? 0;
    // The same conditions llama_model_base::load_hparams asserts (src/llama-model.cpp:1263-1268).
    if (nExpert % groups !== 0) {
      throw configError("nExpert must be a multiple of nExpertGroups", { nExpert, nExpertGroups: groups });
    }
    if (!isCount(used, 1, groups - 1)) {
      throw configError("nGroupUsed must be in 1..nExpertGroups-1", {
        nExpertGroups: groups,
        nGroupUsed: used,
      });
    }
    if (nExpert / groups < 2) {
      // the group score is the sum of the top 2 (ggml_argsort_top_k asserts ne0 >= 2)
      throw configError("expert groups need at least 2 experts each", { nExpert, nExpertGroups: groups });
    }
  }
  for (const [name, bias] of [
    ["selectionBias", config.selectionBias],
    ["logitBias", config.logitBias],
  ] as const) {
    if (bias === undefined) continue;
    if (typeof bias !== "object" || bias === null || bias.length !== nExpert) {
      throw configError(`${name} must have nExpert (${nExpert}) values`, { length: bias?.length });
    }
    for (let e = 0; e < nExpert; e++) {
      if (!Number.isFinite(bias[e])) throw configError(`${name}[${e}] is not finite`);
    }
  }
}

/**
 * Top-k indices of `vals[off .. off+n)` in descending order. Equal values keep ascending index
 * order: the scan visits indices in order and only a strictly greater value moves ahead, so the
 * result equals a stable descending sort (see README "Ties").
 */
function topK(
  vals: ArrayLike<number>,
  off: number,
  n: number,
  k: number,
  out: Int32Array,
  outOff: number,
  best: Float64Array,
): void {
  let count = 0;
  for (let e = 0; e < n; e++) {
    const v = vals[off + e]!;
    if (count === k && !(v > best[k - 1]!)) continue;
    let pos = count < k ? count : k - 1;
    while (pos > 0 && v > best[pos - 1]!) {
      best[pos] = best[pos - 1]!;
      out[outOff + pos] = out[outOff + pos - 1]!;
      pos--;
    }
    best[pos] = v;
    out[outOff + pos] = e;
    if (count < k) count++;
  }
}

function logitsFromHidden(
  hidden: ArrayLike<number>,
  gateWeights: ArrayLike<number>,
  nExpert: number,
): Float32Array {
  if (gateWeights.length % nExpert !== 0 || gateWeights.length === 0) {
    throw new InvalidArgumentError(
      `gateWeights has ${gateWeights.length} values, not a multiple of nExpert (${nExpert})`,
    );
  }
  const nEmbd = gateWeights.length / nExpert;
  if (hidden.length % nEmbd !== 0) {
    throw new InvalidArgumentError(`hidden has ${hidden.length} values, not a multiple of n_embd (${nEmbd})`);
  }
  const n = hidden.length / nEmbd;
  const logits = new Float32Array(n * nExpert);
  for (let t = 0; t < n; t++) {
    const xo = t * nEmbd;
    for (let e = 0; e < nExpert; e++) {
      const wo = e * nEmbd;
      let s = 0;
      for (let c = 0; c < nEmbd; c++) s += gateWeights[wo + c]! * hidden[xo + c]!;
      logits[t * nExpert + e] = s;
    }
  }
  return logits;
}

/** The router's logits (given, or computed from hidden states), checked: n whole rows, all finite. */
function routerLogits(input: RouterInput, nExpert: number): ArrayLike<number> {
  let logits: ArrayLike<number>;
  if (input instanceof Float32Array) {
    logits = input;
  } else if (typeof input === "object" && input !== null && "hidden" in input && "gateWeights" in input) {
    logits = logitsFromHidden(input.hidden, input.gateWeights, nExpert);
  } else {
    throw new InvalidArgumentError(
      "route: input must be a Float32Array of logits or { hidden, gateWeights }",
    );
  }
  if (logits.length % nExpert !== 0) {
    throw new InvalidArgumentError(
      `route: ${logits.length} logits is not a multiple of nExpert (${nExpert})`,
    );
  }
  for (let i = 0; i < logits.length; i++) {
    if (!Number.isFinite(logits[i])) {
      throw new InvalidArgumentError(
        "MOESWARM_NUMERIC",
        `route: logit ${i % nExpert} of token ${Math.floor(i / nExpert)} is not finite`,
        { details: { token: Math.floor(i / nExpert), expert: i % nExpert } },
      );
    }
  }
  return logits;
}

/** `options.selected`: n*k expert ids, each in range. */
function checkSelected(selected: Int32Array, n: number, k: number, nExpert: number): void {
  if (!(selected instanceof Int32Array) || selected.length !== n * k) {
    throw new InvalidArgumentError(`route: selected must be an Int32Array of n*k = ${n * k} ids`);
  }
  for (let i = 0; i < selected.length; i++) {
    const id = selected[i]!;
    if (id < 0 || id >= nExpert) {
      throw new InvalidArgumentError(`route: selected[${i}] = ${id} out of range`);
    }
  }
}

/** The gating function over one token's (biased) logits, into `probs`, in f32 as ggml-cpu computes it. */
function gate(
  gating: RoutingConfig["gating"],
  row: Float32Array,
  probs: Float32Array,
  nExpert: number,
): void {
  switch (gating) {
    case "softmax":
      softmaxRowF32(row, 0, nExpert, probs, 0);
      break;
    case "sigmoid":
      for (let e = 0; e < nExpert; e++) probs[e] = sigmoidF32(row[e]!);
      break;
    case "softmax_weight":
      probs.set(row);
      break;
    case "sqrt_softplus":
      for (let e = 0; e < nExpert; e++) probs[e] = sqrtF32(softplusF32(row[e]!));
      break;
  }
}

/**
 * Routes n tokens exactly as llama.cpp's `build_moe_ffn` (src/llama-graph.cpp:1938-2096):
 * gating, selection bias, expert groups, top-k, weights from the unbiased probabilities,
 * softmax over the selected (softmax_weight), normalisation by the clamped sum, scale. Every step
 * is f32 as ggml-cpu computes it; ties go to the lower expert index.
 *
 * With `{hidden, gateWeights}` the logits are computed in f64 and rounded to f32, which is not
 * bit-identical to ggml's f32/f16 matmul: for exact agreement pass llama.cpp's own logits.
 */
export function route(input: RouterInput, config: RoutingConfig, options: RouteOptions = {}): Routing {
  validateRoutingConfig(config);
  const { nExpert, nExpertUsed: k } = config;
  const logits = routerLogits(input, nExpert);
  const n = logits.length / nExpert;
  const selected = options.selected;
  if (selected !== undefined) checkSelected(selected, n, k, nExpert);

  const selectOn = config.selectOn ?? "probs";
  const groups = (config.nExpertGroups ?? 0) > 1 ? config.nExpertGroups! : 0;
  const perGroup = groups > 0 ? nExpert / groups : 0;
  const nGroupUsed = config.nGroupUsed ?? 0;
  const scale = Math.fround(config.scale ?? 0);
  const logitBias = config.logitBias;
  const selBias = config.selectionBias;

  const ids = new Int32Array(n * k);
  const weights = new Float32Array(n * k);
  const row = new Float32Array(nExpert);
  const probs = new Float32Array(nExpert);
  const sel = new Float32Array(nExpert);
  const best = new Float64Array(Math.max(k, 2, nGroupUsed));
  const pair = new Int32Array(2);
  const groupScore = new Float32Array(Math.max(groups, 1));
  const keptGroups = new Int32Array(Math.max(nGroupUsed, 1));
  const keep = new Uint8Array(Math.max(groups, 1));
  const w = new Float32Array(k);

  for (let t = 0; t < n; t++) {
    const lo = t * nExpert;
    for (let e = 0; e < nExpert; e++) {
      row[e] = logitBias ? Math.fround(logits[lo + e]! + logitBias[e]!) : logits[lo + e]!;
    }
    gate(config.gating, row, probs, nExpert);
    const io = t * k;
    if (selected) {
      for (let j = 0; j < k; j++) ids[io + j] = selected[io + j]!;
    } else {
      if (selectOn === "logits") sel.set(row);
      else if (selectOn === "sigmoid") for (let e = 0; e < nExpert; e++) sel[e] = sigmoidF32(row[e]!);
      else if (selBias) for (let e = 0; e < nExpert; e++) sel[e] = Math.fround(probs[e]! + selBias[e]!);
      else sel.set(probs);
      if (groups > 0) {
        // group score: sum (ggml_sum_rows, double then f32) of the group's top 2 (llama-graph.cpp:2028-2046)
        for (let g = 0; g < groups; g++) {
          topK(sel, g * perGroup, perGroup, 2, pair, 0, best);
          groupScore[g] = Math.fround(sel[g * perGroup + pair[0]!]! + sel[g * perGroup + pair[1]!]!);
        }
        topK(groupScore, 0, groups, nGroupUsed, keptGroups, 0, best);
        keep.fill(0);
        for (let i = 0; i < nGroupUsed; i++) keep[keptGroups[i]!] = 1;
        for (let g = 0; g < groups; g++) {
          if (!keep[g]) sel.fill(Number.NEGATIVE_INFINITY, g * perGroup, (g + 1) * perGroup);
        }
      }
      topK(sel, 0, nExpert, k, ids, io, best);
    }
    for (let j = 0; j < k; j++) w[j] = probs[ids[io + j]!]!;
    if (config.gating === "softmax_weight") softmaxRowF32(w, 0, k, w, 0);
    if (config.normalize) {
      const sum = Math.max(sumF32(w, 0, k), WEIGHT_SUM_CLAMP);
      for (let j = 0; j < k; j++) w[j] = Math.fround(w[j]! / sum);
    }
    if (scale !== 0 && scale !== 1) {
      for (let j = 0; j < k; j++) w[j] = Math.fround(w[j]! * scale);
    }
    weights.set(w, io);
  }
  return config.weightBeforeFfn ? { n, k, ids, weights, weightBeforeFfn: true } : { n, k, ids, weights };
}

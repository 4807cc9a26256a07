import { InvalidArgumentError } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import {
  activate,
  createReferenceWorker,
  type ExpertActivation,
  type ExpertMatrices,
  type ExpertWeights,
  expertForwardF64,
  normalizeActivation,
  referenceMoe,
} from "../src/index.js";

const silu = (x: number) => x / (1 + Math.exp(-x));
const f64 = (...v: number[]) => Float64Array.from(v);

// nEmbd 2, nFf 1. ggml layout: gate/up rows of nEmbd, down rows of nFf.
const W: ExpertMatrices = { gate: f64(1, 2), up: f64(3, -1), down: f64(0.5, 2) };

function forward(m: ExpertMatrices, x: number[], act: ExpertActivation = { kind: "silu" }): number[] {
  const out = new Float64Array(2);
  expertForwardF64(x, 0, 2, m, act, out, 0);
  return [...out];
}

describe("expertForwardF64: y = down · act(gate·x) ⊙ (up·x)", () => {
  it("computes a hand-checked SwiGLU expert", () => {
    // gate·x = 1*1 + 2*1 = 3, up·x = 3 - 1 = 2, h = silu(3) * 2
    const h = silu(3) * 2;
    expect(forward(W, [1, 1])).toEqual([0.5 * h, 2 * h]);
  });

  it("merged gate_up (gate rows first) equals separate gate and up", () => {
    const merged: ExpertMatrices = { gateUp: f64(1, 2, 3, -1), down: W.down };
    expect(forward(merged, [0.25, -2])).toEqual(forward(W, [0.25, -2]));
  });

  it("applies per-expert scales after the matmul and biases after the scale", () => {
    const m: ExpertMatrices = {
      ...W,
      gateScale: 2,
      upScale: 0.5,
      downScale: 3,
      gateBias: f64(0.25),
      upBias: f64(-1),
      downBias: f64(1, -1),
    };
    // g = 3*2 + 0.25, u = 2*0.5 - 1 = 0 -> h = 0; y = 0*... + bias
    expect(forward(m, [1, 1])).toEqual([1, -1]);
    const x = [2, 1]; // g = 4*2 + 0.25 = 8.25, u = 5*0.5 - 1 = 1.5
    const h = silu(8.25) * 1.5;
    expect(forward(m, x)).toEqual([0.5 * h * 3 + 1, 2 * h * 3 - 1]);
    // merged: the up scale scales the merged output (llama.cpp passes up_exps_s there)
    const mm: ExpertMatrices = { gateUp: f64(1, 2, 3, -1), down: W.down, upScale: 2, gateUpBias: f64(1, 0) };
    const hm = silu(4 * 2 + 1) * (5 * 2);
    expect(forward(mm, x)).toEqual([0.5 * hm, 2 * hm]);
  });

  it("activations as build_moe_ffn applies them", () => {
    const x = [1, 1]; // g = 3, u = 2
    const gelu3 = 0.5 * 3 * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * 3 * (1 + 0.044715 * 9)));
    expect(forward(W, x, { kind: "gelu" })[0]).toBeCloseTo(0.5 * gelu3 * 2, 14);
    expect(gelu3).toBeCloseTo(2.99636, 5);
    expect(forward(W, x, { kind: "relu" })[0]).toBe(0.5 * 3 * 2);
    const oai = normalizeActivation("swiglu_oai");
    expect(oai).toEqual({ kind: "swiglu_oai", alpha: 1.702, limit: 7 });
    expect(activate(oai, 3, 2)).toBeCloseTo((3 / (1 + Math.exp(-1.702 * 3))) * 3, 14);
    expect(activate(oai, 9, -9)).toBeCloseTo((7 / (1 + Math.exp(-1.702 * 7))) * -6, 14);
    const situ: ExpertActivation = { kind: "situ", beta: 4, linearBeta: 2 };
    expect(activate(situ, 3, 2)).toBeCloseTo(
      4 * Math.tanh(3 / 4) * (1 / (1 + Math.exp(-3))) * 2 * Math.tanh(1),
      14,
    );
    // up-only experts
    const upOnly: ExpertMatrices = { up: W.up, down: W.down };
    expect(forward(upOnly, x)[0]).toBe(0.5 * silu(2));
    expect(forward(upOnly, x, { kind: "relu_sqr" })[0]).toBe(0.5 * 4);
    expect(() => forward(W, x, { kind: "relu_sqr" })).toThrow(InvalidArgumentError);
    expect(() => forward(upOnly, x, oai)).toThrow(InvalidArgumentError);
  });

  it("swiglu limits: clamp_output (step35) and clamp_input (deepseek4)", () => {
    // g = 3, u = 2 with limit 1: up clamped to 1
    expect(activate({ kind: "silu", limit: 1, limitMode: "clamp_output" }, 3, 2)).toBe(
      Math.min(silu(3), 1) * 1,
    );
    expect(activate({ kind: "silu", limit: 1, limitMode: "clamp_input" }, 3, 2)).toBe(silu(1) * 1);
    expect(activate({ kind: "silu", limit: 10, limitMode: "clamp_output" }, 3, 2)).toBe(silu(3) * 2);
    // the limit only applies with a separate gate tensor
    const merged: ExpertMatrices = { gateUp: f64(1, 2, 3, -1), down: W.down };
    expect(forward(merged, [1, 1], { kind: "silu", limit: 1 })).toEqual(forward(W, [1, 1]));
  });

  it("rejects matrices of the wrong size", () => {
    expect(() => forward({ gate: f64(1), up: f64(3, -1), down: W.down }, [1, 1])).toThrow(
      InvalidArgumentError,
    );
    expect(() => forward({ up: f64(3), down: W.down }, [1, 1])).toThrow(InvalidArgumentError);
    expect(() => forward({ gateUp: f64(1, 2, 3), down: W.down }, [1, 1])).toThrow(InvalidArgumentError);
    expect(() => forward({ ...W, downBias: f64(1) }, [1, 1])).toThrow(InvalidArgumentError);
    expect(() => normalizeActivation("tanh" as "silu")).toThrow(InvalidArgumentError);
  });
});

describe("referenceMoe", () => {
  // two linear-ish experts: relu with positive pre-activations makes h = g*u
  const E: ExpertMatrices[] = [
    { gate: f64(1, 0), up: f64(0, 1), down: f64(1, 1) }, // h = x0*x1, y = [h, h]
    { gate: f64(1, 1), up: f64(1, 1), down: f64(2, 0) }, // h = (x0+x1)^2, y = [2h, 0]
  ];
  const experts: ExpertWeights = { nEmbd: 2, expert: (_l, e) => E[e]! };
  const x = Float32Array.from([2, 3, 1, 1]);

  it("sums w_j * FFN_j(x) over the slots, skipping empty ones", () => {
    const routing = {
      n: 2,
      k: 2,
      ids: Int32Array.from([0, 1, 1, -1]),
      weights: Float32Array.from([0.5, 0.25, 2, 7]),
    };
    const y = referenceMoe(x, routing, experts, { layer: 0, activation: "relu" });
    // token 0: 0.5*[6,6] + 0.25*[50,0]; token 1: 2*[8,0]
    expect([...y]).toEqual([0.5 * 6 + 0.25 * 50, 0.5 * 6, 16, 0]);
  });

  it("weight before FFN (llama4): sum_j FFN_j(w_j * x)", () => {
    const routing = {
      n: 1,
      k: 2,
      ids: Int32Array.from([0, 1]),
      weights: Float32Array.from([0.5, 2]),
      weightBeforeFfn: true,
    };
    const y = referenceMoe(x.subarray(0, 2), routing, experts, { layer: 0, activation: "relu" });
    // expert 0 on [1, 1.5]: h = 1.5 -> [1.5, 1.5]; expert 1 on [4, 6]: h = 100 -> [200, 0]
    expect([...y]).toEqual([201.5, 1.5]);
  });

  it("rejects a routing that does not fit the hidden states", () => {
    const routing = { n: 3, k: 2, ids: new Int32Array(6), weights: new Float32Array(6) };
    expect(() => referenceMoe(x, routing, experts, { layer: 0 })).toThrow(InvalidArgumentError);
    expect(() =>
      referenceMoe(x, { n: 2, k: 1, ids: Int32Array.from([0, -2]), weights: new Float32Array(2) }, experts, {
        layer: 0,
      }),
    ).toThrow(InvalidArgumentError);
  });
});

describe("createReferenceWorker", () => {
  const experts: ExpertWeights = { nEmbd: 2, expert: () => W };
  const worker = createReferenceWorker(experts, { owns: (_l, e) => e < 2 });
  const signal = new AbortController().signal;
  const base = {
    model: "m",
    layer: 0,
    n: 1,
    embd: 2,
    dtype: "f32" as const,
    x: Float32Array.from([1, 1]),
    k: 2,
  };

  it("answers each slot in f32, and in mode sum adds fround(w*y) in slot order", async () => {
    const h = silu(3) * 2;
    const each = await worker({ ...base, ids: Int32Array.from([0, -1]), mode: "each" }, { signal });
    expect([...each.y]).toEqual([Math.fround(0.5 * h), Math.fround(2 * h), 0, 0]);
    const w = Float32Array.from([0.3, 0.7]);
    const sum = await worker({ ...base, ids: Int32Array.from([0, 1]), w, mode: "sum" }, { signal });
    const p = (wj: number, v: number) => Math.fround(wj * Math.fround(v));
    expect([...sum.y]).toEqual([
      Math.fround(p(w[0]!, 0.5 * h) + p(w[1]!, 0.5 * h)),
      Math.fround(p(w[0]!, 2 * h) + p(w[1]!, 2 * h)),
    ]);
  });

  it("rejects requests outside its slice or with inconsistent sizes", () => {
    expect(() => worker({ ...base, ids: Int32Array.from([2, 0]), mode: "each" }, { signal })).toThrow(
      /not in this worker's slice/,
    );
    expect(() => worker({ ...base, n: 2, ids: Int32Array.from([0, 1]), mode: "each" }, { signal })).toThrow(
      InvalidArgumentError,
    );
    expect(() => worker({ ...base, ids: Int32Array.from([0, 1]), mode: "sum" }, { signal })).toThrow(
      /needs w/,
    );
    expect(() =>
      worker({ ...base, embd: 3, ids: Int32Array.from([0, 1]), mode: "each" }, { signal }),
    ).toThrow(InvalidArgumentError);
    expect(() =>
      worker({ ...base, ids: Int32Array.from([0, 1]), mode: "each" }, { signal: AbortSignal.abort() }),
    ).toThrow();
  });
});

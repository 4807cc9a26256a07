import { DispatchError, InvalidArgumentError } from "@moeswarm/core";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { sigmoidF32, softmaxRowF32, softplusF32, sqrtF32 } from "../src/ggml-f32.js";
import { type GatingFunction, type RoutingConfig, route, WEIGHT_SUM_CLAMP } from "../src/index.js";

// Hand-checked cases: expected values are the closed forms of llama.cpp's formulas
// (src/llama-graph.cpp:1938-2096) evaluated in f64; route() computes in f32, so they agree to
// f32 precision (relative 2^-22 allows a couple of ulp).
const close = (got: number, want: number) =>
  expect(Math.abs(got - want)).toBeLessThanOrEqual(Math.abs(want) * 2 ** -22);
const sig = (x: number) => 1 / (1 + Math.exp(-x));

describe("route: gating functions", () => {
  it("softmax (Qwen2-MoE: no norm): top-k of the softmax, weights are the probabilities", () => {
    const r = route(new Float32Array([1, 3, 2, 0]), { nExpert: 4, nExpertUsed: 2, gating: "softmax" });
    expect([...r.ids]).toEqual([1, 2]);
    const s = 1 + Math.exp(-1) + Math.exp(-2) + Math.exp(-3);
    close(r.weights[0]!, 1 / s);
    close(r.weights[1]!, Math.exp(-1) / s);
    expect(r).toMatchObject({ n: 1, k: 2 });
  });

  it("softmax + normalise (Mixtral): weights are the softmax over the selected logits", () => {
    const r = route(new Float32Array([1, 3, 2, 0, 3, 1, 0, 2]), {
      nExpert: 4,
      nExpertUsed: 2,
      gating: "softmax",
      normalize: true,
    });
    expect([...r.ids]).toEqual([1, 2, 0, 3]);
    close(r.weights[0]!, 1 / (1 + Math.exp(-1)));
    close(r.weights[1]!, Math.exp(-1) / (1 + Math.exp(-1)));
    close(r.weights[2]!, 1 / (1 + Math.exp(-1)));
  });

  it("softmax_weight (gpt-oss): router bias on the logits, top-k on logits, softmax over the k selected", () => {
    const r = route(new Float32Array([0.5, 2, 1, -1]), {
      nExpert: 4,
      nExpertUsed: 2,
      gating: "softmax_weight",
      logitBias: [1, 0, 0, 0],
    });
    expect([...r.ids]).toEqual([1, 0]);
    close(r.weights[0]!, 1 / (1 + Math.exp(-0.5)));
    close(r.weights[1]!, Math.exp(-0.5) / (1 + Math.exp(-0.5)));
  });

  it("sqrt_softplus (DeepSeek-V4): sqrt(log(1 + e^x)), x itself above 20", () => {
    const r = route(new Float32Array([0, 25, 1]), { nExpert: 3, nExpertUsed: 3, gating: "sqrt_softplus" });
    expect([...r.ids]).toEqual([1, 2, 0]);
    close(r.weights[0]!, 5);
    close(r.weights[1]!, Math.sqrt(Math.log1p(Math.E)));
    close(r.weights[2]!, Math.sqrt(Math.LN2));
  });

  it("sigmoid (GLM-4.5, DeepSeek-V3): weights are the sigmoids", () => {
    const r = route(new Float32Array([-1, 2, 0.5]), { nExpert: 3, nExpertUsed: 2, gating: "sigmoid" });
    expect([...r.ids]).toEqual([1, 2]);
    close(r.weights[0]!, sig(2));
    close(r.weights[1]!, sig(0.5));
  });
});

describe("route: selection bias, groups, clamp, scale", () => {
  const v3: RoutingConfig = {
    nExpert: 8,
    nExpertUsed: 2,
    gating: "sigmoid",
    normalize: true,
    scale: 2.5,
    nExpertGroups: 4,
    nGroupUsed: 2,
  };

  it("groups: the group score is the sum of its top 2; experts of the other groups are masked", () => {
    // group 0 holds the best single expert (sigmoid 4 = 0.982) but scores 0.982 + ~0; groups 2 and 3
    // score 1.462 and 1.245, so only experts 4..7 can be selected
    const logits = new Float32Array([4, -10, 0, 0, 1, 1, 0.5, 0.5]);
    const r = route(logits, v3);
    expect([...r.ids]).toEqual([4, 5]);
    close(r.weights[0]!, 1.25);
    close(r.weights[1]!, 1.25);
    const flat = route(logits, { ...v3, nExpertGroups: 0, nGroupUsed: 0 });
    expect([...flat.ids]).toEqual([0, 4]);
  });

  it("exp_probs_b changes the selection only; weights come from the unbiased probabilities", () => {
    const logits = new Float32Array([2, -1, 0, 0, 1, 1, 3, -3]);
    expect([...route(logits, v3).ids]).toEqual([0, 4]);
    const bias = [0, 0, 0, 0, 0, 0, 0, 2];
    const r = route(logits, { ...v3, selectionBias: bias });
    expect([...r.ids]).toEqual([7, 6]);
    // sigmoid(-3) + sigmoid(3) = 1, so the normalised weights are the sigmoids, times 2.5
    close(r.weights[0]!, 2.5 * sig(-3));
    close(r.weights[1]!, 2.5 * sig(3));
  });

  it("normalisation divides by the weight sum clamped to 6.103515625e-5 (smallest normal f16)", () => {
    expect(WEIGHT_SUM_CLAMP).toBe(2 ** -14);
    const logits = new Float32Array([-12, -12.5, -30]);
    const r = route(logits, { nExpert: 3, nExpertUsed: 2, gating: "sigmoid", normalize: true });
    expect([...r.ids]).toEqual([0, 1]);
    // the sum 9.87e-6 is below the clamp: the weights do not sum to 1
    close(r.weights[0]!, sig(-12) / 2 ** -14);
    close(r.weights[1]!, sig(-12.5) / 2 ** -14);
    const big = route(new Float32Array([-1, -1.5, -30]), {
      nExpert: 3,
      nExpertUsed: 2,
      gating: "sigmoid",
      normalize: true,
    });
    close(big.weights[0]! + big.weights[1]!, 1);
  });

  it("scale 0 and 1 mean no scaling (llama.cpp skips both)", () => {
    const logits = new Float32Array([1, 2, 3]);
    const base = route(logits, { nExpert: 3, nExpertUsed: 2, gating: "softmax" });
    for (const scale of [0, 1]) {
      expect([...route(logits, { nExpert: 3, nExpertUsed: 2, gating: "softmax", scale }).weights]).toEqual([
        ...base.weights,
      ]);
    }
    const scaled = route(logits, { nExpert: 3, nExpertUsed: 2, gating: "softmax", scale: 16 });
    expect([...scaled.weights]).toEqual([...base.weights].map((w) => w * 16));
  });
});

describe("route: ties and selection source", () => {
  it("equal values select the lower expert index first", () => {
    expect([...route(new Float32Array(6), { nExpert: 6, nExpertUsed: 3, gating: "softmax" }).ids]).toEqual([
      0, 1, 2,
    ]);
    expect([
      ...route(new Float32Array([1, 5, 5, 5, 2]), { nExpert: 5, nExpertUsed: 2, gating: "softmax" }).ids,
    ]).toEqual([1, 2]);
    // equal group scores keep the lower groups
    const g = route(new Float32Array(8), {
      nExpert: 8,
      nExpertUsed: 3,
      gating: "sigmoid",
      nExpertGroups: 4,
      nGroupUsed: 2,
    });
    expect([...g.ids]).toEqual([0, 1, 2]);
    // a tie created by f32 rounding: sigmoid(20) and sigmoid(25) are both 1.0f
    expect(sigmoidF32(20)).toBe(1);
    expect([
      ...route(new Float32Array([20, 25]), { nExpert: 2, nExpertUsed: 1, gating: "sigmoid" }).ids,
    ]).toEqual([0]);
  });

  it("llama4: top-k on the raw logits, sigmoid weights, weight-before-FFN flag carried", () => {
    const r = route(new Float32Array([20, 25, 22]), {
      nExpert: 3,
      nExpertUsed: 1,
      gating: "sigmoid",
      selectOn: "logits",
      weightBeforeFfn: true,
    });
    expect([...r.ids]).toEqual([1]);
    expect(r.weights[0]).toBe(1);
    expect(r.weightBeforeFfn).toBe(true);
  });

  it("grovemoe: top-k on sigmoid(logits), weights from the softmax", () => {
    const r = route(new Float32Array([20, 25, 0]), {
      nExpert: 3,
      nExpertUsed: 1,
      gating: "softmax",
      selectOn: "sigmoid",
    });
    expect([...r.ids]).toEqual([0]);
    close(r.weights[0]!, Math.exp(-5) / (1 + Math.exp(-5) + Math.exp(-25)));
  });

  it("preselected ids (hash routing) take their weights from the probabilities", () => {
    const logits = new Float32Array([0, 1, 2, 3]);
    const r = route(
      logits,
      { nExpert: 4, nExpertUsed: 2, gating: "sqrt_softplus", normalize: true },
      {
        selected: new Int32Array([0, 2]),
      },
    );
    expect([...r.ids]).toEqual([0, 2]);
    const p0 = Math.sqrt(Math.LN2);
    const p2 = Math.sqrt(Math.log1p(Math.exp(2)));
    close(r.weights[0]!, p0 / (p0 + p2));
  });

  it("hidden states and the router matrix give the same routing as their logits", () => {
    // gate weights in ggml layout: ne0 = n_embd (3), ne1 = n_expert (4)
    const gate = new Float32Array([1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1]);
    const hidden = new Float32Array([0.5, -1, 2, 3, 0, 0]);
    const cfg: RoutingConfig = { nExpert: 4, nExpertUsed: 2, gating: "softmax", normalize: true };
    const a = route({ hidden, gateWeights: gate }, cfg);
    const b = route(new Float32Array([0.5, -1, 2, 1.5, 3, 0, 0, 3]), cfg);
    expect([...a.ids]).toEqual([...b.ids]);
    expect([...a.weights]).toEqual([...b.weights]);
  });
});

describe("route: invalid input", () => {
  it("rejects bad configs with MOESWARM_ROUTING_CONFIG and bad logits with typed errors", () => {
    const bad: Partial<RoutingConfig>[] = [
      { nExpert: 0 },
      { nExpertUsed: 9 },
      { gating: "relu" as GatingFunction },
      { nExpertGroups: 3 },
      { nExpertGroups: 4, nGroupUsed: 4 },
      { nExpertGroups: 8, nGroupUsed: 2 },
      { selectionBias: [1, 2] },
      { logitBias: [0, 0, 0, 0, 0, 0, 0, Number.NaN] },
      { scale: Number.POSITIVE_INFINITY },
    ];
    for (const b of bad) {
      const cfg = { nExpert: 8, nExpertUsed: 2, gating: "softmax", ...b } as RoutingConfig;
      expect(() => route(new Float32Array(8), cfg)).toThrow(DispatchError);
    }
    const cfg: RoutingConfig = { nExpert: 4, nExpertUsed: 2, gating: "softmax" };
    expect(() => route(new Float32Array(6), cfg)).toThrow(InvalidArgumentError);
    expect(() => route(new Float32Array([0, Number.NaN, 0, 0]), cfg)).toThrow(/not finite/);
    expect(() => route([1, 2, 3, 4] as unknown as Float32Array, cfg)).toThrow(InvalidArgumentError);
    expect(() => route(new Float32Array(4), cfg, { selected: new Int32Array([0, 4]) })).toThrow(
      InvalidArgumentError,
    );
    expect(route(new Float32Array(0), cfg)).toMatchObject({ n: 0, k: 2 });
  });
});

// An independent statement of the selection: probabilities as ggml computes them, then a full
// stable sort by (value desc, index asc), groups by the sum of their two best.
function naive(logits: Float32Array, cfg: RoutingConfig): { ids: number[]; weights: number[] } {
  const n = cfg.nExpert;
  const row = Float32Array.from(logits, (x, e) => (cfg.logitBias ? Math.fround(x + cfg.logitBias[e]!) : x));
  const probs = new Float32Array(n);
  if (cfg.gating === "softmax") softmaxRowF32(row, 0, n, probs, 0);
  else if (cfg.gating === "sigmoid") probs.set(row.map(sigmoidF32));
  else if (cfg.gating === "sqrt_softplus") probs.set(row.map((x) => sqrtF32(softplusF32(x))));
  else probs.set(row);
  const sel = Array.from(probs, (p, e) => (cfg.selectionBias ? Math.fround(p + cfg.selectionBias[e]!) : p));
  const order = (vals: number[]) =>
    vals
      .map((v, i) => [v, i] as const)
      .sort((a, b) => b[0] - a[0] || a[1] - b[1])
      .map(([, i]) => i);
  if ((cfg.nExpertGroups ?? 0) > 1) {
    const G = cfg.nExpertGroups!;
    const per = n / G;
    const scores = Array.from({ length: G }, (_, g) => {
      const top = order(sel.slice(g * per, (g + 1) * per));
      return Math.fround(sel[g * per + top[0]!]! + sel[g * per + top[1]!]!);
    });
    const kept = new Set(order(scores).slice(0, cfg.nGroupUsed));
    for (let e = 0; e < n; e++) if (!kept.has(Math.floor(e / per))) sel[e] = Number.NEGATIVE_INFINITY;
  }
  const ids = order(sel).slice(0, cfg.nExpertUsed);
  return { ids, weights: ids.map((e) => probs[e]!) };
}

describe("route: selection property", () => {
  it("equals a full stable sort with group masking, for random logits with many ties", () => {
    const arb = fc
      .record({
        groups: fc.constantFrom(0, 2, 4),
        perGroup: fc.integer({ min: 2, max: 6 }),
        k: fc.integer({ min: 1, max: 6 }),
        gating: fc.constantFrom<GatingFunction>("softmax", "sigmoid", "sqrt_softplus", "softmax_weight"),
        bias: fc.boolean(),
        seedVals: fc.array(fc.integer({ min: -4, max: 4 }), { minLength: 24, maxLength: 24 }),
        used: fc.integer({ min: 1, max: 3 }),
      })
      .map((c) => {
        const nExpert = Math.max(c.groups, 1) * c.perGroup;
        const nGroupUsed = c.groups > 1 ? Math.min(c.used, c.groups - 1) : 0;
        const reach = c.groups > 1 ? nGroupUsed * c.perGroup : nExpert;
        const cfg: RoutingConfig = {
          nExpert,
          nExpertUsed: Math.min(c.k, reach),
          gating: c.gating,
          nExpertGroups: c.groups,
          nGroupUsed,
          ...(c.bias
            ? { selectionBias: Array.from({ length: nExpert }, (_, e) => (c.seedVals[e % 24]! % 2) * 0.25) }
            : {}),
        };
        // small integers and halves: many exact ties
        const logits = Float32Array.from({ length: nExpert }, (_, e) => c.seedVals[(e * 7) % 24]! / 2);
        return { cfg, logits };
      });
    fc.assert(
      fc.property(arb, ({ cfg, logits }) => {
        const r = route(logits, cfg);
        const want = naive(logits, cfg);
        expect([...r.ids]).toEqual(want.ids);
        if (cfg.gating !== "softmax_weight") expect([...r.weights]).toEqual(want.weights);
      }),
      { numRuns: 400 },
    );
  });
});

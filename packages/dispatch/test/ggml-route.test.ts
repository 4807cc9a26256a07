import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { sigmoidF32, softmaxRowF32, softplusF32, sqrtF32 } from "../src/ggml-f32.js";
import { type GatingFunction, type RoutingConfig, route } from "../src/index.js";
import { ggmlRouteOrSkipReason } from "./ggml-route/ggml-route.js";

// route() against ggml itself: ggml-route.c builds the routing half of build_moe_ffn with the same
// ggml calls and runs it on ggml's CPU backend. Ids must be identical; weights may differ only by
// the documented residual of ggml's SIMD expf (README "Numerics"). Exact ties among more than 16
// experts are the one place the ids may differ: ggml-cpu's argsort is std::sort, an unstable
// introsort above 16 elements, while route() keeps the lower index; there the selection values
// of both choices must be equal.

/** The values top-k runs over for one token (before group masking). */
function selectionValues(logits: Float32Array, off: number, cfg: RoutingConfig): Float32Array {
  const n = cfg.nExpert;
  const row = Float32Array.from(logits.subarray(off, off + n), (x, e) =>
    cfg.logitBias ? Math.fround(x + cfg.logitBias[e]!) : x,
  );
  if (cfg.selectOn === "logits") return row;
  if (cfg.selectOn === "sigmoid") return row.map(sigmoidF32);
  const p = new Float32Array(n);
  if (cfg.gating === "softmax") softmaxRowF32(row, 0, n, p, 0);
  else if (cfg.gating === "sigmoid") p.set(row.map(sigmoidF32));
  else if (cfg.gating === "sqrt_softplus") p.set(row.map((x) => sqrtF32(softplusF32(x))));
  else p.set(row);
  return cfg.selectionBias ? p.map((v, e) => Math.fround(v + cfg.selectionBias![e]!)) : p;
}

const ref = await ggmlRouteOrSkipReason();

function ulpDiff(a: number, b: number): number {
  const f = new Float32Array([a, b]);
  const u = new Int32Array(f.buffer);
  return Math.abs(u[0]! - u[1]!);
}

const cfgArb = fc
  .record({
    gating: fc.constantFrom<GatingFunction>("softmax", "sigmoid", "softmax_weight", "sqrt_softplus"),
    groups: fc.constantFrom(0, 0, 4, 8),
    perGroup: fc.integer({ min: 2, max: 16 }),
    k: fc.integer({ min: 1, max: 8 }),
    used: fc.integer({ min: 1, max: 4 }),
    normalize: fc.boolean(),
    scale: fc.constantFrom(0, 1, 2.5, 16, 0.7),
    selBias: fc.boolean(),
    logitBias: fc.boolean(),
    selectOn: fc.constantFrom<"probs" | "logits" | "sigmoid">("probs", "probs", "logits", "sigmoid"),
    n: fc.integer({ min: 1, max: 6 }),
    seed: fc.integer({ min: 1, max: 2 ** 30 }),
    spread: fc.constantFrom(0.5, 3, 12),
  })
  .map((c) => {
    const nExpert = c.groups > 1 ? c.groups * c.perGroup : c.perGroup * 4;
    const nGroupUsed = c.groups > 1 ? Math.min(c.used, c.groups - 1) : 0;
    const reach = c.groups > 1 ? nGroupUsed * c.perGroup : nExpert;
    let s = c.seed;
    const rand = () => {
      s = (Math.imul(s, 1103515245) + 12345) >>> 0;
      return s / 2 ** 32;
    };
    const cfg: RoutingConfig = {
      nExpert,
      nExpertUsed: Math.min(c.k, reach),
      gating: c.gating,
      normalize: c.normalize,
      scale: c.scale,
      nExpertGroups: c.groups,
      nGroupUsed,
      selectOn: c.selectOn,
      ...(c.selBias
        ? { selectionBias: Array.from({ length: nExpert }, () => Math.fround(rand() * 0.2)) }
        : {}),
      ...(c.logitBias ? { logitBias: Array.from({ length: nExpert }, () => Math.fround(rand() - 0.5)) } : {}),
    };
    const logits = Float32Array.from({ length: c.n * nExpert }, () => (rand() * 2 - 1) * c.spread);
    return { cfg, logits };
  });

describe.skipIf(typeof ref === "string")("route vs ggml (build_moe_ffn's routing on ggml-cpu)", () => {
  it("same ids, weights within the SIMD-expf residual", () => {
    if (typeof ref === "string") return;
    const cases = fc.sample(cfgArb, { numRuns: 600, seed: 20251129 });
    const want = ref.routeMany(cases);
    const ulps: Record<string, { max: number; exact: number; total: number }> = {};
    let ties = 0;
    cases.forEach(({ cfg, logits }, c) => {
      const got = route(logits, cfg);
      const k = cfg.nExpertUsed;
      ulps[cfg.gating] ??= { max: 0, exact: 0, total: 0 };
      const s = ulps[cfg.gating]!;
      for (let i = 0; i < got.ids.length; i++) {
        const a = got.ids[i]!;
        const b = want[c]!.ids[i]!;
        if (a !== b) {
          const sel = selectionValues(logits, Math.floor(i / k) * cfg.nExpert, cfg);
          expect(sel[a], `token ${Math.floor(i / k)} slot ${i % k}: ${a} vs ggml ${b} is not a tie`).toBe(
            sel[b],
          );
          if (cfg.nExpert <= 16 && !(cfg.nExpertGroups! > 1 && cfg.nExpert / cfg.nExpertGroups! > 16)) {
            // std::sort is an insertion sort up to 16 elements: stable, so equal to our rule
            expect.fail(`tie resolved differently with only ${cfg.nExpert} experts`);
          }
          ties++;
          continue;
        }
        const d = ulpDiff(got.weights[i]!, want[c]!.weights[i]!);
        s.max = Math.max(s.max, d);
        s.total++;
        if (d === 0) s.exact++;
      }
    });
    console.info(`route vs ggml (${ref.variant}): ${JSON.stringify(ulps)}; tie orders differing: ${ties}`);
    // sigmoid and sqrt_softplus use libm expf/logf elementwise: at most 1 ulp from JS's f64 exp/log
    // rounded to f32; softmax uses ggml's SIMD polynomial expf and f32 lane sums (observed up to 5)
    const bound: Record<GatingFunction, number> = {
      sigmoid: 1,
      sqrt_softplus: 1,
      softmax: 8,
      softmax_weight: 8,
    };
    for (const [g, s] of Object.entries(ulps))
      expect(s.max, g).toBeLessThanOrEqual(bound[g as GatingFunction]);
  });
});

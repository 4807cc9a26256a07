import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  combineEach,
  createReferenceWorker,
  dispatchExperts,
  dispatchExpertsDetailed,
  dispatchExpertsF64,
  type ExpertRequest,
  type Routing,
  referenceMoe,
} from "../src/index.js";
import {
  maxAbsDiff,
  randomHidden,
  randomRegistrations,
  randomRouting,
  sameBits,
  swarm,
  tinyModel,
} from "./helpers.js";

// Equivalence 1 of ARCHITECTURE.md section 4: sharding is an exact regrouping of one weighted
// sum, so sharded dispatch + combine equals the monolithic oracle for any placement.

const caseArb = fc.record({
  seed: fc.integer({ min: 1, max: 2 ** 31 - 1 }),
  nExpert: fc.integer({ min: 1, max: 12 }),
  kWant: fc.integer({ min: 1, max: 6 }),
  nEmbd: fc.integer({ min: 1, max: 12 }),
  nFf: fc.integer({ min: 1, max: 10 }),
  n: fc.integer({ min: 1, max: 9 }),
  workers: fc.integer({ min: 1, max: 8 }),
  replicas: fc.integer({ min: 1, max: 3 }),
  merged: fc.boolean(),
  extras: fc.boolean(),
  activation: fc.constantFrom<"silu" | "gelu" | "relu" | "swiglu_oai">("silu", "gelu", "relu", "swiglu_oai"),
  emptySlots: fc.boolean(),
  weightBeforeFfn: fc.boolean(),
});

/** ARCHITECTURE.md section 4, written out: p_j = fround(w_j * y_j); out = ((p_0 + p_1) + p_2) + ... in f32. */
function llamaCombine(y: Float32Array, routing: Routing, embd: number): Float32Array {
  const out = new Float32Array(routing.n * embd);
  for (let i = 0; i < routing.n; i++) {
    for (let c = 0; c < embd; c++) {
      let acc: number | undefined;
      for (let j = 0; j < routing.k; j++) {
        if (routing.ids[i * routing.k + j]! < 0) continue;
        const p = Math.fround(routing.weights[i * routing.k + j]! * y[(i * routing.k + j) * embd + c]!);
        acc = acc === undefined ? p : Math.fround(acc + p);
      }
      out[i * embd + c] = acc ?? 0;
    }
  }
  return out;
}

type Case = typeof caseArb extends fc.Arbitrary<infer T> ? T : never;

function setup(c: Case) {
  const k = Math.min(c.kWant, c.nExpert);
  const layer = c.seed % 3;
  const model = tinyModel(c.seed, {
    nExpert: c.nExpert,
    nEmbd: c.nEmbd,
    nFf: c.nFf,
    layers: 3,
    merged: c.merged,
    extras: c.extras,
  });
  const hidden = randomHidden(c.seed + 1, c.n, c.nEmbd);
  let routing: Routing = randomRouting(c.seed + 2, c.n, k, c.nExpert);
  if (c.emptySlots) {
    const ids = routing.ids.slice();
    for (let s = 0; s < ids.length; s += 3) ids[s] = -1;
    routing = { ...routing, ids };
  }
  if (c.weightBeforeFfn) routing = { ...routing, weightBeforeFfn: true };
  return { k, layer, model, hidden, routing };
}

describe("equivalence 1: sharded dispatch + combine == monolithic oracle", () => {
  it("f64 path: within 1e-12 for random models, batches and placements over 1..8 workers (each and sum)", async () => {
    let worst = 0;
    await fc.assert(
      fc.asyncProperty(caseArb, fc.constantFrom<"each" | "sum">("each", "sum"), async (c, mode) => {
        const { layer, model, hidden, routing } = setup(c);
        const activation = c.activation;
        const oracle = referenceMoe(hidden, routing, model, { layer, activation });
        const regs = randomRegistrations(c.seed + 3, c.workers, c.nExpert, [0, 1, 2], c.replicas);
        const { placement, transport } = swarm(regs, (r) =>
          createReferenceWorker(model, {
            activation,
            owns: (l, e) => r.layers.includes(l) && r.experts.includes(e),
          }),
        );
        const sharded = await dispatchExpertsF64(hidden, routing, { layer, placement, transport, mode });
        const diff = maxAbsDiff(sharded, oracle);
        worst = Math.max(worst, diff);
        expect(diff).toBeLessThanOrEqual(1e-12);
      }),
      { numRuns: 150 },
    );
    console.info(`equivalence 1 (f64): worst max abs diff ${worst.toExponential(2)} over 150 random cases`);
    expect(worst).toBeLessThanOrEqual(1e-12);
  });

  it("f32 path, mode each: bit-identical outputs whatever the placement, and equal to llama.cpp's combine order", async () => {
    await fc.assert(
      fc.asyncProperty(caseArb, fc.integer({ min: 1, max: 2 ** 31 - 1 }), async (c, seed2) => {
        const { layer, model, hidden, routing } = setup(c);
        const activation = c.activation;
        const run = async (seed: number, workers: number) => {
          const regs = randomRegistrations(seed, workers, c.nExpert, [0, 1, 2], c.replicas);
          const { placement, transport } = swarm(regs, () => createReferenceWorker(model, { activation }));
          return dispatchExperts(hidden, routing, { layer, placement, transport, mode: "each" });
        };
        const a = await run(c.seed + 3, c.workers);
        const b = await run(seed2, 1 + (seed2 % 8));
        expect(sameBits(a, b)).toBe(true);
        if (!routing.weightBeforeFfn) {
          // the same thing computed monolithically: every slot by one worker, then combineEach
          const whole = createReferenceWorker(model, { activation });
          const keep = new Int32Array(routing.ids);
          const res = await whole(
            {
              model: "tiny",
              layer,
              n: routing.n,
              embd: c.nEmbd,
              dtype: "f32",
              x: hidden,
              k: routing.k,
              ids: keep,
              mode: "each",
            },
            { signal: new AbortController().signal },
          );
          expect(sameBits(a, llamaCombine(res.y as Float32Array, routing, c.nEmbd))).toBe(true);
          expect(
            sameBits(a, combineEach(res.y as Float32Array, routing.weights, { ...routing, embd: c.nEmbd })),
          ).toBe(true);
        }
        // and close to the f64 oracle (f32 rounding only)
        const oracle = referenceMoe(hidden, routing, model, { layer, activation });
        const scale = Math.max(1, ...Array.from(oracle, Math.abs));
        expect(maxAbsDiff(a, oracle) / scale).toBeLessThan(1e-4);
      }),
      { numRuns: 100 },
    );
  });

  it("f32 path, mode auto: the bits of mode each, and a worker's sum exactly when it holds all of a token's slots", async () => {
    let sums = 0;
    let eaches = 0;
    await fc.assert(
      fc.asyncProperty(caseArb, async (c) => {
        const { layer, model, hidden, routing } = setup(c);
        const activation = c.activation;
        const regs = randomRegistrations(c.seed + 5, c.workers, c.nExpert, [0, 1, 2], c.replicas);
        const each = swarm(regs, () => createReferenceWorker(model, { activation }));
        const a = await dispatchExperts(hidden, routing, { layer, ...each, mode: "each" });
        const auto = swarm(regs, () => createReferenceWorker(model, { activation }));
        // what each worker was asked, checked against the routing the dispatcher sent
        const seen: ExpertRequest[] = [];
        const request = auto.transport.request.bind(auto.transport);
        auto.transport.request = (to, req, opts) => {
          seen.push({ ...req, ids: req.ids.slice() });
          return request(to, req, opts);
        };
        const b = await dispatchExpertsDetailed(hidden, routing, {
          layer,
          placement: auto.placement,
          transport: auto.transport,
          mode: "auto",
        });
        expect(sameBits(a, b.output)).toBe(true);
        expect(b.metrics.mode).toBe("auto");
        // the routing the workers see (llama4's is expanded: one slot per row)
        const r = routing.weightBeforeFfn
          ? { k: 1, ids: routing.ids.filter(() => true), n: routing.n * routing.k }
          : { k: routing.k, ids: routing.ids, n: routing.n };
        for (const req of seen) {
          const mine = new Set(Array.from(req.ids).filter((id) => id >= 0));
          const rows: number[] = [];
          for (let i = 0; i < r.n; i++) {
            for (let j = 0; j < r.k; j++)
              if (mine.has(r.ids[i * r.k + j]!)) {
                rows.push(i);
                break;
              }
          }
          expect(rows.length).toBe(req.n);
          // whether every filled slot of every row it got is its own
          const whole = rows.every((i) => {
            for (let j = 0; j < r.k; j++) {
              const id = r.ids[i * r.k + j]!;
              if (id >= 0 && !mine.has(id)) return false;
            }
            return true;
          });
          expect(req.mode).toBe(whole ? "sum" : "each");
          if (whole) sums++;
          else eaches++;
        }
        expect(b.metrics.sumRequests).toBe(seen.filter((q) => q.mode === "sum").length);
      }),
      { numRuns: 150 },
    );
    // both kinds of request occurred across the random placements
    expect(sums).toBeGreaterThan(0);
    expect(eaches).toBeGreaterThan(0);
  });

  it("mode auto: a layer on one worker comes back as one row per token, k times fewer bytes", async () => {
    const model = tinyModel(11, { nExpert: 8, nEmbd: 16, nFf: 5 });
    const hidden = randomHidden(4, 3, 16);
    const routing = randomRouting(5, 3, 4, 8);
    const regs = [
      { id: "l0", model: "tiny", layers: [0], experts: [0, 1, 2, 3, 4, 5, 6, 7] },
      { id: "l1", model: "tiny", layers: [1], experts: [0, 1, 2, 3, 4, 5, 6, 7] },
    ];
    const each = swarm(regs, () => createReferenceWorker(model));
    const auto = swarm(regs, () => createReferenceWorker(model));
    const e = await dispatchExpertsDetailed(hidden, routing, { layer: 0, ...each, mode: "each" });
    const a = await dispatchExpertsDetailed(hidden, routing, { layer: 0, ...auto, mode: "auto" });
    expect(sameBits(e.output, a.output)).toBe(true);
    expect(a.metrics).toMatchObject({ requests: 1, sumRequests: 1, bytesIn: 3 * 16 * 4 });
    expect(e.metrics).toMatchObject({ requests: 1, sumRequests: 0, bytesIn: 3 * 4 * 16 * 4 });
  });

  it("f32 path, mode sum: equal to mode each when every token's experts sit on one worker", async () => {
    const model = tinyModel(7, { nExpert: 6, nEmbd: 8, nFf: 5 });
    const hidden = randomHidden(8, 5, 8);
    const routing = randomRouting(9, 5, 3, 6);
    const { placement, transport } = swarm(
      [{ id: "solo", model: "tiny", layers: [0], experts: [0, 1, 2, 3, 4, 5] }],
      () => createReferenceWorker(model),
    );
    const each = await dispatchExperts(hidden, routing, { layer: 0, placement, transport, mode: "each" });
    const sum = await dispatchExperts(hidden, routing, { layer: 0, placement, transport, mode: "sum" });
    expect(sameBits(each, sum)).toBe(true);
  });
});

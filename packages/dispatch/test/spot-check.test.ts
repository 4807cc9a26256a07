import { InvalidArgumentError } from "@moeswarm/core";
import { expectNoUnhandledRejections } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";
import {
  createReferenceWorker,
  DispatchMetrics,
  dispatchExperts,
  dispatchExpertsDetailed,
  type ExpertHandler,
  type ExpertResult,
  type QuarantineEvent,
  REFERENCE_OWNER,
  referenceMoe,
  SpotCheck,
  type SpotCheckOptions,
} from "../src/index.js";
import {
  countedWorkers,
  lyingWith,
  maxAbsDiff,
  randomHidden,
  randomRegistrations,
  randomRouting,
  rng,
  sameBits,
  scaledLiar,
  swarm,
  tinyModel,
} from "./helpers.js";

// A spot check must end in the honest numbers (bit-identical to an all-honest run) whenever it
// catches a lie, never strike an honest worker, and draw its samples reproducibly from its seed.
expectNoUnhandledRejections(50);

const N_EXPERT = 6;
const EMBD = 8;
const model = tinyModel(21, { nExpert: N_EXPERT, nEmbd: EMBD, nFf: 5 });
const honest = createReferenceWorker(model);
const hidden = randomHidden(22, 5, EMBD);
const routing = randomRouting(23, 5, 3, N_EXPERT);
const ALL = [0, 1, 2, 3, 4, 5];

const scaled = scaledLiar(honest);
const zeros = lyingWith(honest, (_, y) => y.fill(0));
/** The first asked slot (or row) gets another expert's output: plausible values, wrong expert. */
const otherExpert: ExpertHandler = async (req, o) => {
  const s = req.ids.findIndex((id) => id >= 0);
  const ids = req.ids.slice();
  ids[s] = (ids[s]! + 1) % N_EXPERT;
  if (ids.some((id, j) => j !== s && id === ids[s] && Math.floor(j / req.k) === Math.floor(s / req.k))) {
    ids[s] = (ids[s]! + 1) % N_EXPERT;
  }
  return honest({ ...req, ids }, o) as Promise<ExpertResult>;
};
const LIES: [string, ExpertHandler][] = [
  ["scales its outputs by 1.05", scaled],
  ["returns zeros", zeros],
  ["answers one slot with another expert", otherExpert],
];

/** Workers as computes, each request counted. */
const counted = (workers: [string, number[], ExpertHandler][]) => countedWorkers(workers);

async function allHonest(mode: "each" | "sum"): Promise<Float32Array> {
  const { placement, transport } = counted([["solo", ALL, honest]]);
  return dispatchExperts(hidden, routing, { layer: 0, placement, transport, mode });
}

function closeToOracle(out: Float32Array): void {
  const oracle = referenceMoe(hidden, routing, model, { layer: 0 });
  const scale = Math.max(1, ...Array.from(oracle, Math.abs));
  expect(maxAbsDiff(out, oracle) / scale).toBeLessThan(1e-4);
}

describe("SpotCheck with a local reference", () => {
  for (const [what, liar] of LIES) {
    it(`a worker that ${what}: honest output, quarantined, then sent nothing`, async () => {
      for (const mode of ["each", "sum"] as const) {
        const want = await allHonest(mode);
        const events: QuarantineEvent[] = [];
        const verify = new SpotCheck({
          fraction: 1,
          reference: createReferenceWorker(model),
          seed: 1,
          onQuarantine: (e) => events.push(e),
        });
        // the liar is registered first: the first call's rotation picks it for every expert
        const s = counted([
          ["liar", ALL, liar],
          ["good", ALL, honest],
        ]);
        const metrics = new DispatchMetrics();
        const options = { layer: 0, placement: s.placement, transport: s.transport, mode, verify, metrics };
        const first = await dispatchExpertsDetailed(hidden, routing, options);
        expect(s.calls).toEqual({ liar: 1, good: 0 });
        expect(sameBits(first.output, want)).toBe(true);
        closeToOracle(first.output);
        expect(first.metrics).toMatchObject({ spotChecks: 1, spotDisagreements: 1, spotUnverifiable: 0 });
        expect(first.metrics.owners.liar!.failures).toBe(1);
        expect(first.metrics.owners[REFERENCE_OWNER]!.requests).toBe(1);
        expect(verify.quarantined()).toEqual(["liar"]);
        expect(events).toHaveLength(1);
        expect(events[0]).toMatchObject({ worker: "liar", layer: 0 });
        expect(events[0]!.experts).toEqual([...new Set(routing.ids)].sort((a, b) => a - b));
        expect(events[0]!.reason).toMatch(/reference disagrees/);
        // a scaled answer points the right way: only the norm gives it away
        if (liar === scaled) expect(events[0]!.cosine).toBeGreaterThan(0.99999);
        else expect(events[0]!.cosine).toBeLessThan(0.99);

        // the rotation would now alternate between the two: the liar gets nothing
        for (let i = 0; i < 4; i++) {
          const next = await dispatchExperts(hidden, routing, options);
          expect(sameBits(next, want)).toBe(true);
        }
        expect(s.calls).toEqual({ liar: 1, good: 4 });
        expect(verify.snapshot()).toMatchObject({
          sampled: 5,
          checks: 5,
          agreements: 4,
          disagreements: 1,
          unverifiable: 0,
          quarantines: 1,
          quarantined: ["liar"],
          strikes: { liar: 1 },
        });
        expect(metrics.snapshot()).toMatchObject({
          spotChecks: 5,
          spotDisagreements: 1,
          spotUnverifiable: 0,
        });
      }
    });
  }

  it("a quarantined sole owner: its experts go to the fallback, or fail with MOESWARM_DISPATCH_NO_OWNER", async () => {
    const want = await allHonest("each");
    const verify = new SpotCheck({ fraction: 1, reference: createReferenceWorker(model), seed: 2 });
    const s = counted([["liar", ALL, zeros]]);
    const base = { layer: 0, placement: s.placement, transport: s.transport, verify };
    expect(sameBits(await dispatchExperts(hidden, routing, base), want)).toBe(true);
    const r = await dispatchExpertsDetailed(hidden, routing, { ...base, fallback: honest });
    expect(sameBits(r.output, want)).toBe(true);
    expect(r.metrics.fallbacks).toBe(1);
    await expect(dispatchExperts(hidden, routing, base)).rejects.toMatchObject({
      code: "MOESWARM_DISPATCH_NO_OWNER",
      message: expect.stringContaining("quarantined: liar"),
    });
    expect(s.calls.liar).toBe(1);
    // released: it is chosen again
    expect(verify.release("liar")).toBe(true);
    expect(verify.snapshot().strikes).toEqual({});
    await dispatchExperts(hidden, routing, base);
    expect(s.calls.liar).toBe(2);
  });

  it("a liar quarantined by one call's check: its unchecked answer to a concurrent call is served again", async () => {
    // a seed whose first draw at fraction 0.5 checks and whose second does not (same PRNG as rng)
    let seed = 0;
    for (; ; seed++) {
      const r = rng(seed);
      if (r() < 0.5 && r() >= 0.5) break;
    }
    const verify = new SpotCheck({ fraction: 0.5, reference: createReferenceWorker(model), seed });
    let slowNext = false;
    const liar: ExpertHandler = async (req, o) => {
      // the second call's answer arrives after the first call's check is done
      if (slowNext) await new Promise((r) => setTimeout(r, 30));
      slowNext = true;
      return zeros(req, o);
    };
    const s = counted([
      ["liar", ALL, liar],
      ["good", [0, 1, 2], honest],
    ]);
    const want = await allHonest("each");
    const options = { layer: 0, placement: s.placement, transport: s.transport, verify, fallback: honest };
    // the second call's rotation would prefer "good" for 0..2: ask only for experts 3..5
    const high = randomRouting(24, 5, 3, 3);
    high.ids.forEach((e, i) => {
      high.ids[i] = e + 3;
    });
    const a = dispatchExpertsDetailed(hidden, routing, options);
    const b = dispatchExpertsDetailed(hidden, high, options);
    const [ra, rb] = await Promise.all([a, b]);
    expect(sameBits(ra.output, want)).toBe(true);
    expect(ra.metrics.spotDisagreements).toBe(1);
    expect(rb.metrics.spotChecks).toBe(0);
    expect(rb.metrics.owners.liar!.requests).toBe(1);
    // liar's zeros were dropped: 3..5 have no other owner, so the fallback served them
    expect(rb.metrics.fallbacks).toBe(1);
    const wantHigh = await (async () => {
      const h = counted([["solo", ALL, honest]]);
      return dispatchExperts(hidden, high, { layer: 0, placement: h.placement, transport: h.transport });
    })();
    expect(sameBits(rb.output, wantHigh)).toBe(true);
  });
});

describe("SpotCheck with replicas", () => {
  it("no reference: the liar is caught by another owner of all its experts, whose output is used", async () => {
    for (const mode of ["each", "sum"] as const) {
      const want = await allHonest(mode);
      const verify = new SpotCheck({ fraction: 1, seed: 3 });
      const s = counted([
        ["liar", ALL, otherExpert],
        ["good", ALL, honest],
      ]);
      const r = await dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: s.placement,
        transport: s.transport,
        mode,
        verify,
      });
      expect(sameBits(r.output, want)).toBe(true);
      expect(s.calls).toEqual({ liar: 1, good: 1 });
      expect(r.metrics.owners.good!.requests).toBe(1);
      expect(verify.quarantined()).toEqual(["liar"]);
      expect(verify.snapshot()).toMatchObject({ checks: 1, disagreements: 1 });
      // next calls: only "good"; its answers are sampled but nobody else owns its experts
      await dispatchExperts(hidden, routing, {
        layer: 0,
        placement: s.placement,
        transport: s.transport,
        verify,
      });
      expect(s.calls).toEqual({ liar: 1, good: 2 });
      expect(verify.snapshot()).toMatchObject({ sampled: 2, checks: 1, unverifiable: 1 });
    }
  });

  it("a replica must own every expert of the part; without one the sample is unverifiable", async () => {
    const verify = new SpotCheck({ fraction: 1, seed: 4 });
    // "half" owns only some experts of liar's part: it cannot re-compute the part
    const s = counted([
      ["liar", ALL, scaled],
      ["half", [0, 1, 2], honest],
    ]);
    // the first call's rotation gives "liar" all experts (0..2 too): one part spanning both halves
    expect(new Set(routing.ids).size).toBe(N_EXPERT);
    const r = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      verify,
    });
    expect(s.calls).toEqual({ liar: 1, half: 0 });
    expect(r.metrics).toMatchObject({ spotChecks: 0, spotUnverifiable: 1 });
    expect(verify.quarantined()).toEqual([]);
    expect(verify.snapshot().disagreements).toBe(0);
  });

  it("a sole owner with no reference: unverifiable, counted, never an error", async () => {
    const verify = new SpotCheck({ fraction: 1, seed: 5 });
    const s = counted([
      ["a", [0, 1, 2], scaled],
      ["b", [3, 4, 5], honest],
    ]);
    const r = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      verify,
    });
    const parts = Object.keys(r.metrics.owners).length;
    expect(r.metrics).toMatchObject({ spotChecks: 0, spotDisagreements: 0, spotUnverifiable: parts });
    expect(verify.snapshot()).toMatchObject({
      sampled: parts,
      unverifiable: parts,
      checks: 0,
      quarantined: [],
    });
  });

  it("a replica that fails: the sample is unverifiable and the worker's answer stands", async () => {
    const verify = new SpotCheck({ fraction: 1, seed: 6 });
    const broken: ExpertHandler = () => {
      throw new Error("down");
    };
    const s = counted([
      ["a", ALL, honest],
      ["b", ALL, broken],
    ]);
    const want = await allHonest("each");
    const r = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      verify,
    });
    expect(sameBits(r.output, want)).toBe(true);
    expect(r.metrics.spotUnverifiable).toBe(1);
    expect(verify.quarantined()).toEqual([]);
  });
});

describe("SpotCheck never strikes honest workers", () => {
  it("fraction 1 over random models, batches, placements and both modes: no disagreement, same bits", async () => {
    let checks = 0;
    for (let seed = 0; seed < 40; seed++) {
      const rand = rng(1000 + seed);
      const nExpert = 2 + Math.floor(rand() * 8);
      const nEmbd = 1 + Math.floor(rand() * 16);
      const k = 1 + Math.floor(rand() * Math.min(nExpert, 4));
      const n = 1 + Math.floor(rand() * 12);
      const mode = rand() < 0.5 ? "each" : "sum";
      const m = tinyModel(seed, { nExpert, nEmbd, nFf: 1 + Math.floor(rand() * 8), merged: rand() < 0.3 });
      const x = randomHidden(seed + 1, n, nEmbd);
      const rt = randomRouting(seed + 2, n, k, nExpert);
      const regs = randomRegistrations(seed + 3, 1 + Math.floor(rand() * 5), nExpert, [0], 3);
      // two swarms in lockstep: "sum" depends on the placement's rotation, which advances per call
      const plainSwarm = swarm(regs, () => createReferenceWorker(m));
      const { placement, transport } = swarm(regs, () => createReferenceWorker(m));
      const withReference = rand() < 0.5;
      const verify = new SpotCheck({
        fraction: 1,
        seed,
        minCosine: 0.999999,
        normTolerance: 1e-6,
        ...(withReference ? { reference: createReferenceWorker(m) } : {}),
      });
      for (let call = 0; call < 3; call++) {
        const plain = await dispatchExperts(x, rt, { layer: 0, ...plainSwarm, mode });
        const out = await dispatchExperts(x, rt, { layer: 0, placement, transport, mode, verify });
        expect(sameBits(out, plain)).toBe(true);
      }
      const snap = verify.snapshot();
      expect(snap.disagreements).toBe(0);
      expect(snap.quarantined).toEqual([]);
      expect(snap.checks + snap.unverifiable).toBe(snap.sampled);
      if (withReference) expect(snap.unverifiable).toBe(0);
      checks += snap.checks;
    }
    // the replica path had something to compare in most cases
    expect(checks).toBeGreaterThan(100);
  });
});

describe("sampling", () => {
  const run = async (seed: number, calls: number) => {
    const verify = new SpotCheck({ fraction: 0.25, seed, reference: honest });
    const { placement, transport } = counted([["solo", ALL, honest]]);
    for (let i = 0; i < calls; i++) {
      await dispatchExperts(hidden, routing, { layer: 0, placement, transport, verify });
    }
    return verify.snapshot();
  };

  it("fraction 0.25 with a fixed seed: the same checks every run, within the binomial range", async () => {
    const N = 200;
    const a = await run(42, N);
    const b = await run(42, N);
    expect(a.checks).toBe(b.checks);
    expect(a.checks).toBe(a.sampled);
    // mulberry32 seeded with 42, as the test helpers' rng: 200 draws below 0.25
    const r = rng(42);
    let expected = 0;
    for (let i = 0; i < N; i++) if (r() < 0.25) expected++;
    expect(a.checks).toBe(expected);
    expect(a.checks).toBe(51);
    expect(a.checks).toBeGreaterThanOrEqual(0.1 * N);
    expect(a.checks).toBeLessThanOrEqual(0.4 * N);
  });

  it("fraction 0 checks nothing; fraction 1 checks every part", async () => {
    const none = new SpotCheck({ fraction: 0, reference: honest });
    const solo = counted([["solo", ALL, honest]]);
    for (let i = 0; i < 10; i++) {
      await dispatchExperts(hidden, routing, { layer: 0, ...solo, verify: none });
    }
    expect(none.snapshot()).toMatchObject({ sampled: 0, checks: 0 });
    const all = new SpotCheck({ fraction: 1, reference: honest });
    const { placement, transport } = counted([
      ["a", [0, 1, 2], honest],
      ["b", [3, 4, 5], honest],
    ]);
    const r = await dispatchExpertsDetailed(hidden, routing, { layer: 0, placement, transport, verify: all });
    expect(r.metrics.spotChecks).toBe(Object.keys(r.metrics.owners).length - 1);
  });
});

describe("strikes and quarantine expiry", () => {
  it("strikes 2: one disagreement is a strike, the second quarantines", async () => {
    const events: QuarantineEvent[] = [];
    const verify = new SpotCheck({
      fraction: 1,
      reference: honest,
      strikes: 2,
      seed: 8,
      onQuarantine: (e) => events.push(e),
    });
    const s = counted([["liar", ALL, scaled]]);
    const want = await allHonest("each");
    const options = { layer: 0, placement: s.placement, transport: s.transport, verify, fallback: honest };
    expect(sameBits(await dispatchExperts(hidden, routing, options), want)).toBe(true);
    expect(verify.quarantined()).toEqual([]);
    expect(verify.snapshot().strikes).toEqual({ liar: 1 });
    expect(events).toEqual([]);
    expect(sameBits(await dispatchExperts(hidden, routing, options), want)).toBe(true);
    expect(verify.quarantined()).toEqual(["liar"]);
    expect(events.map((e) => e.worker)).toEqual(["liar"]);
    await dispatchExperts(hidden, routing, options);
    expect(s.calls.liar).toBe(2);
  });

  it("quarantineMs: after expiry the worker is chosen again, with its strikes cleared", async () => {
    const verify = new SpotCheck({ fraction: 1, reference: honest, quarantineMs: 20, seed: 9 });
    const s = counted([["liar", ALL, zeros]]);
    const options = { layer: 0, placement: s.placement, transport: s.transport, verify, fallback: honest };
    await dispatchExperts(hidden, routing, options);
    expect(verify.quarantined()).toEqual(["liar"]);
    await dispatchExperts(hidden, routing, options);
    expect(s.calls.liar).toBe(1);
    await new Promise((r) => setTimeout(r, 40));
    expect(verify.quarantined()).toEqual([]);
    expect(verify.snapshot().strikes).toEqual({});
    await dispatchExperts(hidden, routing, options);
    expect(s.calls.liar).toBe(2);
    // and caught again
    expect(verify.quarantined()).toEqual(["liar"]);
    expect(verify.snapshot().quarantines).toBe(2);
  });

  it("an onQuarantine that throws does not fail the call", async () => {
    const verify = new SpotCheck({
      fraction: 1,
      reference: honest,
      onQuarantine: () => {
        throw new Error("logger down");
      },
    });
    const s = counted([["liar", ALL, zeros]]);
    const out = await dispatchExperts(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      verify,
    });
    expect(sameBits(out, await allHonest("each"))).toBe(true);
    expect(verify.quarantined()).toEqual(["liar"]);
  });
});

describe("options", () => {
  const bad: [string, Partial<SpotCheckOptions> | null][] = [
    ["fraction 1.5", { fraction: 1.5 }],
    ["fraction NaN", { fraction: Number.NaN }],
    ["fraction -0.1", { fraction: -0.1 }],
    ["no fraction", {}],
    ["minCosine > 1", { fraction: 0.5, minCosine: 1.01 }],
    ["minCosine 0", { fraction: 0.5, minCosine: 0 }],
    ["minCosine NaN", { fraction: 0.5, minCosine: Number.NaN }],
    ["normTolerance -1", { fraction: 0.5, normTolerance: -1 }],
    ["strikes 0", { fraction: 0.5, strikes: 0 }],
    ["strikes 1.5", { fraction: 0.5, strikes: 1.5 }],
    ["seed -1", { fraction: 0.5, seed: -1 }],
    ["seed 2^32", { fraction: 0.5, seed: 2 ** 32 }],
    ["quarantineMs 0", { fraction: 0.5, quarantineMs: 0 }],
    ["quarantineMs Infinity", { fraction: 0.5, quarantineMs: Number.POSITIVE_INFINITY }],
    ["reference not a function", { fraction: 0.5, reference: {} as ExpertHandler }],
    ["onQuarantine not a function", { fraction: 0.5, onQuarantine: 1 as unknown as () => void }],
    ["null", null],
  ];
  for (const [what, o] of bad) {
    it(`${what}: InvalidArgumentError MOESWARM_INVALID_ARGUMENT`, () => {
      let error: unknown;
      try {
        new SpotCheck(o as SpotCheckOptions);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(InvalidArgumentError);
      expect(error).toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    });
  }

  it("defaults, and dispatchExperts refuses a verify that is not a SpotCheck", async () => {
    const v = new SpotCheck({ fraction: 0 });
    expect(v).toMatchObject({ minCosine: 0.99, normTolerance: 0.02, strikes: 1, quarantineMs: undefined });
    const { placement, transport } = counted([["solo", ALL, honest]]);
    await expect(
      dispatchExperts(hidden, routing, {
        layer: 0,
        placement,
        transport,
        verify: { fraction: 1 } as unknown as SpotCheck,
      }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
  });
});

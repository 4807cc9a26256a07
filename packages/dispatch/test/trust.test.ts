import { isMoeswarmError } from "@moeswarm/core";
import { expectNoUnhandledRejections } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";
import {
  createReferenceWorker,
  DispatchMetrics,
  dispatchExperts,
  dispatchExpertsDetailed,
  type ExpertHandler,
  type ExpertRequest,
  type ExpertResult,
  emptyVerificationStats,
  InProcessTransport,
  Placement,
  SpotCheck,
  Verification,
  type VerificationEvent,
  type WorkerRegistration,
} from "../src/index.js";
import {
  countedWorkers,
  lyingWith,
  randomHidden,
  randomRegistrations,
  randomRouting,
  rng,
  sameBits,
  scaledLiar,
  tinyModel,
} from "./helpers.js";

// Trust "verify" (issue 14): with the defaults on an untrusted transport no wrong output is ever
// combined when at least one of a part's two owners is honest and a third opinion exists; a liar is
// quarantined at its first lie with evidence; with two honest replicas the output is the same bits
// as one owner's. Figures are printed (requests until detection, verification cost).
expectNoUnhandledRejections(50);

const N_EXPERT = 6;
const EMBD = 8;
const N = 5;
const K = 3;
const model = tinyModel(31, { nExpert: N_EXPERT, nEmbd: EMBD, nFf: 5 });
const honest = createReferenceWorker(model);
const ALL = [0, 1, 2, 3, 4, 5];

/** Workers as in-process computes behind a transport that does NOT say it is trusted (as the relay). */
const strangers = (workers: [string, number[], ExpertHandler, owner?: string][]) =>
  countedWorkers(workers, { trusted: false });
const lying = (lie: (req: ExpertRequest, y: Float32Array) => void) => lyingWith(honest, lie);
const scaled = scaledLiar(honest);
/** Every asked slot answered by the next expert's weights: plausible values, wrong expert. */
const swapped: ExpertHandler = (req, o) => {
  const ids = req.ids.map((id) => (id < 0 ? id : (id + 1) % N_EXPERT));
  return honest({ ...req, ids }, o) as Promise<ExpertResult>;
};
/** Answers with the output of the first request it saw (same shape), honestly only the first time. */
function replaying(): ExpertHandler {
  let first: ExpertResult | undefined;
  return async (req, o) => {
    const r = (await honest(req, o)) as ExpertResult;
    if (first && first.y.length === r.y.length) return { ...r, y: first.y.slice() };
    first = { ...r, y: r.y.slice() };
    return r;
  };
}
/** Honest for `n` requests, then scales. */
function honestThen(n: number, lie: ExpertHandler): ExpertHandler {
  let seen = 0;
  return (req, o) => (++seen > n ? lie(req, o) : honest(req, o));
}

/** The honest output: one trusted owner of everything. */
async function truth(
  hidden: Float32Array,
  routing: ReturnType<typeof randomRouting>,
  mode: "each" | "sum" | "auto",
) {
  const placement = Placement.fromRegistrations([{ id: "h", model: "tiny", layers: [0], experts: ALL }]);
  return dispatchExperts(hidden, routing, {
    layer: 0,
    placement,
    transport: new InProcessTransport({ h: honest }),
    mode,
  });
}

describe("trust defaults", () => {
  const hidden = randomHidden(1, N, EMBD);
  const routing = randomRouting(2, N, K, N_EXPERT);

  it("an untrusted transport is verified by default; a part with one owner fails with what to do", async () => {
    const s = strangers([["w", ALL, honest]]);
    const e = await dispatchExperts(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
    }).catch((x: unknown) => x);
    expect(isMoeswarmError(e, "MOESWARM_VERIFY_UNAVAILABLE")).toBe(true);
    expect(String((e as Error).message)).toMatch(/--replicas 2/);
    expect(String((e as Error).message)).toMatch(/trust "own"/);
    // trust "own": as before
    const own = await dispatchExperts(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      trust: "own",
    });
    expect(sameBits(own, await truth(hidden, routing, "each"))).toBe(true);
  });

  it("a part with one owner and a local fallback is served locally (unverifiable-local)", async () => {
    const s = strangers([["w", ALL, scaled]]);
    const verification = new Verification();
    const r = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      fallback: honest,
      verification,
    });
    expect(sameBits(r.output, await truth(hidden, routing, "each"))).toBe(true);
    expect(s.calls.w).toBe(0);
    expect(verification.stats()).toMatchObject({ unverifiableLocal: 1, partsVerified: 0 });
    // computed locally in the worker's place: a fallback, not an audit
    expect(r.metrics).toMatchObject({ fallbacks: 1, audits: 0 });
  });

  it("a new Verification's stats are emptyVerificationStats(), its counters its own", async () => {
    const verification = new Verification();
    expect(verification.stats()).toEqual(emptyVerificationStats());
    // a fresh object each call: one a caller fills in leaves the next at zero
    const filled = emptyVerificationStats();
    filled.partsVerified = 3;
    filled.quarantined.push("w");
    expect(emptyVerificationStats()).toMatchObject({ partsVerified: 0, quarantined: [] });
    const s = strangers([["w", ALL, scaled]]);
    await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      fallback: honest,
      verification,
    });
    expect(verification.stats()).toEqual({ ...emptyVerificationStats(), unverifiableLocal: 1 });
    // another Verification does not share the counters
    expect(new Verification().stats()).toEqual(emptyVerificationStats());
  });

  it("trusted transports (in-process, threads) keep trust own; the relay's says false", async () => {
    expect(new InProcessTransport().trusted).toBe(true);
    const placement = Placement.fromRegistrations([{ id: "w", model: "tiny", layers: [0], experts: ALL }]);
    const r = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement,
      transport: new InProcessTransport({ w: honest }),
    });
    expect(r.metrics.verifiedParts).toBe(0);
    await expect(
      dispatchExperts(hidden, routing, {
        layer: 0,
        placement,
        transport: new InProcessTransport({ w: honest }),
        trust: "verify",
      }),
    ).rejects.toMatchObject({ code: "MOESWARM_VERIFY_UNAVAILABLE" });
  });

  it("rejects a bad trust, verification or liveness", async () => {
    const placement = Placement.fromRegistrations([{ id: "w", model: "tiny", layers: [0], experts: ALL }]);
    const transport = new InProcessTransport({ w: honest });
    for (const bad of [{ trust: "maybe" }, { verification: {} }, { liveness: {} }]) {
      await expect(
        dispatchExperts(hidden, routing, { layer: 0, placement, transport, ...(bad as object) }),
      ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    }
    for (const bad of [{ probation: -1 }, { probation: 1.5 }, { auditRate: 2 }, { seed: -1 }]) {
      expect(() => new Verification(bad)).toThrow(/probation|auditRate|seed/);
    }
    expect(() =>
      Placement.fromRegistrations([{ id: "w", model: "t", layers: [0], experts: [0], owner: "" }]),
    ).toThrow(/owner/);
  });
});

describe("two honest replicas: the same bits as one owner", () => {
  it("every mode, random models, batches and placements (each registration twice)", async () => {
    for (let seed = 1; seed <= 24; seed++) {
      const rand = rng(seed);
      const n = 1 + Math.floor(rand() * 6);
      const hidden = randomHidden(seed, n, EMBD);
      const routing = randomRouting(seed + 100, n, K, N_EXPERT);
      const regs = randomRegistrations(seed, 1 + Math.floor(rand() * 4), N_EXPERT, [0], 1);
      const twice: WorkerRegistration[] = [...regs, ...regs.map((r) => ({ ...r, id: `${r.id}'` }))];
      for (const mode of ["each", "sum", "auto"] as const) {
        const single = Placement.fromRegistrations(regs);
        const own = await dispatchExperts(hidden, routing, {
          layer: 0,
          placement: single,
          transport: new InProcessTransport(regs.map((r) => [r.id, honest] as const)),
          mode,
        });
        const verification = new Verification();
        const r = await dispatchExpertsDetailed(hidden, routing, {
          layer: 0,
          placement: Placement.fromRegistrations(twice),
          transport: new InProcessTransport(twice.map((r) => [r.id, honest] as const)),
          mode,
          trust: "verify",
          verification,
        });
        expect(sameBits(r.output, own), `seed ${seed} mode ${mode}`).toBe(true);
        expect(verification.stats()).toMatchObject({ disagreements: 0, quarantines: 0, failed: 0 });
        expect(r.metrics.verifiedParts).toBeGreaterThan(0);
      }
    }
  });

  it("modes each and auto over random placements with 2-3 owners per expert", async () => {
    for (let seed = 1; seed <= 24; seed++) {
      const hidden = randomHidden(seed, 4, EMBD);
      const routing = randomRouting(seed + 7, 4, K, N_EXPERT);
      // every expert on at least 2 of 5 workers
      const regs = randomRegistrations(seed, 5, N_EXPERT, [0], 3).map((r) => r);
      const cover = Placement.fromRegistrations(regs);
      const extra: WorkerRegistration[] = [];
      for (let e = 0; e < N_EXPERT; e++) {
        if (cover.owners(0, e).length < 2)
          extra.push({ id: `x${e}`, model: "tiny", layers: [0], experts: [e] });
      }
      const all = [...regs, ...extra];
      for (const mode of ["each", "auto"] as const) {
        const want = await truth(hidden, routing, mode);
        const r = await dispatchExpertsDetailed(hidden, routing, {
          layer: 0,
          placement: Placement.fromRegistrations(all),
          transport: new InProcessTransport(all.map((r) => [r.id, honest] as const)),
          mode,
          trust: "verify",
        });
        expect(sameBits(r.output, want), `seed ${seed} mode ${mode}`).toBe(true);
      }
    }
  });
});

type Liar = [name: string, make: () => ExpertHandler];
const LIARS: Liar[] = [
  ["scaling liar (x1.05)", () => scaled],
  ["expert-swapping liar", () => swapped],
  ["replaying liar", replaying],
  ["liar honest for 7 requests, then scaling", () => honestThen(7, scaled)],
];

/** `calls` dispatch calls on fresh inputs; counts wrong outputs against the honest truth. */
async function decode(
  s: ReturnType<typeof strangers>,
  calls: number,
  extra: { fallback?: ExpertHandler; verify?: SpotCheck; verification: Verification },
) {
  let wrong = 0;
  let failed = 0;
  let detectedAt: number | undefined;
  const metrics = new DispatchMetrics();
  for (let c = 0; c < calls; c++) {
    const hidden = randomHidden(1000 + c, N, EMBD);
    const routing = randomRouting(2000 + c, N, K, N_EXPERT);
    try {
      const out = await dispatchExperts(hidden, routing, {
        layer: 0,
        placement: s.placement,
        transport: s.transport,
        metrics,
        ...extra,
      });
      if (!sameBits(out, await truth(hidden, routing, "each"))) wrong++;
    } catch (e) {
      if (!isMoeswarmError(e)) throw e;
      failed++;
    }
    if (detectedAt === undefined && extra.verification.stats().quarantines > 0) detectedAt = c + 1;
  }
  return { wrong, failed, detectedAt, metrics: metrics.snapshot() };
}

describe("liars under the defaults", () => {
  for (const [name, make] of LIARS) {
    for (const third of ["local fallback", "third owner"] as const) {
      it(`${name}, third opinion: ${third}: zero wrong outputs, quarantined at the first lie`, async () => {
        const events: VerificationEvent[] = [];
        const verification = new Verification({ onQuarantine: (e) => events.push(e) });
        const workers: [string, number[], ExpertHandler][] = [
          ["honest", ALL, honest],
          ["liar", ALL, make()],
        ];
        if (third === "third owner") workers.push(["honest2", ALL, honest]);
        const s = strangers(workers);
        const r = await decode(s, 20, {
          verification,
          ...(third === "local fallback" ? { fallback: honest } : {}),
        });
        expect(r.wrong).toBe(0);
        expect(r.failed).toBe(0);
        expect(verification.quarantined()).toEqual(["liar"]);
        expect(events).toHaveLength(1);
        const ev = events[0]!;
        expect(ev).toMatchObject({ worker: "liar", layer: 0 });
        expect(ev.requestDigest).toMatch(/^[0-9a-f]{64}$/);
        expect(ev.expected.norm).toBeGreaterThan(0);
        expect(Number.isFinite(ev.got.cosine)).toBe(true);
        const st = verification.stats();
        // its first lie is its request number `lies`; quarantined at once: no request after it
        const lies = name.startsWith("liar honest") ? 8 : name.startsWith("replaying") ? 2 : 1;
        expect(r.detectedAt).toBeDefined();
        expect(s.calls.liar).toBe(lies);
        console.log(
          `[trust] ${name} (${third}): detected at the liar's request ${lies} (call ${r.detectedAt}), wrong outputs 0/20, ` +
            `parts verified ${st.partsVerified}, disagreements ${st.disagreements}, third opinions ${st.thirdOpinions}, ` +
            `extra bytes ${st.extraBytes} (of ${r.metrics.bytesOut + r.metrics.bytesIn} moved)`,
        );
      });
    }
  }

  it("a disagreement with no third opinion fails with MOESWARM_VERIFY_FAILED, never a guess", async () => {
    const s = strangers([
      ["honest", ALL, honest],
      ["liar", ALL, scaled],
    ]);
    const verification = new Verification();
    const r = await decode(s, 5, { verification });
    expect(r.wrong).toBe(0);
    expect(r.failed).toBe(5);
    expect(r.metrics.errors).toMatchObject({ MOESWARM_VERIFY_FAILED: 5 });
    expect(verification.stats()).toMatchObject({ disagreements: 5, quarantines: 0, failed: 5 });
  });

  it("owners of different compute classes are compared with the tolerance, not bit for bit", async () => {
    const jitter = lying((_, y) => {
      for (let i = 0; i < y.length; i++) y[i] = Math.fround(y[i]! * (1 + 1e-6 * ((i % 3) - 1)));
    });
    const run = async (computeClass?: (w: string) => string) => {
      const s = strangers([
        ["cpu", ALL, honest],
        ["gpu", ALL, jitter],
      ]);
      const verification = new Verification(computeClass ? { computeClass } : {});
      const r = await decode(s, 4, { verification });
      return { r, st: verification.stats() };
    };
    const same = await run();
    expect(same.st.disagreements).toBe(4);
    const diff = await run((w) => (w === "cpu" ? "cpu/x86_64" : "cuda/sm90"));
    expect(diff.st).toMatchObject({ disagreements: 0, partsVerified: 4 });
    // classes unknown but a local third opinion: the pair differs in bits, both are within the
    // tolerance of the reference, so nobody is convicted for numerics
    const s = strangers([
      ["cpu", ALL, honest],
      ["gpu", ALL, jitter],
    ]);
    const verification = new Verification();
    await decode(s, 4, { verification, fallback: honest });
    expect(verification.stats()).toMatchObject({
      disagreements: 4,
      thirdOpinions: 4,
      quarantines: 0,
      failed: 0,
    });
  });

  const colluders = (a: ExpertHandler = scaled, b: ExpertHandler = a) =>
    strangers([
      ["liarA", ALL, a],
      ["liarB", ALL, b],
    ]);

  it("two colluders without an audit: redundancy cannot see them; a SpotCheck convicts both twins", async () => {
    // what redundancy alone promises, honestly: two owners that return the same wrong answer agree
    const noAudit = () => new Verification({ probation: 0, auditRate: 0 });
    const blind = await decode(colluders(), 20, { verification: noAudit(), fallback: honest });
    expect(blind.wrong).toBe(20);
    // a SpotCheck with the local reference on top: caught at the first sampled part, and the
    // twin that returned the same bits for that request is convicted with it
    const verify = new SpotCheck({ fraction: 0.25, reference: honest, seed: 7 });
    const checked = await decode(colluders(), 20, { verification: noAudit(), fallback: honest, verify });
    const snap = verify.snapshot();
    expect(snap.quarantined.sort()).toEqual(["liarA", "liarB"]);
    expect(snap.disagreements).toBe(2);
    expect(snap.quarantines).toBe(2);
    expect(checked.wrong).toBeLessThan(20);
    console.log(
      `[trust] two colluding liars: redundancy alone 20/20 wrong; with SpotCheck 0.25 + reference ` +
        `${checked.wrong}/20 wrong (all before the first sampled part), both twins quarantined`,
    );
  });

  it("two colluders lying from the start, defaults (probation): zero wrong outputs, both convicted at the first answer", async () => {
    const events: VerificationEvent[] = [];
    const verification = new Verification({ onQuarantine: (e) => events.push(e) });
    const s = colluders();
    const r = await decode(s, 20, { verification, fallback: honest });
    expect(r.wrong).toBe(0);
    expect(r.failed).toBe(0);
    expect(r.detectedAt).toBe(1);
    expect(verification.quarantined().sort()).toEqual(["liarA", "liarB"]);
    expect(events.map((e) => e.worker).sort()).toEqual(["liarA", "liarB"]);
    // the same request, the same evidence
    expect(events[0]!.requestDigest).toBe(events[1]!.requestDigest);
    expect(events[0]!.decidedBy).toBe("the reference");
    expect(s.calls).toEqual({ liarA: 1, liarB: 1 });
    const st = verification.stats();
    expect(st).toMatchObject({ audits: 1, auditDisagreements: 1 });
    // afterwards: both quarantined, the experts have no owner and the local fallback serves them
    // (the liars were asked once each, above): the metrics count the audit apart from those
    expect(r.metrics).toMatchObject({ audits: 1, fallbacks: 19, failovers: 0 });
  });

  it("honest pairs: probation audits each worker's first answers, then the sampled rate", async () => {
    const s = strangers([
      ["a", ALL, honest],
      ["b", ALL, honest],
    ]);
    const verification = new Verification({ probation: 3, auditRate: 0.1, seed: 1 });
    const r = await decode(s, 40, { verification, fallback: honest });
    expect(r.wrong).toBe(0);
    const st = verification.stats();
    expect(st.quarantines).toBe(0);
    expect(st.auditDisagreements).toBe(0);
    // 3 of probation (each audit covers both owners), then about 10% of the other 37
    expect(st.audits).toBeGreaterThanOrEqual(3);
    expect(st.audits).toBeLessThan(3 + 15);
    // each audit is one local compute, counted as an audit: nothing fell back
    expect(r.metrics).toMatchObject({ audits: st.audits, fallbacks: 0, failovers: 0 });
    const none = new Verification({ probation: 0, auditRate: 0 });
    await decode(s, 10, { verification: none, fallback: honest });
    expect(none.stats().audits).toBe(0);
  });

  it("patient colluders (honest through probation, then lying): caught by the sampled audit, both", async () => {
    const verification = new Verification({ probation: 2, auditRate: 0.25, seed: 3 });
    const r = await decode(colluders(honestThen(2, scaled), honestThen(2, scaled)), 40, {
      verification,
      fallback: honest,
    });
    expect(verification.quarantined().sort()).toEqual(["liarA", "liarB"]);
    // the lies used are those between probation and the first sampled one: expected (1-r)/r = 3
    expect(r.wrong).toBeLessThan(20);
    console.log(
      `[trust] patient colluders, probation 2, audit rate 0.25: ${r.wrong}/40 wrong outputs, caught at call ${r.detectedAt}`,
    );
  });

  it("two ids of one principal are never each other's twin", async () => {
    const mallory = () =>
      strangers([
        ["m1", ALL, scaled, "mallory"],
        ["m2", ALL, scaled, "mallory"],
      ]);
    // with a local fallback: no verifiable pair, so the fallback computes; the pair is never asked
    const verification = new Verification({ probation: 0, auditRate: 0 });
    const s = mallory();
    const r = await decode(s, 10, { verification, fallback: honest });
    expect(r.wrong).toBe(0);
    expect(s.calls).toEqual({ m1: 0, m2: 0 });
    expect(verification.stats()).toMatchObject({ unverifiableLocal: 10, samePrincipal: 10 });
    // without one: the typed refusal, never their agreement
    const bare = await decode(mallory(), 3, { verification: new Verification() });
    expect(bare.wrong).toBe(0);
    expect(bare.failed).toBe(3);
    expect(bare.metrics.errors).toMatchObject({ MOESWARM_VERIFY_UNAVAILABLE: 3 });
    // beside an honest owner of another principal: every pair is mallory + honest
    const mixed = strangers([
      ["m1", ALL, scaled, "mallory"],
      ["m2", ALL, scaled, "mallory"],
      ["h", ALL, honest, "alice"],
    ]);
    const v3 = new Verification({ probation: 0, auditRate: 0 });
    const m = await decode(mixed, 10, { verification: v3, fallback: honest });
    expect(m.wrong).toBe(0);
    expect(v3.quarantined().length).toBeGreaterThanOrEqual(1);
    expect(v3.quarantined().every((id) => id === "m1" || id === "m2")).toBe(true);
  });

  it("a compute class from the placement: bit-exact within a class, the tolerance across", async () => {
    const jitter = lying((_, y) => {
      for (let i = 0; i < y.length; i++) y[i] = Math.fround(y[i]! * (1 + 1e-6 * ((i % 3) - 1)));
    });
    const placementWith = (ca: string, cb: string) => {
      const s = strangers([
        ["x", ALL, honest],
        ["y", ALL, jitter],
      ]);
      const placement = Placement.fromRegistrations([
        { id: "x", model: "tiny", layers: [0], experts: ALL, computeClass: ca },
        { id: "y", model: "tiny", layers: [0], experts: ALL, computeClass: cb },
      ]);
      return { ...s, placement };
    };
    const same = new Verification({ probation: 0, auditRate: 0 });
    await decode(placementWith("ggml-cpu-x86_64", "ggml-cpu-x86_64"), 3, { verification: same });
    expect(same.stats().disagreements).toBe(3);
    const across = new Verification({ probation: 0, auditRate: 0 });
    await decode(placementWith("ggml-cpu-x86_64", "vulkan"), 3, { verification: across });
    expect(across.stats()).toMatchObject({ disagreements: 0, partsVerified: 3 });
  });
});

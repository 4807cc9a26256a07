import { getEventListeners } from "node:events";
import { DispatchError, InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { expectNoUnhandledRejections } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";
import {
  createReferenceWorker,
  DispatchMetrics,
  type DispatchOptions,
  dispatchExperts,
  dispatchExpertsDetailed,
  type ExpertHandler,
  type ExpertRequest,
  InProcessTransport,
  Placement,
} from "../src/index.js";
import { randomHidden, randomRouting, sameBits, tinyModel } from "./helpers.js";

// Every failure path must end in the right numbers (bit-identical to a healthy run) or a typed
// error; never a partial sum, never an unhandled rejection.
expectNoUnhandledRejections();

const model = tinyModel(11, { nExpert: 4, nEmbd: 6, nFf: 5 });
const good = createReferenceWorker(model);
const hidden = randomHidden(12, 5, 6);
const routing = randomRouting(13, 5, 2, 4);
const ALL = [0, 1, 2, 3];
const USED = [...new Set(routing.ids)].sort();
/** The routed experts among 2 and 3, as the errors name them. */
const HIGH = USED.filter((e) => e >= 2);
const HIGH_RANGE = HIGH.length === 2 ? "2:4" : `${HIGH[0]}:${HIGH[0]! + 1}`;
const DEADLINE = 40;

const never: ExpertHandler = () => new Promise(() => {});
const throws: ExpertHandler = () => {
  throw new Error("boom");
};
const rejects: ExpertHandler = async () => {
  throw new Error("async boom");
};
const shortY: ExpertHandler = async (req, o) => {
  const r = await good(req, o);
  return { ...r, y: r.y.subarray(1) };
};
/** NaN in a value the combine reads (the first owned slot); NaN in an empty slot is never read. */
const nanY: ExpertHandler = async (req, o) => {
  const r = await good(req, o);
  const y = Float32Array.from(r.y);
  const slot = req.mode === "each" ? req.ids.findIndex((id) => id >= 0) : 0;
  y[slot * req.embd] = Number.NaN;
  return { ...r, y };
};
/** NaN only in empty slots: harmless, the combine never reads them. */
const nanInEmptySlots: ExpertHandler = async (req, o) => {
  const r = await good(req, o);
  const y = Float32Array.from(r.y);
  req.ids.forEach((id, s) => {
    if (id < 0 && req.mode === "each") y.fill(Number.NaN, s * req.embd, (s + 1) * req.embd);
  });
  return { ...r, y };
};
const f64Y: ExpertHandler = async (req, o) => {
  const r = await good(req, o);
  return { ...r, y: Float64Array.from(r.y) };
};
const wrongMode: ExpertHandler = async (req, o) => ({
  ...(await good(req, o)),
  mode: req.mode === "each" ? "sum" : "each",
});
/** Answers after the deadline with plausible but wrong numbers. */
const late: ExpertHandler = async (req, o) => {
  const r = await good(req, o);
  await new Promise((resolve) => setTimeout(resolve, DEADLINE * 2));
  return { ...r, y: (r.y as Float32Array).map((v) => v + 1) };
};
const lateReject: ExpertHandler = () =>
  new Promise((_, reject) => setTimeout(() => reject(new Error("late no")), DEADLINE * 2));

function swarmOf(
  workers: [string, number[], ExpertHandler][],
): Pick<DispatchOptions, "placement" | "transport"> {
  const placement = Placement.fromRegistrations(
    workers.map(([id, experts]) => ({ id, model: "tiny", layers: [0], experts })),
  );
  const transport = new InProcessTransport(workers.map(([id, , c]) => [id, c] as const));
  return { placement, transport };
}

async function healthy(mode: "each" | "sum" = "each"): Promise<Float32Array> {
  return dispatchExperts(hidden, routing, { layer: 0, ...swarmOf([["solo", ALL, good]]), mode });
}

async function errorOf(p: Promise<unknown>): Promise<DispatchError> {
  try {
    await p;
  } catch (e) {
    expect(e).toBeInstanceOf(DispatchError);
    return e as DispatchError;
  }
  throw new Error("expected a rejection");
}

describe("failover to a replica", () => {
  const bads: [string, ExpertHandler][] = [
    ["never answers", never],
    ["throws", throws],
    ["rejects", rejects],
    ["returns a short y", shortY],
    ["returns NaN", nanY],
    ["returns f64 for an f32 request", f64Y],
    ["answers in the wrong mode", wrongMode],
    ["answers late with wrong numbers", late],
    ["rejects late", lateReject],
  ];
  for (const [what, bad] of bads) {
    it(`a worker that ${what}: the replica's result, bit-identical to a healthy run`, async () => {
      for (const mode of ["each", "sum"] as const) {
        const want = await healthy(mode);
        const metrics = new DispatchMetrics();
        const s = swarmOf([
          ["bad", ALL, bad],
          ["good", ALL, good],
        ]);
        const r = await dispatchExpertsDetailed(hidden, routing, {
          layer: 0,
          ...s,
          deadlineMs: DEADLINE,
          mode,
          metrics,
        });
        expect(sameBits(r.output, want)).toBe(true);
        expect(r.metrics.failovers).toBe(1);
        expect(r.metrics.owners.bad?.failures).toBe(1);
        expect(r.metrics.owners.good?.failures).toBe(0);
        expect(r.metrics.fallbacks).toBe(0);
        expect(metrics.snapshot()).toMatchObject({ calls: 1, failovers: 1, requests: 2 });
        expect(s.placement.inFlight("bad")).toBe(0);
      }
    });
  }

  it("splits a failed request over several replicas", async () => {
    const want = await healthy();
    const s = swarmOf([
      ["bad", ALL, throws],
      ["r1", [0, 1], good],
      ["r2", [2, 3], good],
    ]);
    const r = await dispatchExpertsDetailed(hidden, routing, { layer: 0, ...s });
    expect(sameBits(r.output, want)).toBe(true);
    expect(Object.keys(r.metrics.owners).sort()).toEqual(["bad", "r1", "r2"]);
  });
});

describe("untrusted worker ids", () => {
  it('a worker called "__proto__" pollutes nothing', async () => {
    const metrics = new DispatchMetrics();
    const r = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      ...swarmOf([["__proto__", ALL, good]]),
      metrics,
    });
    expect(Object.hasOwn(r.metrics.owners, "__proto__")).toBe(true);
    const own = (o: object) => Object.getOwnPropertyDescriptor(o, "__proto__")?.value as { requests: number };
    expect(own(r.metrics.owners).requests).toBe(1);
    expect(own(metrics.snapshot().owners).requests).toBe(1);
    expect(({} as Record<string, unknown>).requests).toBeUndefined();
  });
});

describe("result validation", () => {
  it("accepts non-finite values only where the combine never reads them (empty slots)", async () => {
    const s = swarmOf([
      ["a", [0, 1], nanInEmptySlots],
      ["b", [2, 3], nanInEmptySlots],
    ]);
    const r = await dispatchExpertsDetailed(hidden, routing, { layer: 0, ...s });
    expect(sameBits(r.output, await healthy())).toBe(true);
    expect(r.metrics.failovers).toBe(0);
  });
});

describe("fallback and typed errors", () => {
  it("uses the fallback when there is no replica, or when the replica fails too", async () => {
    const want = await healthy();
    for (const workers of [
      [["bad", ALL, never]],
      [
        ["bad", ALL, never],
        ["bad2", ALL, nanY],
      ],
    ] as [string, number[], ExpertHandler][][]) {
      const r = await dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        ...swarmOf(workers),
        deadlineMs: DEADLINE,
        fallback: good,
      });
      expect(sameBits(r.output, want)).toBe(true);
      expect(r.metrics.fallbacks).toBe(1);
    }
  });

  it("serves experts nobody owns from the fallback, or fails before sending anything", async () => {
    const want = await healthy();
    let calls = 0;
    const counting: ExpertHandler = (req, o) => {
      calls++;
      return good(req, o);
    };
    const s = swarmOf([["half", [0, 1], counting]]);
    const r = await dispatchExperts(hidden, routing, { layer: 0, ...s, fallback: good });
    expect(sameBits(r, want)).toBe(true);
    calls = 0;
    const e = await errorOf(dispatchExperts(hidden, routing, { layer: 0, ...s }));
    expect(e.code).toBe("MOESWARM_DISPATCH_NO_OWNER");
    expect(e.details).toMatchObject({ layer: 0, experts: HIGH_RANGE });
    expect(calls).toBe(0);
  });

  it("names the layer, experts and worker, with the code of what went wrong", async () => {
    const cases: [ExpertHandler, string][] = [
      [never, "MOESWARM_WORKER_TIMEOUT"],
      [throws, "MOESWARM_DISPATCH_FAILED"],
      [shortY, "MOESWARM_DISPATCH_BAD_RESULT"],
      [nanY, "MOESWARM_DISPATCH_BAD_RESULT"],
    ];
    for (const [bad, code] of cases) {
      const s = swarmOf([
        ["ok", [0, 1], good],
        ["w7", [2, 3], bad],
      ]);
      const e = await errorOf(
        dispatchExperts(hidden, routing, { layer: 3, ...s, deadlineMs: DEADLINE }).catch((x) => {
          throw x;
        }),
      );
      // layer 3 has no owners at all: registration covers layer 0 only
      expect(e.code).toBe("MOESWARM_DISPATCH_NO_OWNER");
      const e2 = await errorOf(dispatchExperts(hidden, routing, { layer: 0, ...s, deadlineMs: DEADLINE }));
      expect(e2.code).toBe(code);
      expect(e2.details).toMatchObject({ layer: 0, worker: "w7", experts: HIGH_RANGE });
      expect(e2.message).toContain(`layer 0: experts ${HIGH_RANGE} failed on worker w7`);
    }
    // a failing fallback is named too
    const e3 = await errorOf(
      dispatchExperts(hidden, routing, { layer: 0, ...swarmOf([["w1", ALL, throws]]), fallback: nanY }),
    );
    expect(e3.code).toBe("MOESWARM_DISPATCH_BAD_RESULT");
    expect(e3.message).toMatch(/fallback failed too/);
  });

  it("records failed calls in the aggregate metrics", async () => {
    const metrics = new DispatchMetrics();
    await errorOf(dispatchExperts(hidden, routing, { layer: 0, ...swarmOf([["w", ALL, throws]]), metrics }));
    expect(metrics.snapshot()).toMatchObject({
      calls: 1,
      failedCalls: 1,
      errors: { MOESWARM_DISPATCH_FAILED: 1 },
    });
  });

  it("retry: false goes straight to the fallback", async () => {
    const r = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      ...swarmOf([
        ["bad", ALL, throws],
        ["good", ALL, good],
      ]),
      retry: false,
      fallback: good,
    });
    expect(r.metrics).toMatchObject({ failovers: 0, fallbacks: 1 });
  });
});

describe("concurrency, abort and cleanup", () => {
  it("sends the requests of one call concurrently", async () => {
    let arrived = 0;
    let release: () => void = () => {};
    const barrier = new Promise<void>((r) => {
      release = r;
    });
    const waitAll: ExpertHandler = async (req, o) => {
      arrived++;
      if (arrived === USED.length) release();
      await barrier; // deadlocks if the dispatcher awaited each worker in turn
      return good(req, o);
    };
    const s = swarmOf(ALL.map((e) => [`w${e}`, [e], waitAll] as [string, number[], ExpertHandler]));
    const r = await dispatchExpertsDetailed(hidden, routing, { layer: 0, ...s, deadlineMs: 5000 });
    expect(sameBits(r.output, await healthy())).toBe(true);
    expect(r.metrics.requests).toBe(USED.length);
  });

  it("rejects with the signal's reason when already aborted, sending nothing", async () => {
    let calls = 0;
    const count: ExpertHandler = () => {
      calls++;
      return new Promise(() => {});
    };
    const s = swarmOf([["w", ALL, count]]);
    const reason = new Error("stop");
    await expect(
      dispatchExperts(hidden, routing, { layer: 0, ...s, signal: AbortSignal.abort(reason) }),
    ).rejects.toBe(reason);
    expect(calls).toBe(0);
  });

  it("aborting mid-way rejects at once, aborts the workers' signals and removes its listeners", async () => {
    const seen: AbortSignal[] = [];
    const hang: ExpertHandler = (_req: ExpertRequest, { signal }) => {
      seen.push(signal);
      return new Promise(() => {});
    };
    const controller = new AbortController();
    const s = swarmOf([
      ["a", [0, 1], hang],
      ["b", [2, 3], hang],
    ]);
    const p = dispatchExperts(hidden, routing, {
      layer: 0,
      ...s,
      signal: controller.signal,
      deadlineMs: 60_000,
    });
    await new Promise((r) => setTimeout(r, 5));
    controller.abort(new Error("user stop"));
    await expect(p).rejects.toThrow("user stop");
    expect(seen).toHaveLength(2);
    expect(seen.every((sig) => sig.aborted)).toBe(true);
    expect(getEventListeners(controller.signal, "abort")).toHaveLength(0);
    expect(s.placement.inFlight("a") + s.placement.inFlight("b")).toBe(0);
  });

  it("a part that fails for good ends the call: the other workers' requests are aborted with its error", async () => {
    const seen: AbortSignal[] = [];
    const hang: ExpertHandler = (_req: ExpertRequest, { signal }) => {
      seen.push(signal);
      return new Promise(() => {});
    };
    // "a" answers NaN and has no replica and there is no fallback: the call fails at once
    const s = swarmOf([
      ["a", [0, 1], nanY],
      ["b", [2, 3], hang],
    ]);
    const e = await errorOf(dispatchExperts(hidden, routing, { layer: 0, ...s, deadlineMs: 60_000 }));
    expect(e.code).toBe("MOESWARM_DISPATCH_BAD_RESULT");
    expect(seen).toHaveLength(1);
    expect(seen[0]!.aborted).toBe(true);
    expect(seen[0]!.reason).toBe(e);
    expect(s.placement.inFlight("a") + s.placement.inFlight("b")).toBe(0);
  });

  it("leaves no listener on the caller's signal after success or failure", async () => {
    const controller = new AbortController();
    await dispatchExperts(hidden, routing, {
      layer: 0,
      ...swarmOf([["w", ALL, good]]),
      signal: controller.signal,
    });
    await errorOf(
      dispatchExperts(hidden, routing, {
        layer: 0,
        ...swarmOf([["w", ALL, throws]]),
        signal: controller.signal,
      }),
    );
    expect(getEventListeners(controller.signal, "abort")).toHaveLength(0);
  });
});

describe("input validation", () => {
  it("rejects bad arguments with InvalidArgumentError before sending anything", async () => {
    const s = swarmOf([["w", ALL, good]]);
    const bad: [unknown, unknown, Partial<DispatchOptions>][] = [
      [Array.from(hidden), routing, {}],
      [hidden.subarray(1), routing, {}],
      [hidden, { ...routing, ids: new Int32Array(3) }, {}],
      [hidden, { ...routing, weights: new Float32Array(routing.weights).fill(Number.NaN) }, {}],
      [Float32Array.from(hidden).fill(Number.POSITIVE_INFINITY, 7, 8), routing, {}],
      [hidden, routing, { layer: -1 }],
      [hidden, routing, { deadlineMs: 0 }],
      [hidden, routing, { mode: "all" as "each" }],
      [hidden, routing, { transport: {} as InProcessTransport }],
    ];
    for (const [h, r, o] of bad) {
      const err = await dispatchExperts(h as Float32Array, r as typeof routing, {
        layer: 0,
        ...s,
        ...o,
      }).then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(isMoeswarmError(err)).toBe(true);
      expect(err).toBeInstanceOf(InvalidArgumentError);
    }
  });

  it("returns an empty output for zero tokens", async () => {
    const out = await dispatchExperts(
      new Float32Array(0),
      { n: 0, k: 2, ids: new Int32Array(0), weights: new Float32Array(0) },
      {
        layer: 0,
        ...swarmOf([["w", ALL, good]]),
      },
    );
    expect(out).toHaveLength(0);
  });
});

import { InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { expectNoUnhandledRejections } from "@moeswarm/testkit";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import {
  createReferenceWorker,
  dispatchExpertsDetailed,
  type ExpertRequest,
  type ExpertResult,
  type ExpertTransport,
  Liveness,
  Placement,
} from "../src/index.js";
import { randomHidden, randomRouting, sameBits, tinyModel } from "./helpers.js";

// Hedged requests: a slow worker's experts are asked again of a replica after `hedgeMs`; the first
// good answer is combined, the other request is cancelled, and nothing rejects unobserved.
// The workers' delays and the hedge run on fake timers: each test moves the clock itself, so no
// outcome depends on how busy the machine is.
expectNoUnhandledRejections();

beforeEach(() => {
  vi.useFakeTimers({ toFake: ["setTimeout", "clearTimeout", "performance", "Date"] });
});
afterEach(() => {
  vi.useRealTimers();
});

/**
 * Moves the fake clock `ms` forward (firing hedges and the workers' answers), then settles `call`;
 * a call still pending then fails the test rather than waiting on the wall clock.
 */
async function after<T>(ms: number, call: Promise<T>): Promise<T> {
  let s: { ok: true; value: T } | { ok: false; error: unknown } | undefined;
  call.then(
    (value) => {
      s = { ok: true, value };
    },
    (error: unknown) => {
      s = { ok: false, error };
    },
  );
  await vi.advanceTimersByTimeAsync(ms);
  if (s === undefined) throw new Error(`still pending after ${ms} ms of fake time`);
  if (!s.ok) throw s.error;
  return s.value;
}

const model = tinyModel(21, { nExpert: 4, nEmbd: 6, nFf: 5 });
const compute = createReferenceWorker(model);
const hidden = randomHidden(22, 3, 6);
const routing = randomRouting(23, 3, 2, 4);
const ALL = [0, 1, 2, 3];

type Behaviour = { delayMs: number; fail?: boolean };

/** A transport over the reference worker where each worker answers after its own delay (or fails). */
function slowTransport(behaviour: Record<string, Behaviour>) {
  const log: Array<{ to: string; aborted: () => boolean }> = [];
  const transport: ExpertTransport = {
    // in-process fakes: trust "own" and fixed deadlines (hedging as each test asks)
    trusted: true,
    request(to: string, req: ExpertRequest, options: { signal?: AbortSignal } = {}): Promise<ExpertResult> {
      const signal = options.signal;
      log.push({ to, aborted: () => signal?.aborted ?? false });
      const b = behaviour[to]!;
      return new Promise((resolve, reject) => {
        const timer = setTimeout(async () => {
          if (b.fail) reject(new Error(`${to} broke`));
          else resolve(await compute(req, { signal: new AbortController().signal }));
        }, b.delayMs);
        signal?.addEventListener("abort", () => {
          clearTimeout(timer);
          reject(signal.reason);
        });
      });
    },
  };
  return { transport, log };
}

function twoReplicas() {
  return Placement.fromRegistrations([
    { id: "a", model: "tiny", layers: [0], experts: ALL },
    { id: "b", model: "tiny", layers: [0], experts: ALL },
  ]);
}

async function healthy(): Promise<Float32Array> {
  const placement = Placement.fromRegistrations([{ id: "a", model: "tiny", layers: [0], experts: ALL }]);
  const { transport } = slowTransport({ a: { delayMs: 0 } });
  return (
    await after(0, dispatchExpertsDetailed(hidden, routing, { layer: 0, placement, transport, mode: "each" }))
  ).output;
}

/** Whichever worker is asked first stays silent (5 s); every later request is answered at once. */
function silentFirst() {
  const { transport, log } = slowTransport({ a: { delayMs: 5000 }, b: { delayMs: 5000 } });
  let asked = false;
  const quick: ExpertTransport = {
    trusted: true,
    request(to, req, options) {
      if (!asked) {
        asked = true;
        return transport.request(to, req, options);
      }
      return Promise.resolve(compute(req, { signal: new AbortController().signal }));
    },
  };
  return { quick, log };
}

describe("hedged requests (hedgeMs)", () => {
  it("a silent worker's experts go to a replica, whose answer is used; the first request is cancelled", async () => {
    const { quick, log } = silentFirst();
    // the hedge fires at 20 ms; the silent request (5 s) is never waited for
    const r = await after(
      20,
      dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: twoReplicas(),
        transport: quick,
        mode: "each",
        hedgeMs: 20,
      }),
    );
    expect(sameBits(r.output, await healthy())).toBe(true);
    expect(r.metrics).toMatchObject({ hedges: 1, hedgeWins: 1, requests: 2 });
    expect(log).toHaveLength(1);
    expect(log[0]!.aborted()).toBe(true);
    // the cancelled loser is not a failure
    expect(Object.values(r.metrics.owners).reduce((n, o) => n + o.failures, 0)).toBe(0);
  });

  it("with liveness the twin's win leaves the first request running to its own deadline", async () => {
    const { quick, log } = silentFirst();
    const r = await after(
      20,
      dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: twoReplicas(),
        transport: quick,
        mode: "each",
        hedgeMs: 20,
        liveness: new Liveness(),
      }),
    );
    expect(sameBits(r.output, await healthy())).toBe(true);
    expect(r.metrics).toMatchObject({ hedges: 1, hedgeWins: 1, requests: 2 });
    expect(log).toHaveLength(1);
    // not cancelled: a worker that hangs must time out so that its circuit opens
    expect(log[0]!.aborted()).toBe(false);
  });

  it("a worker that answers within hedgeMs is never hedged", async () => {
    const { transport, log } = slowTransport({ a: { delayMs: 0 }, b: { delayMs: 0 } });
    // the answer comes at 0 ms; the clock never reaches the 200 ms hedge
    const r = await after(
      0,
      dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: twoReplicas(),
        transport,
        mode: "each",
        hedgeMs: 200,
      }),
    );
    expect(sameBits(r.output, await healthy())).toBe(true);
    expect(r.metrics).toMatchObject({ hedges: 0, hedgeWins: 0, requests: 1 });
    expect(log).toHaveLength(1);
  });

  it("the primary still wins when it answers before its twin; the twin is cancelled", async () => {
    const { transport, log } = slowTransport({ a: { delayMs: 60 }, b: { delayMs: 60 } });
    // the twin is asked at 20 ms (it would answer at 80); the primary answers at 60
    const r = await after(
      60,
      dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: twoReplicas(),
        transport,
        mode: "each",
        hedgeMs: 20,
      }),
    );
    expect(sameBits(r.output, await healthy())).toBe(true);
    expect(r.metrics).toMatchObject({ hedges: 1, hedgeWins: 0, requests: 2 });
    expect(log.map((l) => l.aborted())).toEqual([false, true]);
  });

  it("without a replica a slow worker is simply waited for", async () => {
    const placement = Placement.fromRegistrations([{ id: "a", model: "tiny", layers: [0], experts: ALL }]);
    const { transport } = slowTransport({ a: { delayMs: 50 } });
    const r = await after(
      50,
      dispatchExpertsDetailed(hidden, routing, { layer: 0, placement, transport, hedgeMs: 5 }),
    );
    expect(r.metrics).toMatchObject({ hedges: 0, requests: 1 });
    expect(sameBits(r.output, await healthy())).toBe(true);
  });

  it("when both the worker and its twin fail, failover and the fallback take over", async () => {
    const { transport } = slowTransport({ a: { delayMs: 30, fail: true }, b: { delayMs: 30, fail: true } });
    // the primary fails at 30 ms, its twin (asked at 5) at 35, the retry (asked at 35) at 65
    const r = await after(
      65,
      dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: twoReplicas(),
        transport,
        mode: "each",
        hedgeMs: 5,
        fallback: compute,
      }),
    );
    expect(sameBits(r.output, await healthy())).toBe(true);
    expect(r.metrics.hedges).toBe(1);
    expect(r.metrics.fallbacks).toBeGreaterThanOrEqual(1);
    const noFallback = await after(
      65,
      dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: twoReplicas(),
        transport,
        hedgeMs: 5,
      }),
    ).catch((e: unknown) => e);
    expect(isMoeswarmError(noFallback)).toBe(true);
  });

  it("refuses a bad hedgeMs", async () => {
    for (const hedgeMs of [-1, Number.NaN, Number.POSITIVE_INFINITY]) {
      const { transport } = slowTransport({ a: { delayMs: 0 }, b: { delayMs: 0 } });
      await expect(
        dispatchExpertsDetailed(hidden, routing, { layer: 0, placement: twoReplicas(), transport, hedgeMs }),
      ).rejects.toBeInstanceOf(InvalidArgumentError);
    }
  });
});

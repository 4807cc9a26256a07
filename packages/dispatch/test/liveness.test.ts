import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import {
  createReferenceWorker,
  dispatchExperts,
  type ExpertHandler,
  type ExpertTransport,
  InProcessTransport,
  Liveness,
  Placement,
} from "../src/index.js";
import { randomHidden, randomRouting, sameBits, tinyModel } from "./helpers.js";

// Liveness (issue 14, attack 7): a worker that stops answering (SIGSTOP) costs a decode at most one
// adaptive deadline, then its circuit is open and it is not picked until a half-open probe after
// the cool-down. Fake timers: the figures are in virtual milliseconds.

const model = tinyModel(41, { nExpert: 4, nEmbd: 6, nFf: 5 });
const honest = createReferenceWorker(model);
const ALL = [0, 1, 2, 3];
const ROUND_MS = 10;

beforeEach(() => {
  vi.useFakeTimers({ toFake: ["setTimeout", "clearTimeout", "performance", "Date"] });
});
afterEach(() => {
  vi.useRealTimers();
});

/** Workers answering after ROUND_MS (fake time); a stopped one never answers. */
function swarm(ids: string[]) {
  const stopped = new Set<string>();
  const calls: Record<string, number> = {};
  const slow = (id: string): ExpertHandler => {
    calls[id] = 0;
    return (req, o) => {
      calls[id]!++;
      if (stopped.has(id)) return new Promise(() => {});
      return new Promise((resolve) => setTimeout(() => resolve(honest(req, o)), ROUND_MS));
    };
  };
  const inner = new InProcessTransport(ids.map((id) => [id, slow(id)] as const));
  // not `trusted`: the defaults of a relay apply
  const transport: ExpertTransport = { request: (to, req, o) => inner.request(to, req, o) };
  const placement = Placement.fromRegistrations(
    ids.map((id) => ({ id, model: "tiny", layers: [0], experts: ALL })),
  );
  return { transport, placement, stopped, calls };
}

/** Runs a dispatch to its end in fake time; its virtual duration. */
async function timed(p: Promise<Float32Array>): Promise<{ out: Float32Array; ms: number }> {
  const t0 = performance.now();
  let done = false;
  const settled = p.finally(() => {
    done = true;
  });
  while (!done) await vi.advanceTimersByTimeAsync(1);
  return { out: await settled, ms: performance.now() - t0 };
}

function quantile(xs: number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))]!;
}

describe("a hung worker under the defaults", () => {
  for (const trust of ["own", "verify"] as const) {
    it(`trust ${trust}: the stall is bounded by one adaptive deadline, then the circuit is open`, async () => {
      const s = swarm(trust === "own" ? ["a", "b"] : ["a", "b", "c"]);
      const liveness = new Liveness();
      const opts = { layer: 0, placement: s.placement, transport: s.transport, trust, liveness };
      const hidden = randomHidden(1, 3, 6);
      const routing = randomRouting(2, 3, 2, 4);
      const want = await dispatchExperts(hidden, routing, {
        layer: 0,
        placement: Placement.fromRegistrations([{ id: "h", model: "tiny", layers: [0], experts: ALL }]),
        transport: new InProcessTransport({ h: honest }),
      });
      // warm up: round times observed, deadlines adapt
      for (let i = 0; i < 8; i++)
        expect(sameBits((await timed(dispatchExperts(hidden, routing, opts))).out, want)).toBe(true);
      const deadline = liveness.deadline("a", 30_000);
      expect(deadline).toBeLessThan(1000);
      s.stopped.add("a");
      const before = s.calls.a!;
      const stalls: number[] = [];
      for (let i = 0; i < 40; i++) {
        const r = await timed(dispatchExperts(hidden, routing, opts));
        expect(sameBits(r.out, want)).toBe(true);
        stalls.push(r.ms);
      }
      // at most one request to the stopped worker per cool-down (the first, then half-open probes)
      const asked = s.calls.a! - before;
      expect(asked).toBeLessThanOrEqual(2);
      expect(Math.max(...stalls)).toBeLessThanOrEqual(deadline + 2 * ROUND_MS + 5);
      expect(liveness.snapshot().opens).toBeGreaterThanOrEqual(1);
      console.log(
        `[liveness] trust ${trust}: adaptive deadline ${deadline} ms (round ${ROUND_MS} ms, cap 30000); ` +
          `stopped worker asked ${asked}x in 40 calls; stall p50 ${quantile(stalls, 0.5)} ms, max ${Math.max(...stalls)} ms`,
      );
    });
  }

  it("the cool-down doubles while the probe still times out; an answer closes the circuit", async () => {
    const s = swarm(["a", "b"]);
    const liveness = new Liveness({ coolDownMs: 100 });
    const opts = {
      layer: 0,
      placement: s.placement,
      transport: s.transport,
      trust: "own" as const,
      liveness,
      hedgeMs: 0,
    };
    const hidden = randomHidden(3, 2, 6);
    const routing = randomRouting(4, 2, 2, 4);
    for (let i = 0; i < 8; i++) await timed(dispatchExperts(hidden, routing, opts));
    s.stopped.add("a");
    const opened: number[] = [];
    let last = liveness.snapshot().opens;
    for (let i = 0; i < 120 && opened.length < 3; i++) {
      await timed(dispatchExperts(hidden, routing, opts));
      const now = liveness.snapshot().opens;
      if (now > last) opened.push(performance.now());
      last = now;
    }
    expect(opened).toHaveLength(3);
    // gaps between opens grow (100, then 200 ms of cool-down)
    expect(opened[2]! - opened[1]!).toBeGreaterThan(opened[1]! - opened[0]!);
    s.stopped.delete("a");
    await vi.advanceTimersByTimeAsync(1000);
    for (let i = 0; i < 4; i++) await timed(dispatchExperts(hidden, routing, opts));
    expect(liveness.snapshot().open).toEqual([]);
  });

  it("the adaptive deadline grows with the request's slots (a prefill after decode rounds)", () => {
    const l = new Liveness();
    expect(l.deadline("w", 30_000, 8)).toBe(30_000);
    for (let i = 0; i < 4; i++) l.answered("w", 10, 8);
    expect(l.deadline("w", 30_000, 8)).toBe(250);
    // 512 tokens x 8 slots at 1.25 ms per slot, x4
    expect(l.deadline("w", 30_000, 4096)).toBe(4 * 1.25 * 4096);
    expect(l.deadline("w", 10_000, 4096)).toBe(10_000);
    expect(() => new Liveness({ floorMs: 0 })).toThrow(/floorMs/);
  });

  it("a trusted transport keeps fixed deadlines (no liveness unless given)", async () => {
    const placement = Placement.fromRegistrations([{ id: "a", model: "tiny", layers: [0], experts: ALL }]);
    let n = 0;
    const transport = new InProcessTransport({
      a: (req, o) => {
        n++;
        return new Promise((resolve) => setTimeout(() => resolve(honest(req, o)), n > 8 ? 500 : ROUND_MS));
      },
    });
    const hidden = randomHidden(5, 2, 6);
    const routing = randomRouting(6, 2, 2, 4);
    for (let i = 0; i < 10; i++)
      await timed(dispatchExperts(hidden, routing, { layer: 0, placement, transport }));
    expect(n).toBe(10);
  });
});

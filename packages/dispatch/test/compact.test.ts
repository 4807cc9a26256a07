import { compactSlots, isMoeswarmError } from "@moeswarm/core";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  createReferenceWorker,
  dispatchExpertsDetailed,
  type ExpertRequest,
  type ExpertResult,
  type ExpertTransport,
} from "../src/index.js";
import { randomHidden, randomRegistrations, randomRouting, sameBits, swarm, tinyModel } from "./helpers.js";

// Compact "each" results (protocol section 5): a worker sends only the rows of the slots it was
// given, and the dispatcher lays them out again; the combine must not see a difference.

/** The rows of the request's filled slots, in slot order. */
function compactOf(req: ExpertRequest, res: ExpertResult): ExpertResult {
  return { ...res, y: compactSlots(res.y as Float32Array, req.ids, req.embd), compact: true };
}

/** A transport whose workers answer compactly when asked (as relay workers do). */
function compacting(inner: ExpertTransport, seen: ExpertRequest[] = []): ExpertTransport {
  return {
    // in-process fakes: trust "own" and fixed deadlines, as before trust existed
    trusted: true,
    async request(to, req, options) {
      seen.push(req);
      const ids = req.ids.slice();
      const res = await inner.request(to, req, options);
      return req.compact && req.mode === "each" ? compactOf({ ...req, ids }, res) : res;
    },
  };
}

describe("compact results", () => {
  it("bit-identical to full results for random models, batches and placements, with fewer bytes", async () => {
    let saved = 0;
    await fc.assert(
      fc.asyncProperty(
        fc.integer({ min: 1, max: 2 ** 31 - 1 }),
        fc.integer({ min: 1, max: 6 }),
        fc.integer({ min: 1, max: 7 }),
        fc.constantFrom<"each" | "auto">("each", "auto"),
        async (seed, workers, n, mode) => {
          const nExpert = 8;
          const k = 3;
          const model = tinyModel(seed, { nExpert, nEmbd: 5, nFf: 4 });
          const hidden = randomHidden(seed + 1, n, 5);
          const routing = randomRouting(seed + 2, n, k, nExpert);
          const regs = randomRegistrations(seed + 3, workers, nExpert, [0], 1);
          const full = swarm(regs, () => createReferenceWorker(model));
          const a = await dispatchExpertsDetailed(hidden, routing, { layer: 0, ...full, mode });
          const packed = swarm(regs, () => createReferenceWorker(model));
          const seen: ExpertRequest[] = [];
          const b = await dispatchExpertsDetailed(hidden, routing, {
            layer: 0,
            placement: packed.placement,
            transport: compacting(packed.transport, seen),
            mode,
          });
          expect(sameBits(a.output, b.output)).toBe(true);
          // every "each" request asked for a compact answer; "sum" ones never do
          for (const q of seen) expect(q.compact === true).toBe(q.mode === "each");
          expect(b.metrics.bytesIn).toBeLessThanOrEqual(a.metrics.bytesIn);
          saved += a.metrics.bytesIn - b.metrics.bytesIn;
        },
      ),
      { numRuns: 120 },
    );
    expect(saved).toBeGreaterThan(0);
  });

  it("a compact answer of the wrong length, or to a sum request, is a bad result", async () => {
    const model = tinyModel(3, { nExpert: 4, nEmbd: 5, nFf: 4 });
    const hidden = randomHidden(4, 2, 5);
    const routing = randomRouting(5, 2, 2, 4);
    const regs = [{ id: "w", model: "tiny", layers: [0], experts: [0, 1, 2, 3] }];
    const { placement, transport } = swarm(regs, () => createReferenceWorker(model));
    const lying = (fix: (req: ExpertRequest, res: ExpertResult) => ExpertResult): ExpertTransport => ({
      trusted: true,
      async request(to, req, options) {
        const ids = req.ids.slice();
        return fix({ ...req, ids }, await transport.request(to, req, options));
      },
    });
    const short = lying((req, res) => {
      const c = compactOf(req, res);
      return { ...c, y: c.y.subarray(0, c.y.length - 5) };
    });
    const e1 = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement,
      transport: short,
      mode: "each",
    }).catch((e: unknown) => e);
    expect(isMoeswarmError(e1)).toBe(true);
    expect(String((e1 as Error).message)).toMatch(/compact y has/);
    const sum = lying((_req, res) => ({ ...res, compact: true }));
    const e2 = await dispatchExpertsDetailed(hidden, routing, {
      layer: 0,
      placement,
      transport: sum,
      mode: "sum",
    }).catch((e: unknown) => e);
    expect(String((e2 as Error).message)).toMatch(/did not ask for one/);
  });
});

// How the router picks the compute for a dispatch, with stand-in computes that say which of them
// ran and how: a request one slice holds goes to that compute (written into the given memory when
// it runs inline, without a promise; on the pool otherwise), one whose filled slots span slices is
// split; what the router knows about its layers follows add() and remove() (it is kept between
// dispatches, not rebuilt for each). The bits of real computes are slice-router.test.ts's.

import type { ExpertCompute, ExpertComputeInfo, RunRequest } from "@moeswarm/worker-native";
import { describe, expect, it } from "vitest";
import { SliceRouter } from "../src/slice-router.js";

const EMBD = 2;
const K = 2;

/** A compute whose answer is `mark` in every value; `inline`: it runs small requests inline. */
function standIn(mark: number, layers: number[], experts: number[], inline: boolean) {
  const calls: string[] = [];
  const answer = (req: RunRequest) =>
    new Float32Array((req.mode === "each" ? req.ids.length : req.ids.length / req.k) * EMBD).fill(mark);
  const compute = {
    info: { layers, experts, nEmbd: EMBD } as unknown as ExpertComputeInfo,
    run: async (req: RunRequest) => {
      calls.push(`run ${req.mode} ${Array.from(req.ids).join(",")}`);
      return answer(req);
    },
    ...(inline
      ? {
          runsInline: () => true,
          runSyncInto: (req: RunRequest, y: Float32Array) => {
            calls.push(`into ${req.mode} ${Array.from(req.ids).join(",")}`);
            y.set(answer(req));
          },
        }
      : {}),
    close: async () => {},
    [Symbol.asyncDispose]: async () => {},
  } as ExpertCompute;
  return { compute, calls };
}

const request = (layer: number, ids: number[], mode: "each" | "sum" = "each"): RunRequest => ({
  layer,
  x: new Float32Array((ids.length / K) * EMBD),
  ids: Int32Array.from(ids),
  k: K,
  w: new Float32Array(ids.length).fill(1),
  mode,
});

describe("SliceRouter routing", () => {
  it("answers a request one inline compute holds without a promise, into the memory given", async () => {
    const a = standIn(1, [0], [0, 1, 2, 3], true);
    const b = standIn(2, [0], [4, 5, 6, 7], false);
    const router = new SliceRouter("m");
    router.add({ layers: { start: 0, end: 1 }, experts: { start: 0, end: 4 }, compute: a.compute });
    router.add({ layers: { start: 0, end: 1 }, experts: { start: 4, end: 8 }, compute: b.compute });
    // every filled slot in a's slice: a computes all of it, inline, when written
    const out = router.inlineOutput(request(0, [1, -1, 3, 0]));
    expect(out?.values).toBe(4 * EMBD);
    expect(a.calls).toEqual([]);
    const y = new Float32Array(4 * EMBD).fill(Number.NaN);
    out?.write(y);
    expect(Array.from(y)).toEqual(new Array(4 * EMBD).fill(1));
    expect(a.calls).toEqual(["into each 1,-1,3,0"]);
    // b's slots: b does not run inline, so no inline answer; runOutput runs it on its pool
    expect(router.inlineOutput(request(0, [4, 5]))).toBeUndefined();
    const pooled = await router.runOutput(request(0, [4, 5], "sum"));
    expect(Array.from(pooled.y as Float32Array)).toEqual([2, 2]);
    expect(b.calls).toEqual(["run sum 4,5"]);
    // slots in both: split, each slice's own slots (the others masked), merged in slot order
    expect(router.inlineOutput(request(0, [0, 4]))).toBeUndefined();
    const split = await router.runOutput(request(0, [0, 4]));
    const merged = new Float32Array(split.values);
    split.write(merged);
    expect(Array.from(merged)).toEqual([1, 1, 2, 2]);
    expect(a.calls.slice(1)).toEqual(["run each 0,-1"]);
    expect(b.calls.slice(1)).toEqual(["run each -1,4"]);
    // an aborted signal: not inline (the compute's run refuses it as it does)
    const aborted = AbortSignal.abort();
    await router.runOutput(request(0, [1, 2]), { signal: aborted });
    expect(a.calls.at(-1)).toBe("run each 1,2");
  });

  it("refuses what the slices do not hold, and follows add() and remove()", () => {
    const a = standIn(1, [0], [0, 1], true);
    const b = standIn(2, [1], [0, 1], true);
    const router = new SliceRouter("m");
    router.add({ layers: { start: 0, end: 1 }, experts: { start: 0, end: 2 }, compute: a.compute });
    expect(router.layers()).toEqual([0]);
    expect(() => router.inlineOutput(request(1, [0, 1]))).toThrow(
      expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
    );
    expect(() => router.inlineOutput(request(0, [0, 2]))).toThrow(/expert 2 .* is not in this slice/);
    router.add({ layers: { start: 1, end: 2 }, experts: { start: 0, end: 2 }, compute: b.compute });
    expect(router.layers()).toEqual([0, 1]);
    router.inlineOutput(request(1, [0, 1]))?.write(new Float32Array(2 * EMBD));
    expect(b.calls).toEqual(["into each 0,1"]);
    router.layers().push(7); // a copy: the router's own list is untouched
    expect(router.layers()).toEqual([0, 1]);
    router.remove(b.compute);
    expect(router.layers()).toEqual([0]);
    expect(() => router.inlineOutput(request(1, [0, 1]))).toThrow(/layer 1 is not in this slice/);
    router.inlineOutput(request(0, [0, 1]))?.write(new Float32Array(2 * EMBD));
    expect(a.calls).toEqual(["into each 0,1"]);
  });
});

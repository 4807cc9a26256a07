// A worker's several slices behind one run: dispatches whose slots span slices are split, computed
// per slice and merged; the bits must be those of one compute over the whole model, in both modes,
// on every backend (TypeScript, the native addon, llama.cpp's own CPU kernels).

import { join } from "node:path";
import { isMoeswarmError } from "@moeswarm/core";
import { GgmlType } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import {
  type ExpertCompute,
  llamaExpertWorkerPath,
  loadActivationQuantizer,
  loadExpertCompute,
  nativeStatus,
  probeNative,
} from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { SliceRouter } from "../src/slice-router.js";
import {
  bitsEqual,
  type Fixture,
  firstBitDiff,
  normals,
  randomIds,
  randomWeights,
  writeModel,
  writeSlice,
} from "./fixtures.js";

const N_EMBD = 64;
const N_EXPERT = 12;
const K = 4;
const N = 9;
const range = (start: number, end: number) => Array.from({ length: end - start }, (_, i) => start + i);

// three rectangles of layers {0, 1} x experts 0..11: what a worker that claimed three slices holds
const SLICES = [
  { layers: { start: 0, end: 2 }, experts: { start: 0, end: 5 } },
  { layers: { start: 0, end: 1 }, experts: { start: 5, end: 12 } },
  { layers: { start: 1, end: 2 }, experts: { start: 5, end: 9 } },
];

let llamaMissing: string | undefined;
try {
  llamaExpertWorkerPath();
} catch (error) {
  llamaMissing = (error as Error).message;
}

const tmp = tempDir("moeswarm-wn-router-");
let model: Fixture;

beforeAll(async () => {
  await probeNative();
  // Q8_0: repacked on x86 by llama.cpp's CPU backend, the case most sensitive to how rows are grouped
  model = await writeModel(
    { type: GgmlType.Q8_0, nEmbd: N_EMBD, nFf: 32, nExpert: N_EXPERT, layers: [0, 1], seed: 21 },
    tmp.dir,
  );
  for (const [i, s] of SLICES.entries()) {
    await writeSlice(
      model,
      range(s.experts.start, s.experts.end),
      range(s.layers.start, s.layers.end),
      join(tmp.dir, `slice-${i}.gguf`),
    );
  }
});
afterAll(() => tmp.remove());

const BACKENDS = [
  { backend: "ts" as const, skip: undefined },
  { backend: "native" as const, skip: "native" },
  { backend: "llama-cpu" as const, skip: "llama" },
];

describe.each(BACKENDS)("SliceRouter ($backend)", ({ backend, skip }) => {
  const skipped = () =>
    (skip === "native" && nativeStatus()?.available !== true) ||
    (skip === "llama" && llamaMissing !== undefined);

  it("splits a dispatch over the slices that hold its slots, bit-identical to one compute (each and sum)", async (ctx) => {
    if (skipped()) ctx.skip(); // the loader says why the native paths are missing; the rest runs everywhere
    const computes: ExpertCompute[] = [];
    try {
      const whole = await loadExpertCompute(model.path, { backend, threads: 1 });
      computes.push(whole);
      const router = new SliceRouter("m");
      for (const [i, s] of SLICES.entries()) {
        const compute = await loadExpertCompute(join(tmp.dir, `slice-${i}.gguf`), { backend, threads: 1 });
        computes.push(compute);
        router.add({ ...s, compute });
      }
      expect(router.layers()).toEqual([0, 1]);
      const quantizer =
        nativeStatus()?.available === true ? await loadActivationQuantizer(model.path) : undefined;
      for (const [layer, held] of [
        [0, range(0, 12)],
        [1, range(0, 9)],
      ] as const) {
        for (let trial = 0; trial < 3; trial++) {
          const seed = 100 * layer + trial;
          const x = normals(N * N_EMBD, seed, 0.7);
          const ids = randomIds(N, K, held, seed + 1, trial === 2 ? 0.3 : 0);
          // one token with every slot empty, one whose slots all sit in one slice
          ids.fill(-1, 0, K);
          ids.set([1, 3, 0, 4], K);
          const w = randomWeights(N, K, seed + 2);
          for (const mode of ["each", "sum"] as const) {
            const want = await whole.run({ layer, x, ids, k: K, w: w, mode });
            const got = await router.run({ layer, x, ids, k: K, w: w, mode });
            expect(firstBitDiff(got, want), `layer ${layer} trial ${trial} ${mode}`).toBe(-1);
            expect(bitsEqual(got, want)).toBe(true);
            // the answer written into memory given to it (a result frame's, which may hold an older
            // frame's bytes: NaNs here), as the worker answers a split dispatch
            const output = await router.runOutput({ layer, x, ids, k: K, w: w, mode });
            const into = new Float32Array(output.values).fill(Number.NaN);
            output.write(into);
            expect(firstBitDiff(into, want), `runOutput layer ${layer} trial ${trial} ${mode}`).toBe(-1);
            // the rows as q8_0 (what a dispatcher sends): the same bits, split or not; TypeScript refuses them
            const q = quantizer?.quantize("q8_0", x, N_EMBD);
            if (q && backend !== "ts") {
              const gotQ = await router.run({ layer, x: q, xType: "q8_0", ids, k: K, w: w, mode });
              expect(firstBitDiff(gotQ, want), `q8_0 layer ${layer} trial ${trial} ${mode}`).toBe(-1);
            } else if (q) {
              const e = await router
                .run({ layer, x: q, xType: "q8_0", ids, k: K, w: w, mode })
                .catch((err) => err);
              expect(isMoeswarmError(e, "MOESWARM_NATIVE_WIRE_DTYPE"), String(e)).toBe(true);
            }
          }
        }
      }
      // all slots in one slice: handed to that compute as they are
      const x = normals(2 * N_EMBD, 7);
      const one = Int32Array.from([5, 6, 11, -1, 7, 8, 9, 10]);
      const w = randomWeights(2, K, 8);
      expect(
        bitsEqual(
          await router.run({ layer: 0, x, ids: one, k: K, w: w, mode: "sum" }),
          await whole.run({ layer: 0, x, ids: one, k: K, w: w, mode: "sum" }),
        ),
      ).toBe(true);
      // what no slice holds is refused with a typed error, as one compute refuses it
      const refused = async (layer: number, ids: Int32Array) => {
        const e = await router.run({ layer, x, ids, k: K, w: w, mode: "sum" }).catch((err) => err);
        expect(isMoeswarmError(e, "MOESWARM_INVALID_ARGUMENT"), String(e)).toBe(true);
        return (e as Error).message;
      };
      expect(await refused(1, Int32Array.from([0, 1, 2, 9, 0, 1, 2, 3]))).toMatch(
        /^expert 9 \(token 0, slot 3\) is not in this slice/,
      );
      expect(await refused(2, one)).toMatch(/^layer 2 is not in this slice \(layers 0, 1\)/);
      expect(await router.run({ layer: 0, x, ids: one, k: K, mode: "sum" }).catch((e) => e)).toMatchObject({
        code: "MOESWARM_INVALID_ARGUMENT",
        message: expect.stringMatching(/needs the router weights/),
      });
    } finally {
      for (const c of computes) await c.close();
    }
  });
});

// llama4 slices: llama.cpp's build_moe_ffn multiplies the expert *input* by the router weight
// (weight_before_ffn) and sums the expert outputs unweighted. The workers take the weighted rows,
// one per (token, slot), with weight 1 (the dispatcher expands them; the plugin reads them from
// llama.cpp's graph), compute the FFN of exactly that row, and refuse any other weight rather than
// apply it after the FFN, which would be a silently wrong llama4 layer.
import { join } from "node:path";
import {
  cosine,
  dispatchFrame,
  type ErrorFrame,
  encodeLengthPrefixed,
  InvalidArgumentError,
  type ResultFrame,
} from "@moeswarm/core";
import { GgmlType } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type ComputeBackend, loadExpertCompute, probeNative } from "../src/index.js";
import { bitsEqual, type Fixture, normals, oracleEach, writeModel, writeSlice } from "./fixtures.js";
import { startWorker } from "./wire.js";
import { binary, missing } from "./worker-exe-fixture.js";

const N_EMBD = 256;
const N_FF = 256;
const N = 6;
const native = await probeNative();
const BACKENDS: ComputeBackend[] = native.available ? ["ts", "native"] : ["ts"];
if (!native.available) console.warn(`llama4 slices: native backend skipped: ${native.message}`);

/** llama4's input rows as llama.cpp's ffn_moe_weighted makes them: fround(sigmoid(logit) * x). */
function weightedRows(seed: number): { x: Float32Array; ids: Int32Array; w: Float32Array } {
  const x = normals(N * N_EMBD, seed);
  const logits = normals(N, seed + 1, 2);
  for (let i = 0; i < N; i++) {
    const w = Math.fround(1 / (1 + Math.exp(-logits[i]!)));
    for (let c = 0; c < N_EMBD; c++) x[i * N_EMBD + c] = Math.fround(w * x[i * N_EMBD + c]!);
  }
  return { x, ids: Int32Array.from({ length: N }, (_, i) => (i * 3) % 4), w: new Float32Array(N).fill(1) };
}

describe("llama4 slices (router weight applied before the expert FFN)", () => {
  const tmp = tempDir("moeswarm-wn-l4-");
  let model: Fixture;
  let slicePath: string;

  beforeAll(async () => {
    model = await writeModel(
      { type: GgmlType.Q4_K, nEmbd: N_EMBD, nFf: N_FF, nExpert: 4, layers: [1], seed: 404, arch: "llama4" },
      tmp.dir,
    );
    slicePath = join(tmp.dir, "llama4-slice.gguf");
    await writeSlice(model, [0, 1, 2, 3], [1], slicePath);
  });
  afterAll(() => tmp.remove());

  for (const backend of BACKENDS) {
    it(`${backend}: loads, computes FFN(w*x) of each weighted row, refuses weights other than 1`, async () => {
      await using compute = await loadExpertCompute(slicePath, { backend, threads: 1 });
      expect(compute.info).toMatchObject({ arch: "llama4", act: "silu", layers: [1] });
      const { x, ids, w } = weightedRows(7);
      const sum = await compute.run({ layer: 1, x, ids, k: 1, w, mode: "sum" });
      const each = await compute.run({ layer: 1, x, ids, k: 1, mode: "each" });
      // weight 1: the sum is each row's output as it is
      expect(bitsEqual(sum, each)).toBe(true);
      // the Q4_K bound of native.test.ts (ggml rounds the activations to q8_K); TS is exact
      const ref = await oracleEach(model, 1, x, ids, 1);
      expect(cosine(sum, ref)).toBeGreaterThan(backend === "ts" ? 0.999999 : 0.9995);
      const half = new Float32Array(N).fill(1);
      half[3] = 0.5;
      await expect(compute.run({ layer: 1, x, ids, k: 1, w: half, mode: "sum" })).rejects.toThrow(
        InvalidArgumentError,
      );
      await expect(compute.run({ layer: 1, x, ids, k: 1, w: half, mode: "sum" })).rejects.toThrow(
        /weight 3 is 0\.5: llama4 weights the expert input/,
      );
    });
  }

  it.skipIf(Boolean(missing))(
    "the executable refuses a weight other than 1 with the request's id",
    async () => {
      const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1", "--model", "m"]);
      await p.peer.frames(2); // hello, register
      const { x, ids, w } = weightedRows(9);
      const half = w.slice();
      half[0] = 0.5;
      const frame = (id: number, weights: Float32Array) =>
        encodeLengthPrefixed(
          dispatchFrame({
            id,
            model: "m",
            layer: 1,
            n: N,
            embd: N_EMBD,
            dtype: "f32",
            x,
            k: 1,
            ids,
            w: weights,
            mode: "sum",
          }),
        );
      p.peer.write(frame(1, half));
      p.peer.write(frame(2, w));
      const [, , refused, answered] = await p.peer.frames(4);
      expect(refused!.frame).toMatchObject({ t: "error", id: 1, code: "MOESWARM_NATIVE_COMPUTE" });
      expect((refused!.frame as ErrorFrame).msg).toMatch(/llama4 weights the expert input/);
      const r = answered!.frame as ResultFrame;
      expect(r).toMatchObject({ t: "result", id: 2, mode: "sum", n: N });
      await using compute = await loadExpertCompute(slicePath, { backend: "ts", threads: 1 });
      const ts = await compute.run({ layer: 1, x, ids, k: 1, w, mode: "sum" });
      expect(cosine(r.y as Float32Array, ts)).toBeGreaterThan(0.9995);
      p.child.stdin.end();
      expect((await p.exit).code).toBe(0);
    },
  );
});

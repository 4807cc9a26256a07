import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { cosine, sumSlots } from "@moeswarm/core";
import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { loadExpertCompute, NativeExpertCompute, probeNative, TsExpertCompute } from "../src/index.js";
import {
  bitsEqual,
  type Fixture,
  normals,
  oracleEach,
  randomIds,
  randomWeights,
  TYPES,
  writeModel,
  writeModelPerType,
  writeSlice,
} from "./fixtures.js";

const N_EMBD = 256;
const N_FF = 256;
const K = 3;
const native = await probeNative();

describe("TypeScript compute path", () => {
  const tmp = tempDir("moeswarm-wn-");
  let models: Map<GgmlType, Fixture>;
  const worst: string[] = [];

  beforeAll(async () => {
    models = await writeModelPerType({ nEmbd: N_EMBD, nFf: N_FF, nExpert: 5, layers: [2] }, 500, tmp.dir);
  });
  afterAll(() => {
    if (worst.length) console.log(`TS path vs f64 oracle, min cosine: ${worst.join(", ")}`);
    tmp.remove();
  });

  it("every type matches the f64 oracle (cosine >= 0.999999: exact activations, f64 sums)", async () => {
    for (const type of TYPES) {
      const model = models.get(type)!;
      await using compute = await loadExpertCompute(model.path, { backend: "ts" });
      expect(compute.info).toMatchObject({
        backend: "ts",
        layers: [2],
        experts: [0, 1, 2, 3, 4],
        nEmbd: N_EMBD,
        nFf: N_FF,
        act: "silu",
      });
      const n = 4;
      const x = normals(n * N_EMBD, 70);
      const ids = randomIds(n, K, [0, 1, 2, 3, 4], 71, 0.2);
      const y = await compute.run({ layer: 2, x, ids, k: K, mode: "each" });
      const ref = await oracleEach(model, 2, x, ids, K);
      let min = 1;
      for (let s = 0; s < n * K; s++) {
        const a = y.subarray(s * N_EMBD, (s + 1) * N_EMBD);
        if (ids[s] === -1) {
          expect(a.every((v) => v === 0)).toBe(true);
          continue;
        }
        min = Math.min(min, cosine(a, ref.subarray(s * N_EMBD, (s + 1) * N_EMBD)));
      }
      worst.push(`${ggmlTypeName(type)} ${min.toFixed(9)}`);
      expect(min, ggmlTypeName(type)).toBeGreaterThanOrEqual(0.999999);
      const w = randomWeights(n, K, 72);
      const sum = await compute.run({ layer: 2, x, ids, k: K, w: w, mode: "sum" });
      expect(bitsEqual(sum, sumSlots(y, w, ids, { n, k: K, embd: N_EMBD }))).toBe(true);
    }
  });

  it("slices, merged gate_up, biases, scales and GELU, with a bounded weight cache", async () => {
    const merged = await writeModel(
      {
        type: GgmlType.Q8_0,
        nEmbd: N_EMBD,
        nFf: N_FF,
        nExpert: 4,
        layers: [0],
        seed: 40,
        merged: true,
        extras: true,
        arch: "gemma4",
      },
      tmp.dir,
    );
    const slicePath = join(tmp.dir, "ts-slice.gguf");
    await writeSlice(merged, [3, 1], [0], slicePath);
    await using compute = await TsExpertCompute.load(slicePath, { cacheBytes: 0 });
    expect(compute.info).toMatchObject({
      experts: [3, 1],
      act: "gelu",
      tensors: [{ merged: true, gate: null, up: "q8_0" }],
    });
    const x = normals(3 * N_EMBD, 41);
    const ids = new Int32Array([3, 1, 1, -1, 3, -1]);
    const y = await compute.run({ layer: 0, x, ids, k: 2, mode: "each" });
    const ref = await oracleEach(merged, 0, x, ids, 2, "gelu");
    expect(cosine(y, ref)).toBeGreaterThan(0.999999);
  });

  it.skipIf(!native.available)("agrees with the native path to ggml's activation rounding", async () => {
    const model = models.get(GgmlType.Q4_K)!;
    await using ts = await loadExpertCompute(model.path, { backend: "ts" });
    await using nat = await NativeExpertCompute.load(model.path, { threads: 2 });
    const x = normals(6 * N_EMBD, 80);
    const ids = randomIds(6, K, [0, 1, 2, 3, 4], 81);
    const w = randomWeights(6, K, 82);
    const a = await ts.run({ layer: 2, x, ids, k: K, w: w, mode: "sum" });
    const b = await nat.run({ layer: 2, x, ids, k: K, w: w, mode: "sum" });
    expect(cosine(a, b)).toBeGreaterThan(0.9995);
  });

  it("refuses bad files and requests with the same typed errors as the native path", async () => {
    const model = models.get(GgmlType.F16)!;
    const cut = join(tmp.dir, "cut.gguf");
    const { readFileSync } = await import("node:fs");
    writeFileSync(cut, readFileSync(model.path).subarray(0, 300));
    await expect(TsExpertCompute.load(cut)).rejects.toMatchObject({
      name: "GgufError",
      code: "MOESWARM_GGUF_TRUNCATED",
    });
    await using compute = await TsExpertCompute.load(model.path);
    await expect(
      compute.run({ layer: 2, x: new Float32Array(N_EMBD), ids: new Int32Array([9]), k: 1, mode: "each" }),
    ).rejects.toMatchObject({
      name: "InvalidArgumentError",
      code: "MOESWARM_INVALID_ARGUMENT",
    });
    await expect(
      compute.run(
        { layer: 2, x: new Float32Array(N_EMBD), ids: new Int32Array([0]), k: 1, mode: "each" },
        { signal: AbortSignal.abort() },
      ),
    ).rejects.toMatchObject({ name: "AbortError" });
    await compute.close();
    await expect(
      compute.run({ layer: 2, x: new Float32Array(N_EMBD), ids: new Int32Array([0]), k: 1, mode: "each" }),
    ).rejects.toMatchObject({ code: "MOESWARM_NATIVE_CLOSED" });
  });

  it('backend "auto" takes native when it loads and says so', async () => {
    await using compute = await loadExpertCompute(models.get(GgmlType.Q8_0)!.path, { threads: 1 });
    expect(compute.info.backend).toBe(native.available ? "native" : "ts");
    await expect(
      loadExpertCompute(models.get(GgmlType.Q8_0)!.path, { backend: "gpu" as never }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
  });
});

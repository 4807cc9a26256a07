import { getEventListeners } from "node:events";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { cosine, sumSlots } from "@moeswarm/core";
import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { loadExpertCompute, NativeExpertCompute, probeNative } from "../src/index.js";
import {
  bitsEqual,
  type Fixture,
  firstBitDiff,
  normals,
  oracleEach,
  randomIds,
  randomWeights,
  TYPES,
  writeModel,
  writeModelPerType,
  writeSlice,
} from "./fixtures.js";

const status = await probeNative();
if (!status.available) {
  if (process.env.CI) throw new Error(`CI must build the native addon:\n${status.message}`);
  console.warn(`skipping the native addon tests:\n${status.message}`);
}

const N_EMBD = 256;
const N_FF = 256; // K-quant rows of the down projection need n_ff to be a multiple of 256
const N_EXPERT = 8;
const K = 4;
const N = 5;

describe.skipIf(!status.available)("native expert compute (N-API addon)", () => {
  const tmp = tempDir("moeswarm-wn-");
  let models: Map<GgmlType, Fixture>;
  const minCosine = new Map<string, string>();

  beforeAll(async () => {
    models = await writeModelPerType(
      { nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layers: [0, 3] },
      100,
      tmp.dir,
    );
  });
  afterAll(() => {
    if (minCosine.size)
      console.log(
        `native vs f64 oracle, min cosine per type: ${JSON.stringify(Object.fromEntries(minCosine))}`,
      );
    tmp.remove();
  });

  // ggml converts the activations to the weights' vec_dot_type before every mul_mat (q8_0, or q8_K
  // for the K-quants: one scale per 256 values), as llama.cpp always does. Against the exact f64
  // oracle that rounding is the whole error: on these Gaussian synthetic models it costs the q8_K
  // types ~2e-4 of cosine on the heavy-tailed SwiGLU output, so their bound on a run's cosine is
  // 0.9995 (0.9999 for the others); against an oracle that applies the same conversion, every
  // type agrees to 1e-6 on every slot.
  for (const type of TYPES) {
    const exactBound = type === GgmlType.Q4_K || type === GgmlType.Q6_K ? 0.9995 : 0.9999;
    it(`${ggmlTypeName(type)}: matches the f64 oracle (run cosine >= ${exactBound}; slot cosine >= 0.999999 with ggml's activation rounding)`, async () => {
      const model = models.get(type)!;
      await using compute = await loadExpertCompute(model.path, { backend: "native", threads: 2 });
      expect(compute.info).toMatchObject({
        backend: "native",
        layers: [0, 3],
        experts: [...Array(N_EXPERT).keys()],
        nEmbd: N_EMBD,
        nFf: N_FF,
        act: "silu",
        arch: "qwen3moe",
      });
      expect(compute.info.tensors[0]).toMatchObject({
        gate: ggmlTypeName(type),
        up: ggmlTypeName(type),
        merged: false,
      });
      let min = 1;
      let minEmulated = 1;
      let global = 1;
      for (const layer of [0, 3]) {
        const x = normals(N * N_EMBD, 7 + layer);
        const ids = randomIds(N, K, [...Array(N_EXPERT).keys()], 11 + layer);
        const y = await compute.run({ layer, x, ids, k: K, mode: "each" });
        const ref = await oracleEach(model, layer, x, ids, K);
        const emu = await oracleEach(model, layer, x, ids, K, "silu", true);
        global = Math.min(global, cosine(y, ref));
        for (let s = 0; s < N * K; s++) {
          const got = y.subarray(s * N_EMBD, (s + 1) * N_EMBD);
          min = Math.min(min, cosine(got, ref.subarray(s * N_EMBD, (s + 1) * N_EMBD)));
          minEmulated = Math.min(minEmulated, cosine(got, emu.subarray(s * N_EMBD, (s + 1) * N_EMBD)));
        }
      }
      minCosine.set(
        ggmlTypeName(type),
        `${min.toFixed(6)} per slot, ${global.toFixed(6)} per run, ${minEmulated.toFixed(8)} emulated`,
      );
      expect(global).toBeGreaterThanOrEqual(exactBound);
      expect(min).toBeGreaterThan(exactBound - 3e-4);
      expect(minEmulated).toBeGreaterThanOrEqual(0.999999);
    });
  }

  for (const type of [GgmlType.Q4_K, GgmlType.Q8_0, GgmlType.F16, GgmlType.Q4_0] as const) {
    it(`${ggmlTypeName(type)}: a slice gives the bits of the monolithic mul_mat_id graph over the full tensors`, async () => {
      const model = models.get(type)!;
      const sliceExperts = [6, 1, 3]; // not ascending: slice order is free
      const slicePath = join(tmp.dir, `slice-${type}.gguf`);
      await writeSlice(model, sliceExperts, [3], slicePath);
      await using full = await NativeExpertCompute.load(model.path, { threads: 2 });
      await using slice = await NativeExpertCompute.load(slicePath, { threads: 1 });
      expect(slice.info).toMatchObject({ layers: [3], experts: sliceExperts });

      const n = 9;
      const x = normals(n * N_EMBD, 21);
      const ids = randomIds(n, K, [...Array(N_EXPERT).keys()], 22);
      const w = randomWeights(n, K, 23);
      const each = await full.runReference({ layer: 3, x, ids, k: K, mode: "each" });
      const sum = await full.runReference({ layer: 3, x, ids, k: K, w: w, mode: "sum" });
      // llama.cpp's own reduction (ggml_mul + ggml_add in slot order) equals the protocol's
      expect(bitsEqual(sum, sumSlots(each, w, ids, { n, k: K, embd: N_EMBD }))).toBe(true);

      // the worker gets only the slots of its experts, the others empty
      const mine = Int32Array.from(ids, (id) => (sliceExperts.includes(id) ? id : -1));
      const part = await slice.run({ layer: 3, x, ids: mine, k: K, mode: "each" });
      let filled = 0;
      for (let s = 0; s < n * K; s++) {
        const got = part.subarray(s * N_EMBD, (s + 1) * N_EMBD);
        if (mine[s] === -1) {
          expect(got.every((v) => Object.is(v, 0))).toBe(true);
          continue;
        }
        filled++;
        const want = each.subarray(s * N_EMBD, (s + 1) * N_EMBD);
        expect(firstBitDiff(got, want), `slot ${s}`).toBe(-1);
      }
      expect(filled).toBeGreaterThan(0);
      // and its weighted partial sum is the protocol's sum over its slots, bit for bit
      const partSum = await slice.run({ layer: 3, x, ids: mine, k: K, w: w, mode: "sum" });
      expect(bitsEqual(partSum, sumSlots(part, w, mine, { n, k: K, embd: N_EMBD }))).toBe(true);
      // all slots in one worker: the sum is llama.cpp's, bit for bit
      const whole = await full.run({ layer: 3, x, ids, k: K, w: w, mode: "sum" });
      expect(bitsEqual(whole, sum)).toBe(true);
    });
  }

  it("loads slices cut by @moeswarm/shard's sliceExperts, with the same bits", async () => {
    const { sliceExperts } = await import("@moeswarm/shard");
    const model = models.get(GgmlType.Q6_K)!;
    const path = join(tmp.dir, "shard-slice.gguf");
    await using cut = await sliceExperts(model.path, { layers: [0], experts: [2, 5, 7] });
    await cut.write(path);
    await using slice = await NativeExpertCompute.load(path, { threads: 1 });
    await using full = await NativeExpertCompute.load(model.path, { threads: 1 });
    expect(slice.info).toMatchObject({ layers: [0], experts: [2, 5, 7], arch: "qwen3moe" });
    const n = 5;
    const x = normals(n * N_EMBD, 90);
    const ids = randomIds(n, K, [...Array(N_EXPERT).keys()], 91);
    const mine = Int32Array.from(ids, (id) => ([2, 5, 7].includes(id) ? id : -1));
    const want = await full.runReference({ layer: 0, x, ids, k: K, mode: "each" });
    const got = await slice.run({ layer: 0, x, ids: mine, k: K, mode: "each" });
    for (let s = 0; s < n * K; s++) {
      if (mine[s] === -1) continue;
      expect(
        firstBitDiff(got.subarray(s * N_EMBD, (s + 1) * N_EMBD), want.subarray(s * N_EMBD, (s + 1) * N_EMBD)),
      ).toBe(-1);
    }
  });

  it("repacks the types llama.cpp repacks on this CPU, and the result does not depend on threads", async () => {
    const model = models.get(GgmlType.Q4_0)!;
    await using repacked = await NativeExpertCompute.load(model.path, { threads: 1 });
    await using plain = await NativeExpertCompute.load(model.path, { threads: 2, repack: false });
    expect(plain.native.tensors.every((t) => !t.repacked)).toBe(true);
    const x = normals(3 * N_EMBD, 5);
    const ids = randomIds(3, K, [...Array(N_EXPERT).keys()], 6);
    const a = await repacked.run({ layer: 0, x, ids, k: K, mode: "each" });
    repacked.setThreads(2);
    const b = await repacked.run({ layer: 0, x, ids, k: K, mode: "each" });
    expect(bitsEqual(a, b)).toBe(true);
    const c = await plain.run({ layer: 0, x, ids, k: K, mode: "each" });
    // repacked kernels sum in another order: close, not necessarily the same bits
    expect(cosine(a, c)).toBeGreaterThan(0.99999);
  });

  it("handles merged gate_up, per-expert biases and scales, GELU, and mixed down types", async () => {
    const merged = await writeModel(
      {
        type: GgmlType.Q8_0,
        nEmbd: N_EMBD,
        nFf: N_FF,
        nExpert: 4,
        layers: [1],
        seed: 900,
        merged: true,
        extras: true,
        arch: "gemma4",
      },
      tmp.dir,
    );
    const scaled = await writeModel(
      {
        type: GgmlType.Q4_K,
        downType: GgmlType.Q6_K,
        nEmbd: N_EMBD,
        nFf: N_FF,
        nExpert: 4,
        layers: [2],
        seed: 950,
        extras: true,
      },
      tmp.dir,
    );
    for (const [model, layer, act] of [
      [merged, 1, "gelu"],
      [scaled, 2, "silu"],
    ] as const) {
      await using compute = await NativeExpertCompute.load(model.path, { threads: 2 });
      expect(compute.info.act).toBe(act);
      expect(compute.native.tensors[0]!.extras).toBeGreaterThan(0);
      const x = normals(4 * N_EMBD, 31);
      const ids = randomIds(4, 2, [0, 1, 2, 3], 32);
      const y = await compute.run({ layer, x, ids, k: 2, mode: "each" });
      const ref = await oracleEach(model, layer, x, ids, 2, act);
      // GELU goes through ggml's f16 lookup table, hence a little less than SiLU
      expect(cosine(y, ref)).toBeGreaterThan(0.9999);
      const mono = await compute.runReference({ layer, x, ids, k: 2, mode: "each" });
      expect(bitsEqual(y, mono)).toBe(true);
    }
  });

  it("reuses cached graphs after other shapes regrew the compute buffer (no stale addresses)", async () => {
    const model = models.get(GgmlType.Q8_0)!;
    await using compute = await NativeExpertCompute.load(model.path, { threads: 2 });
    const small = {
      layer: 0,
      x: normals(2 * N_EMBD, 60),
      ids: randomIds(2, K, [...Array(N_EXPERT).keys()], 61),
      k: K,
      mode: "each" as const,
    };
    const n = 200;
    const large = {
      layer: 3,
      x: normals(n * N_EMBD, 62),
      ids: randomIds(n, K, [...Array(N_EXPERT).keys()], 63),
      k: K,
      mode: "each" as const,
    };
    const a1 = await compute.run(small);
    const r1 = await compute.runReference(small);
    const big1 = await compute.run(large);
    const bigRef = await compute.runReference(large);
    const a2 = await compute.run(small);
    const r2 = await compute.runReference(small);
    const big2 = await compute.run(large);
    expect(bitsEqual(a1, a2) && bitsEqual(r1, r2) && bitsEqual(a1, r1)).toBe(true);
    expect(bitsEqual(big1, big2) && bitsEqual(big1, bigRef)).toBe(true);
  });

  it("runs concurrently submitted requests in order, with the same results as one by one", async () => {
    const model = models.get(GgmlType.Q4_K)!;
    await using compute = await NativeExpertCompute.load(model.path, { threads: 2 });
    const reqs = [0, 1, 2, 3].map((i) => ({
      layer: i % 2 === 0 ? 0 : 3,
      x: normals(2 * N_EMBD, 40 + i),
      ids: randomIds(2, K, [...Array(N_EXPERT).keys()], 50 + i),
      k: K,
      mode: "each" as const,
    }));
    const together = await Promise.all(reqs.map((r) => compute.run(r)));
    for (let i = 0; i < reqs.length; i++)
      expect(bitsEqual(together[i]!, await compute.run(reqs[i]!))).toBe(true);
  });

  it("rejects bad requests with typed errors before they reach ggml, and keeps working", async () => {
    const model = models.get(GgmlType.Q8_0)!;
    await using compute = await NativeExpertCompute.load(model.path, { threads: 1 });
    const x = normals(2 * N_EMBD, 1);
    const ids = new Int32Array([0, 1, 2, 3, 4, 5, 6, 7]);
    const bad = async (req: object, code: string, re: RegExp) => {
      const err = await compute
        .run({ layer: 0, x, ids, k: K, mode: "each", ...req } as never)
        .catch((e: unknown) => e);
      expect(err).toMatchObject({ name: "InvalidArgumentError", code });
      expect(String((err as Error).message)).toMatch(re);
    };
    await bad({ x: new Float32Array(N_EMBD) }, "MOESWARM_INVALID_ARGUMENT", /x holds/);
    await bad({ ids: new Int32Array([0, 1, 2, 99, 4, 5, 6, 7]) }, "MOESWARM_INVALID_ARGUMENT", /expert 99/);
    await bad({ ids: new Int32Array([0, 1, 2, -2, 4, 5, 6, 7]) }, "MOESWARM_INVALID_ARGUMENT", /expert -2/);
    await bad({ layer: 1 }, "MOESWARM_INVALID_ARGUMENT", /layer 1/);
    await bad({ k: 0 }, "MOESWARM_INVALID_ARGUMENT", /k must/);
    await bad({ k: 3 }, "MOESWARM_INVALID_ARGUMENT", /ids holds/);
    await bad({ mode: "sum" }, "MOESWARM_INVALID_ARGUMENT", /router weights/);
    await bad(
      { mode: "sum", w: new Float32Array(8).fill(Number.NaN) },
      "MOESWARM_INVALID_ARGUMENT",
      /not finite/,
    );
    await bad({ x: new Float64Array(2 * N_EMBD) }, "MOESWARM_INVALID_ARGUMENT", /Float32Array/);
    const y = await compute.run({ layer: 0, x, ids, k: K, mode: "each" });
    expect(y.length).toBe(2 * K * N_EMBD);
  });

  it("the addon itself refuses unchecked input with NativeError (defence in depth)", async () => {
    const { requireNative } = await import("../src/native-binding.js");
    const addon = await requireNative();
    const { handle } = await addon.loadSlice(models.get(GgmlType.F16)!.path, { threads: 1 });
    const x = normals(N_EMBD, 2);
    // sync throws (argument checks) and rejections (checks in the worker thread) alike
    const code = async (f: () => Promise<unknown>) => {
      try {
        await f();
        return "ok";
      } catch (e) {
        return (e as { code: string }).code;
      }
    };
    const call = (ids: Int32Array, k: number, xx = x) =>
      code(() => handle.run(0, xx, ids, k, null, 0, false));
    expect(await call(new Int32Array([0, 1, 2, 3]), 4)).toBe("ok");
    expect(await call(new Int32Array([0, 1, 2, 300]), 4)).toBe("MOESWARM_NATIVE_COMPUTE");
    expect(await call(new Int32Array([0, 1, -7, 3]), 4)).toBe("MOESWARM_NATIVE_COMPUTE");
    expect(await call(new Int32Array([0, 1, 2, 3]), 4, new Float32Array(3))).toBe("MOESWARM_NATIVE_COMPUTE");
    expect(await code(() => handle.run(9, x, new Int32Array([0]), 1, null, 0, false))).toBe(
      "MOESWARM_NATIVE_COMPUTE",
    );
    expect(await code(() => handle.run(0, x, new Int32Array([0]), 1, null, 1, false))).toBe(
      "MOESWARM_NATIVE_COMPUTE",
    );
    expect(await code(() => handle.run(0, x, new Int32Array([0]), 0, null, 0, false))).toBe(
      "MOESWARM_INVALID_ARGUMENT",
    );
    const nan = new Float32Array([Number.NaN]);
    expect(await code(() => handle.run(0, x, new Int32Array([0]), 1, nan, 1, false))).toBe(
      "MOESWARM_NATIVE_COMPUTE",
    );
    await handle.close();
    expect(() => handle.run(0, x, new Int32Array([0]), 1, null, 0, false)).toThrow(/closed/);
  });

  it("refuses bad slice files with GgufError and survives", async () => {
    const good = models.get(GgmlType.Q4_0)!;
    const { readFileSync } = await import("node:fs");
    const bytes = readFileSync(good.path);
    const truncated = join(tmp.dir, "truncated.gguf");
    writeFileSync(truncated, bytes.subarray(0, bytes.length - 1000));
    const headerOnly = join(tmp.dir, "header-only.gguf");
    writeFileSync(headerOnly, bytes.subarray(0, 200));
    const garbage = join(tmp.dir, "garbage.gguf");
    writeFileSync(garbage, Buffer.from("this is not a gguf file at all, just text"));
    const notMoe = join(tmp.dir, "not-moe.gguf");
    const { writeGguf, ggufValue } = await import("@moeswarm/shard");
    await writeGguf(
      {
        metadata: { "general.architecture": ggufValue.str("llama") },
        tensors: [{ name: "token_embd.weight", type: GgmlType.F32, shape: [4, 2], data: new Uint8Array(32) }],
      },
      notMoe,
    );
    const cases: Array<[string, string]> = [
      [truncated, "MOESWARM_GGUF_TRUNCATED"],
      [headerOnly, "MOESWARM_GGUF_TRUNCATED"],
      [garbage, "MOESWARM_GGUF_BAD_MAGIC"],
      [notMoe, "MOESWARM_GGUF_NOT_MOE"],
      [join(tmp.dir, "missing.gguf"), "MOESWARM_GGUF_IO"],
    ];
    for (const [path, code] of cases) {
      const err = await NativeExpertCompute.load(path).catch((e: unknown) => e);
      expect(err, path).toMatchObject({ name: "GgufError", code });
    }
    await using ok = await NativeExpertCompute.load(good.path, { threads: 1 });
    expect(ok.info).toMatchObject({ layers: [0, 3], device: "CPU" });
    // a CPU-only build has no GPU to offer: a clear refusal, not a silent CPU run
    await expect(NativeExpertCompute.load(good.path, { device: "gpu" })).rejects.toMatchObject({
      name: "NativeError",
      code: "MOESWARM_NATIVE_LOAD",
      message: expect.stringMatching(/no ggml device gpu in this build \(devices: CPU\)/),
    });
  });

  it("abort: already aborted, aborted while running (listener removed), and later runs still work", async () => {
    const model = models.get(GgmlType.F32)!;
    await using compute = await NativeExpertCompute.load(model.path, { threads: 1 });
    const x = normals(2 * N_EMBD, 3);
    const ids = randomIds(2, K, [...Array(N_EXPERT).keys()], 4);
    const already = AbortSignal.abort(new Error("stop"));
    await expect(compute.run({ layer: 0, x, ids, k: K, mode: "each" }, { signal: already })).rejects.toThrow(
      "stop",
    );

    const big = 4096;
    const bx = normals(big * N_EMBD, 8);
    const bids = randomIds(big, K, [...Array(N_EXPERT).keys()], 9);
    const ctl = new AbortController();
    const running = compute.run({ layer: 0, x: bx, ids: bids, k: K, mode: "each" }, { signal: ctl.signal });
    setTimeout(() => ctl.abort(new Error("user abort")), 5);
    await expect(running).rejects.toThrow("user abort");
    expect(getEventListeners(ctl.signal, "abort")).toHaveLength(0);

    const ctl2 = new AbortController();
    const y = await compute.run({ layer: 0, x, ids, k: K, mode: "each" }, { signal: ctl2.signal });
    expect(getEventListeners(ctl2.signal, "abort")).toHaveLength(0);
    expect(y.length).toBe(2 * K * N_EMBD);
  });

  it("close: idempotent, later runs reject with MOESWARM_NATIVE_CLOSED", async () => {
    const compute = await NativeExpertCompute.load(models.get(GgmlType.BF16)!.path, { threads: 1 });
    const x = normals(N_EMBD, 3);
    const pending = compute.run({ layer: 0, x, ids: new Int32Array([0, 1, 2, 3]), k: K, mode: "each" });
    await compute.close();
    await compute.close();
    expect((await pending).length).toBe(K * N_EMBD);
    await expect(
      compute.run({ layer: 0, x, ids: new Int32Array([0, 1, 2, 3]), k: K, mode: "each" }),
    ).rejects.toMatchObject({
      name: "NativeError",
      code: "MOESWARM_NATIVE_CLOSED",
    });
  });
});

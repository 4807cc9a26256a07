// The native benchmarks' shared set-up: the requests are what compute-call and expert-compute
// measure (k distinct experts a token, by their model ids), and the slice is one the worker loads
// and computes the same through the addon and the pure-TypeScript path (which dequantises with
// shard's own code, not ggml's).
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cosine } from "@moeswarm/core";
import { GgmlType, plainValue, readGguf } from "@moeswarm/shard";
import { NativeExpertCompute, TsExpertCompute } from "@moeswarm/worker-native";
import { describe, expect, it } from "vitest";
import { nativeOrSkip, type SliceSpec, sliceRequest, writeExpertSlice } from "../src/native-slice.js";

const SPEC: SliceSpec = {
  type: GgmlType.Q8_0,
  nEmbd: 64,
  nFf: 32,
  nExpert: 6,
  layer: 2,
  idStride: 16,
  name: "native-slice-test",
};

describe("native-slice", () => {
  it("sliceRequest: k distinct experts of the slice a token, by model id, weight 1/k, seeded", () => {
    const k = 4;
    const r = sliceRequest(SPEC, 5, k, 11);
    expect(r).toMatchObject({ layer: 2, k, mode: "sum" });
    expect(r.x.length).toBe(5 * 64);
    expect(r.x.every((v) => v >= -1 && v < 1)).toBe(true);
    expect([...r.w]).toEqual(new Array(5 * k).fill(1 / k));
    const models = new Set<number>();
    for (let i = 0; i < 5; i++) {
      const ids = [...r.ids.subarray(i * k, (i + 1) * k)];
      expect(new Set(ids).size).toBe(k);
      for (const id of ids) {
        expect(id % 16 === 0 && id >= 0 && id < 6 * 16).toBe(true);
        models.add(id);
      }
    }
    expect(models.size).toBeGreaterThan(k); // tokens do not all draw the same experts
    // the same seed, the same request; another seed, another
    const again = sliceRequest(SPEC, 5, k, 11);
    expect([again.ids, again.x]).toEqual([r.ids, r.x]);
    expect(sliceRequest(SPEC, 5, k, 12).x).not.toEqual(r.x);
    // stride 1 (the default): the slice's first experts
    const plain = sliceRequest({ nEmbd: 64, nExpert: 6, layer: 0 }, 3, k, 11);
    expect(plain.ids.every((id) => id >= 0 && id < 6)).toBe(true);
  });

  it("writeExpertSlice: a slice the addon and the TypeScript path load and compute alike", async (ctx) => {
    const probe = await nativeOrSkip();
    if (probe.skipped) {
      // the slice's weights are quantised by the addon: nothing to write without it
      console.warn(`skipping: ${probe.skipped.notes?.[0]}`);
      ctx.skip();
    }
    const dir = mkdtempSync(join(tmpdir(), "moeswarm-bench-slice-"));
    try {
      const path = join(dir, "slice.gguf");
      await writeExpertSlice(path, SPEC);
      const header = await readGguf(path);
      const meta = Object.fromEntries([...header.metadata].map(([key, v]) => [key, plainValue(v)]));
      expect(meta).toMatchObject({
        "general.architecture": "qwen35moe",
        "general.name": "native-slice-test",
        "moeswarm.slice.layers": Uint32Array.of(2),
        "moeswarm.slice.experts": Uint32Array.of(0, 16, 32, 48, 64, 80),
      });
      expect(header.tensors.map((t) => [t.name, t.type, t.shape])).toEqual([
        ["blk.2.ffn_gate_exps.weight", GgmlType.Q8_0, [64, 32, 6]],
        ["blk.2.ffn_up_exps.weight", GgmlType.Q8_0, [64, 32, 6]],
        ["blk.2.ffn_down_exps.weight", GgmlType.Q8_0, [32, 64, 6]],
      ]);
      const req = sliceRequest(SPEC, 3, 4, 5);
      const native = await NativeExpertCompute.load(path, { threads: 1 });
      const ts = await TsExpertCompute.load(path);
      try {
        const [a, b] = [await native.run(req), await ts.run(req)];
        expect(a.length).toBe(3 * 64);
        expect(a.some((v) => v !== 0)).toBe(true);
        expect(cosine(a, b)).toBeGreaterThan(0.9999);
      } finally {
        await native.close();
        await ts.close();
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

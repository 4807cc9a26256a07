// Activations on the wire in the weights' vec_dot_type: the rows the sender converts with
// ggml-cpu's from_float (the addon's quantizeActivations) give the same result bits as the f32
// rows ggml converts itself, per weight type, with llama.cpp's repacking and without; a layer that
// cannot take them (f16 weights, gate and up of different vec_dot types) refuses them with
// MOESWARM_NATIVE_WIRE_DTYPE; a repacked layer refuses a row that does not round-trip
// (MOESWARM_NATIVE_WIRE_INEXACT). The llama-cpu executable (llama.cpp's own CPU backend) too.

import { GgmlType, ggmlTypeName, writeGguf } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  type ExpertCompute,
  llamaExpertWorkerPath,
  loadExpertCompute,
  type NativeExpertCompute,
  spawnLlamaExpertWorker,
} from "../src/index.js";
import type { NativeAddon } from "../src/native-binding.js";
import {
  type Fixture,
  firstBitDiff,
  nativeAddon,
  normals,
  randomIds,
  randomWeights,
  writeModel,
} from "./fixtures.js";

const N_EMBD = 512;
const N_FF = 256;
const N_EXPERT = 8;
const K = 4;
const N = 12;

const addon = await nativeAddon();
const missing = addon === undefined ? "the native addon is not built" : undefined;
if (missing) console.warn(`skipping the q8 wire tests: ${missing}`);

interface Case {
  name: string;
  type: GgmlType;
  /** The wire type the layer must report (null: f32 only). */
  wire: "q8_0" | "q8_K" | null;
  downType?: GgmlType;
}

const CASES: Case[] = [
  { name: "Q4_K", type: GgmlType.Q4_K, wire: "q8_K" },
  { name: "Q8_0", type: GgmlType.Q8_0, wire: "q8_0" },
  { name: "Q4_0", type: GgmlType.Q4_0, wire: "q8_0" },
  { name: "Q6_K", type: GgmlType.Q6_K, wire: "q8_K" },
  { name: "Q4_K gate/up, Q6_K down", type: GgmlType.Q4_K, wire: "q8_K", downType: GgmlType.Q6_K },
  { name: "F16 (stays f32)", type: GgmlType.F16, wire: null },
];

type Wire = "q8_0" | "q8_K";

function rowsOf(q: Uint8Array, n: number): Uint8Array[] {
  const row = q.length / n;
  return Array.from({ length: n }, (_, i) => q.subarray(i * row, (i + 1) * row));
}

async function codeOf(p: Promise<unknown>): Promise<string | undefined> {
  try {
    await p;
    return undefined;
  } catch (error) {
    return (error as { code?: string }).code ?? String(error);
  }
}

/** f32 run vs q8 run, modes each and sum: the same bits, or (repacked) the refusal the check predicts. */
async function expectSameBits(
  c: ExpertCompute,
  a: NativeAddon,
  wire: Wire,
  seed: number,
): Promise<"same" | "refused"> {
  const x = normals(N * N_EMBD, seed);
  const ids = randomIds(N, K, [...Array(N_EXPERT).keys()], seed + 1, 0.15);
  const w = randomWeights(N, K, seed + 2);
  const q = a.quantizeActivations!(wire, x, N_EMBD);
  const each32 = await c.run({ layer: 0, x, ids, k: K, mode: "each" });
  const sum32 = await c.run({ layer: 0, x, ids, k: K, w, mode: "sum" });
  const repacked = (c as NativeExpertCompute).native?.tensors[0]?.repacked === true;
  const roundTrips = rowsOf(q, N).every((r) => a.activationsRoundTrip!(wire, r, N_EMBD));
  if (repacked && !roundTrips) {
    expect(await codeOf(c.run({ layer: 0, x: q, xType: wire, ids, k: K, mode: "each" }))).toBe(
      "MOESWARM_NATIVE_WIRE_INEXACT",
    );
    return "refused";
  }
  const eachQ = await c.run({ layer: 0, x: q, xType: wire, ids, k: K, mode: "each" });
  const sumQ = await c.run({ layer: 0, x: q, xType: wire, ids, k: K, w, mode: "sum" });
  expect(firstBitDiff(eachQ, each32)).toBe(-1);
  expect(firstBitDiff(sumQ, sum32)).toBe(-1);
  // not vacuous: another row order gives other bits
  expect(
    firstBitDiff(eachQ, await c.run({ layer: 0, x: x.slice().reverse(), ids, k: K, mode: "each" })),
  ).not.toBe(-1);
  return "same";
}

describe.skipIf(Boolean(missing))(
  "q8 activations on the wire: bit-identical to f32 through the addon",
  () => {
    const tmp = tempDir("msw-q8wire-");
    const models = new Map<string, Fixture>();
    afterAll(() => tmp.remove());
    beforeAll(async () => {
      for (const [i, c] of CASES.entries()) {
        models.set(
          c.name,
          await writeModel(
            {
              type: c.type,
              nEmbd: N_EMBD,
              nFf: N_FF,
              nExpert: N_EXPERT,
              layers: [0],
              seed: 900 + 10 * i,
              ...(c.downType !== undefined ? { downType: c.downType } : {}),
            },
            tmp.dir,
          ),
        );
      }
    });

    for (const c of CASES) {
      for (const repack of [false, true]) {
        it(`${c.name}, repack ${repack}`, async () => {
          const a = addon as NativeAddon;
          await using compute = await loadExpertCompute(models.get(c.name)!.path, {
            backend: "native",
            threads: 2,
            repack,
          });
          const info = (compute as NativeExpertCompute).native.tensors[0]!;
          expect(info.wire ?? null).toBe(c.wire);
          expect(a.wireActivationType!(ggmlTypeName(c.type))).toBe(c.wire);
          if (c.wire === null) {
            const q = a.quantizeActivations!("q8_0", normals(N * N_EMBD, 1), N_EMBD);
            const ids = randomIds(N, K, [...Array(N_EXPERT).keys()], 2, 0);
            expect(
              await codeOf(compute.run({ layer: 0, x: q, xType: "q8_0", ids, k: K, mode: "each" })),
            ).toBe("MOESWARM_NATIVE_WIRE_DTYPE");
            return;
          }
          // the other q8 type is refused
          const other: Wire = c.wire === "q8_0" ? "q8_K" : "q8_0";
          const qo = a.quantizeActivations!(other, normals(N * N_EMBD, 3), N_EMBD);
          const ids = randomIds(N, K, [...Array(N_EXPERT).keys()], 4, 0);
          expect(await codeOf(compute.run({ layer: 0, x: qo, xType: other, ids, k: K, mode: "each" }))).toBe(
            "MOESWARM_NATIVE_WIRE_DTYPE",
          );
          const outcomes = [];
          for (let s = 0; s < 6; s++) outcomes.push(await expectSameBits(compute, a, c.wire, 100 + 7 * s));
          // q8_0 always round-trips; a non-repacked layer never refuses; a repacked q8_K one rarely
          if (!info.repacked || c.wire === "q8_0") expect(outcomes.every((o) => o === "same")).toBe(true);
          else expect(outcomes.filter((o) => o === "same").length).toBeGreaterThanOrEqual(4);
          if (
            repack &&
            (c.type === GgmlType.Q4_0 || c.type === GgmlType.Q4_K) &&
            a.cpuFeatures.includes("avx2")
          )
            expect(info.repacked).toBe(true);
        });
      }
    }

    it("gate and up of different vec_dot types (Q4_0 gate, Q4_K up) stay f32", async () => {
      const a = addon as NativeAddon;
      const q40 = models.get("Q4_0")!;
      const q4k = models.get("Q4_K")!;
      const pick = (m: Fixture, name: string) => m.tensors.get(name)!;
      const path = `${tmp.dir}/mixed-gate-up.gguf`;
      await writeGguf(
        {
          metadata: new Map(),
          tensors: [
            pick(q40, "blk.0.ffn_gate_exps.weight"),
            pick(q4k, "blk.0.ffn_up_exps.weight"),
            pick(q4k, "blk.0.ffn_down_exps.weight"),
          ].map((t) => ({ name: t.name, type: t.type, shape: t.shape, data: t.data })),
        },
        path,
      );
      await using compute = await loadExpertCompute(path, { backend: "native", threads: 2 });
      expect((compute as NativeExpertCompute).native.tensors[0]!.wire ?? null).toBeNull();
      const ids = randomIds(N, K, [...Array(N_EXPERT).keys()], 5, 0);
      for (const wire of ["q8_0", "q8_K"] as const) {
        const q = a.quantizeActivations!(wire, normals(N * N_EMBD, 6), N_EMBD);
        expect(await codeOf(compute.run({ layer: 0, x: q, xType: wire, ids, k: K, mode: "each" }))).toBe(
          "MOESWARM_NATIVE_WIRE_DTYPE",
        );
      }
    });

    it("a crafted q8_0 row that does not round-trip: refused on repacked Q4_0, taken as it is on plain Q8_0", async () => {
      const a = addon as NativeAddon;
      // every block: d = 1.0 (f16 0x3c00), every q = 1: from f32 it would be d = 1/127, q = 127
      const row = new Uint8Array((N_EMBD / 32) * 34);
      for (let b = 0; b < N_EMBD / 32; b++) {
        row[b * 34] = 0x00;
        row[b * 34 + 1] = 0x3c;
        row.fill(1, b * 34 + 2, b * 34 + 34);
      }
      expect(a.activationsRoundTrip!("q8_0", row, N_EMBD)).toBe(false);
      const ids = new Int32Array([0, 1, 2, 3]);
      await using repacked = await loadExpertCompute(models.get("Q4_0")!.path, {
        backend: "native",
        threads: 1,
        repack: true,
      });
      if ((repacked as NativeExpertCompute).native.tensors[0]!.repacked) {
        expect(await codeOf(repacked.run({ layer: 0, x: row, xType: "q8_0", ids, k: K, mode: "each" }))).toBe(
          "MOESWARM_NATIVE_WIRE_INEXACT",
        );
      } else console.warn("this CPU does not repack Q4_0: the refusal is not exercised");
      await using plain = await loadExpertCompute(models.get("Q8_0")!.path, {
        backend: "native",
        threads: 1,
        repack: false,
      });
      const y = await plain.run({ layer: 0, x: row, xType: "q8_0", ids, k: K, mode: "each" });
      expect(y.every(Number.isFinite)).toBe(true);
    });

    it("how often q8 rows do not round-trip (normal activations, 1024 rows of 2048)", () => {
      const a = addon as NativeAddon;
      const embd = 2048;
      const n = 1024;
      const x = normals(n * embd, 77);
      const rate: Record<string, number> = {};
      for (const wire of ["q8_0", "q8_K"] as const) {
        const q = a.quantizeActivations!(wire, x, embd);
        expect(x.byteLength / q.byteLength).toBeGreaterThan(3.5);
        rate[wire] = rowsOf(q, n).filter((r) => !a.activationsRoundTrip!(wire, r, embd)).length / n;
      }
      console.log(`rows that do not round-trip: q8_0 ${rate.q8_0}, q8_K ${rate.q8_K}`);
      expect(rate.q8_0).toBe(0);
      // plain dequantisation misses about one q8_K block in ten (its scale one ulp off: 64% of these
      // rows); nudging each block's largest value leaves ~2% of the rows
      expect(rate.q8_K).toBeLessThan(0.1);
      // ggml_quantize_chunk has no q8_K: the reference quantiser refuses it rather than abort the process
      let code: string | undefined;
      try {
        a.quantize("q8_K", x.subarray(0, embd), embd);
      } catch (error) {
        code = (error as { code?: string }).code;
      }
      expect(code).toBe("MOESWARM_INVALID_ARGUMENT");
    });
  },
);

let llamaMissing: string | undefined;
try {
  llamaExpertWorkerPath();
} catch (error) {
  llamaMissing = (error as Error).message;
}

describe.skipIf(Boolean(missing) || Boolean(llamaMissing))("q8 rows through the llama-cpu executable", () => {
  const tmp = tempDir("msw-q8wire-llama-");
  afterAll(() => tmp.remove());

  it("Q4_K and Q8_0 slices: q8 frames give the f32 frames' bits", async () => {
    const a = addon as NativeAddon;
    for (const [type, wire] of [
      [GgmlType.Q4_K, "q8_K"],
      [GgmlType.Q8_0, "q8_0"],
    ] as const) {
      const m = await writeModel(
        { type, nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layers: [0], seed: 31 + type },
        tmp.dir,
      );
      const worker = await spawnLlamaExpertWorker(m.path, { threads: 1 });
      try {
        const x = normals(N * N_EMBD, 8);
        const ids = randomIds(N, K, [...Array(N_EXPERT).keys()], 9, 0.15);
        const q = a.quantizeActivations!(wire, x, N_EMBD);
        const y32 = await worker.run({ layer: 0, x, ids, k: K, mode: "each" });
        if (!rowsOf(q, N).every((r) => a.activationsRoundTrip!(wire, r, N_EMBD))) {
          // llama.cpp repacks Q4_K here (AVX2): a row that does not round-trip is refused, or taken
          const code = await codeOf(worker.run({ layer: 0, x: q, xType: wire, ids, k: K, mode: "each" }));
          expect([undefined, "MOESWARM_NATIVE_WIRE_INEXACT"]).toContain(code);
          continue;
        }
        const yq = await worker.run({ layer: 0, x: q, xType: wire, ids, k: K, mode: "each" });
        expect(firstBitDiff(yq, y32)).toBe(-1);
      } finally {
        await worker.close();
      }
    }
  });
});

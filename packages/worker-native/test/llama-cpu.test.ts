// The "llama-cpu" build: the compute core against node-llama-cpp's shared ggml, computing with the
// CPU backend library llama.cpp itself loads on this machine. Its sharded per-expert outputs must
// equal, bit for bit, one monolithic MUL_MAT_ID graph over the whole tensors (build_moe_ffn's, on
// the same library), and its sums the weighting MUL and ADDs of that graph.

import { execFileSync } from "node:child_process";
import { readFileSync, realpathSync } from "node:fs";
import { join } from "node:path";
import { sumSlots } from "@moeswarm/core";
import { GgmlType } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  llamaCppBinsDir,
  llamaCpuAddonPath,
  llamaExpertWorkerPath,
  loadExpertCompute,
  loadLlamaCpuCompute,
  spawnLlamaExpertWorker,
} from "../src/index.js";
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

let missing: string | undefined;
let binsDir = "";
try {
  llamaExpertWorkerPath();
  binsDir = llamaCppBinsDir();
} catch (error) {
  missing = (error as Error).message;
}
if (missing) {
  if (process.env.CI && process.platform === "linux" && process.arch === "x64") {
    throw new Error(`CI must build moeswarm-expert-worker-llama: ${missing}`);
  }
  console.warn(`skipping the llama-cpu tests: ${missing}`);
}

const N_EMBD = 256;
const N_FF = 256;
const N_EXPERT = 16;
const K = 4;
const N = 7;

// Q4_0 and Q8_0 go to CPU_REPACK on x86 (as in llama.cpp), F16 and Q4_K stay plain
const CASES = [
  { name: "Q8_0", type: GgmlType.Q8_0 },
  { name: "Q4_0", type: GgmlType.Q4_0 },
  { name: "Q4_K/Q6_K", type: GgmlType.Q4_K, downType: GgmlType.Q6_K },
  { name: "F16", type: GgmlType.F16 },
] as const;

describe.skipIf(Boolean(missing))("llama-cpu expert compute (moeswarm-expert-worker-llama)", () => {
  const tmp = tempDir("moeswarm-wn-llama-");
  afterAll(() => tmp.remove());

  it("loads node-llama-cpp's best CPU backend library, not this package's static ggml", () => {
    const out = execFileSync(llamaExpertWorkerPath(), ["--version"], {
      encoding: "utf8",
      env: { ...process.env, LD_LIBRARY_PATH: binsDir },
    });
    expect(out).toMatch(/ggml: llama-shared/);
    expect(out).toMatch(/devices: CPU/);
  });

  for (const c of CASES) {
    describe(c.name, () => {
      let model: Fixture;
      const halves = [
        [0, 2, 4, 6, 8, 10, 12, 14],
        [1, 3, 5, 7, 9, 11, 13, 15],
      ];
      beforeAll(async () => {
        model = await writeModel(
          {
            type: c.type,
            ...("downType" in c ? { downType: c.downType } : {}),
            nEmbd: N_EMBD,
            nFf: N_FF,
            nExpert: N_EXPERT,
            layers: [0, 3],
            seed: 11,
          },
          tmp.dir,
        );
        for (const [i, experts] of halves.entries()) {
          await writeSlice(model, experts, [0, 3], join(tmp.dir, `${c.type}-half${i}.gguf`));
        }
      });

      it("sharded per-expert outputs equal the monolithic MUL_MAT_ID, and sums its MUL + ADDs", async () => {
        await using reference = await spawnLlamaExpertWorker(model.path, { threads: 1, reference: true });
        await using a = await loadExpertCompute(join(tmp.dir, `${c.type}-half0.gguf`), {
          backend: "llama-cpu",
          threads: 1,
        });
        // the other half in a child process: the addon in this process and the executable agree
        await using b = await loadExpertCompute(join(tmp.dir, `${c.type}-half1.gguf`), {
          backend: "llama-cpu",
          llamaProcess: true,
          threads: 1,
        });
        expect(a.info).toMatchObject({ backend: "native", device: "llama-cpu", experts: halves[0] });
        expect(b.info).toMatchObject({ backend: "worker", device: "llama-cpu", experts: halves[1] });
        expect(reference.info.device).toBe("llama-cpu");

        const x = normals(N * N_EMBD, 5);
        const ids = randomIds(N, K, [...Array(N_EXPERT).keys()], 9);
        const w = randomWeights(N, K, 3);
        for (const layer of [0, 3]) {
          const whole = await reference.run({ layer, x, ids, k: K, mode: "each" });
          // each half computes its own slots; the rest are empty (-1) and come back as zeros
          const mine = (owned: number[]) => ids.map((e) => (owned.includes(e) ? e : -1));
          const ya = await a.run({ layer, x, ids: mine(halves[0]!), k: K, mode: "each" });
          const yb = await b.run({ layer, x, ids: mine(halves[1]!), k: K, mode: "each" });
          const merged = new Float32Array(whole.length);
          for (let s = 0; s < N * K; s++) {
            const from = halves[0]!.includes(ids[s]!) ? ya : yb;
            merged.set(from.subarray(s * N_EMBD, (s + 1) * N_EMBD), s * N_EMBD);
          }
          expect(firstBitDiff(merged, whole)).toBe(-1);
          expect(merged.some((v) => v !== 0)).toBe(true);

          // the f32 combine in slot order is ggml's weighting MUL and ADDs, bit for bit
          const sum = await reference.run({ layer, x, ids, k: K, w: w, mode: "sum" });
          const combined = sumSlots(merged, w, ids, { n: N, k: K, embd: N_EMBD });
          expect(bitsEqual(combined, sum)).toBe(true);
        }
      });
    });
  }

  it("the in-process addon shares node-llama-cpp's ggml: one libggml-base in the process", async () => {
    expect(llamaCpuAddonPath()).toBeDefined();
    const model = await writeModel(
      { type: GgmlType.Q8_0, nEmbd: 64, nFf: 64, nExpert: 4, layers: [0], seed: 3 },
      tmp.dir,
    );
    await using c = await loadLlamaCpuCompute(model.path, { threads: 1 });
    expect(c.info.device).toBe("llama-cpu");
    const maps = readFileSync("/proc/self/maps", "utf8");
    const bases = new Set(
      maps
        .split("\n")
        .map((l) => l.slice(l.indexOf("/")))
        .filter((p) => p.endsWith("/libggml-base.so")),
    );
    expect([...bases].map((p) => realpathSync(p))).toEqual([realpathSync(join(binsDir, "libggml-base.so"))]);
    const y = await c.run({ layer: 0, x: normals(64, 1), ids: new Int32Array([0, 3]), k: 2, mode: "each" });
    expect(y.length).toBe(128);
    expect(y.some((v) => v !== 0)).toBe(true);
  });

  it("refuses a missing bins directory with a clear error", async () => {
    await expect(
      spawnLlamaExpertWorker(join(tmp.dir, "nothing.gguf"), { binsDir: join(tmp.dir, "no-such-dir") }),
    ).rejects.toMatchObject({ code: "MOESWARM_NATIVE_LOAD", message: /libggml-base\.so/ });
  });
});

// A slice whose layers each have another ggml type (as a Q4_K_M model mixes them), run many times
// in one worker process: every layer's graphs are built, cached, evicted and rebuilt while the
// others' weights and the shared compute buffer stay in place. The CPU path (node-llama-cpp's CPU
// libggml) always runs; the Vulkan path (lavapipe) runs with MOESWARM_VK_MIXED=1 only, because that
// process dies of heap corruption there (issue #19, see the comment on the Vulkan block).

import { cosine, sumSlots } from "@moeswarm/core";
import { type GgufMetadataValue, ggmlTypeName, ggufValue, writeGguf } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  type ExpertCompute,
  llamaExpertWorkerPath,
  loadExpertCompute,
  spawnLlamaExpertWorker,
} from "../src/index.js";
import {
  type Fixture,
  type FixtureTensor,
  nativeAddon,
  normals,
  oracleEach,
  randomIds,
  randomWeights,
  TYPES,
  writeModel,
} from "./fixtures.js";

const N_EMBD = 256;
const N_FF = 256;
const N_EXPERT = 8;
const K = 4;
const ITERS = 3;

let missing: string | undefined;
try {
  llamaExpertWorkerPath();
} catch (error) {
  missing = (error as Error).message;
}
if (missing) {
  if (process.env.CI && process.platform === "linux" && process.arch === "x64") {
    throw new Error(`CI must build moeswarm-expert-worker-llama: ${missing}`);
  }
  console.warn(`skipping the mixed-type tests: ${missing}`);
}

/** Layer i holds TYPES[i] (f32, f16, bf16, q8_0, q4_0, q4_K, q6_K), all in one file. */
async function writeMixed(dir: string): Promise<Fixture> {
  const tensors = new Map<string, FixtureTensor>();
  for (const [il, type] of TYPES.entries()) {
    const m = await writeModel(
      { type, nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layers: [il], seed: 500 + il },
      dir,
    );
    for (const [name, t] of m.tensors) tensors.set(name, t);
  }
  const metadata = new Map<string, GgufMetadataValue>();
  metadata.set("general.architecture", ggufValue.str("qwen3moe"));
  const path = `${dir}/mixed.gguf`;
  await writeGguf({ metadata, tensors: [...tensors.values()] }, path);
  const spec = {
    type: TYPES[0],
    nEmbd: N_EMBD,
    nFf: N_FF,
    nExpert: N_EXPERT,
    layers: [...TYPES.keys()],
    seed: 500,
  };
  return { spec, path, tensors, dir, cleanup: () => {} };
}

// every layer, ITERS times over, at n = 1 and 8 with 20% empty slots (new row counts each pass, so
// graphs are rebuilt and the cache of 16 evicts); each run checked against the f64 oracle
// `samePerPass`: every pass sends the first pass's inputs, so after it every run hits a cached graph
// (14 graphs, no eviction, no new graph, no compute buffer growth): a diagnostic for the Vulkan crash
async function runAll(
  compute: ExpertCompute,
  model: Fixture,
  bound: number,
  samePerPass = false,
): Promise<void> {
  for (let it = 0; it < ITERS; it++) {
    const seed = samePerPass ? 0 : 10 * it;
    for (const layer of TYPES.keys()) {
      for (const n of [1, 8]) {
        const x = normals(n * N_EMBD, 41 + n + seed);
        const ids = randomIds(n, K, [...Array(N_EXPERT).keys()], 42 + n + seed, 0.2);
        const w = randomWeights(n, K, 43 + n + seed);
        const y = await compute.run({ layer, x, ids, k: K, mode: "each" });
        const sum = await compute.run({ layer, x, ids, k: K, w, mode: "sum" });
        const ref = await oracleEach(model, layer, x, ids, K);
        const c = cosine(y, ref);
        expect(c, `${ggmlTypeName(TYPES[layer]!)} (layer ${layer}) pass ${it} n ${n}`).toBeGreaterThanOrEqual(
          bound,
        );
        expect(cosine(sum, sumSlots(y, w, ids, { n, k: K, embd: N_EMBD }))).toBeGreaterThan(0.99999);
      }
    }
  }
}

describe.skipIf(Boolean(missing))("a slice with another ggml type per layer", () => {
  const tmp = tempDir("moeswarm-wn-mixed-");
  let model: Fixture;
  beforeAll(async () => {
    model = await writeMixed(tmp.dir);
  });
  afterAll(() => tmp.remove());

  it("llama-cpu worker: every layer matches the f64 oracle, pass after pass, in one process", async () => {
    await using compute = await spawnLlamaExpertWorker(model.path, { threads: 1 });
    await runAll(compute, model, 0.9995);
  }, 120_000);

  it("native addon (static ggml, CPU): every layer matches the f64 oracle, pass after pass", async (ctx) => {
    if (!(await nativeAddon())) {
      console.warn("skipping the addon's mixed-type run: the N-API addon is not built");
      ctx.skip();
    }
    await using compute = await loadExpertCompute(model.path, { backend: "native", threads: 1 });
    await runAll(compute, model, 0.9995);
  }, 120_000);

  // Reproduces issue #19's crash: on lavapipe this process dies (SIGABRT "corrupted double-linked
  // list" / "unsorted double linked list corrupted" / "double free or corruption (!prev)", or
  // SIGSEGV in a libvulkan_lvp.so queue thread inside ggml_vk_synchronize) in its second pass over
  // the layers, in most runs; layers 0..5 alone (no q6_K) crash too, layer 6 alone did not. Not
  // yet fixed: run it with MOESWARM_VK_MIXED=1. Found so far: reserving the graph allocator's
  // layout for every graph switch does not help (3 of 5 runs still crashed), while
  // MOESWARM_VK_MIXED=same (the first pass's inputs again: only cached graphs after it) passed 3 of
  // 3, and so did new activations each pass with the first pass's ids (same graphs), 3 of 3, while
  // the unchanged test crashed 3 of 3: the crash needs graphs built (and others evicted, the compute
  // buffer regrown) after the first pass, not new data. 2026-12-01, 5 runs each, same binary with
  // env switches (moeswarm-expert-worker-llama, lavapipe): unchanged 3 of 5 crashed; a graph cache
  // with no eviction still crashed 2 of 5 (so not freeing an evicted graph); ggml_backend_synchronize
  // before every graph free and every gallocr allocation still crashed 3 of 5 (so not work in
  // flight); ggml_gallocr_reserve up front of every layer's 32-row graph (the test's largest, so the
  // compute buffer never grows afterwards) passed 10 of 10, while the same with a 1-row graph (the
  // buffer still grows) crashed 1 of 5. Lead: growing (freeing and reallocating) the gallocr compute
  // buffer on Vulkan corrupts the heap; a fix needs a policy that never regrows it (or makes regrowth
  // safe), not just this test's sizes.
  const vkMode = process.env.MOESWARM_VK_MIXED;
  const vk = vkMode === "1" || vkMode === "same";
  if (!vk)
    console.warn(
      "skipping the Vulkan mixed-type run (known crash, issue #19): set MOESWARM_VK_MIXED=1 to run it",
    );
  it.skipIf(!vk)(
    "vulkan worker (lavapipe): every layer matches the f64 oracle, pass after pass, in one process",
    async () => {
      process.env.GGML_VK_VISIBLE_DEVICES = "0";
      await using compute = await loadExpertCompute(model.path, { backend: "vulkan", threads: 1 });
      await runAll(compute, model, 0.9995, vkMode === "same");
    },
    300_000,
  );
});

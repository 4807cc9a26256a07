// A synthetic MoE model planned for a budget that forces expert layers off the GPU really loads in
// llama.cpp: through node-llama-cpp 3.21.1 with its own CPU/GPU split option (gpuLayers, whole
// layers counted from the end: node-llama-cpp has no tensor overrides), with a context of the
// planned shape whose KV cache llama.cpp sizes as planned; and the plan's -ot value makes
// llama.cpp's loader move exactly the planned tensors (test/llama-probe). This machine has no
// GPU: node-llama-cpp sets gpuLayers to 0, so the VRAM side itself is not exercised here.

import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, expect, it } from "vitest";
import { ensureSyntheticModel, planOffload, readGguf } from "../src/index.js";
import { loadLlamaProbe } from "./llama-probe/llama-probe.js";

const here = dirname(fileURLToPath(import.meta.url));
const tmp = tempDir("moeswarm-plan-load-");
afterAll(() => tmp.remove());

interface LoadResult {
  gpu: string | false;
  gpuLayers: number;
  contextSize: number;
  tokens: number[];
  logs: string[];
}

function load(path: string, options: Record<string, unknown>): LoadResult {
  const res = spawnSync(process.execPath, [join(here, "plan-load.mjs"), path, JSON.stringify(options)], {
    encoding: "utf8",
    timeout: 180_000,
    cwd: join(here, ".."),
  });
  if (res.status !== 0)
    throw new Error(`plan-load exited ${res.status} (${res.signal}):\n${res.stderr}\n${res.stdout}`);
  return JSON.parse(res.stdout) as LoadResult;
}

it("loads a model planned for a small budget", { timeout: 240_000 }, async () => {
  const { path } = await ensureSyntheticModel("small", { cacheDir: tmp.dir });
  const header = await readGguf(path);
  const shape = { ctx: 2048, batch: 512, ubatch: 512, margin: 0, order: "first" as const };
  const all = planOffload(header, { vram: "1GiB", ...shape });
  expect(all.ramLayers).toEqual([]);
  // One layer less than everything: moving one layer out costs its op-offload copy in the compute
  // buffer, so two have to go.
  const layerBytes = all.layers[0]!.bytes;
  const plan = planOffload(header, { vram: all.vram.total - layerBytes, ...shape });
  expect(plan.fits).toBe(true);
  expect(plan.ramLayers).toEqual([0, 1]);
  expect(plan.nCpuMoe).toBe(2);
  expect(plan.overrideTensor).toBe("^blk\\.[01]\\.ffn_(up|down|gate)_exps\\.weight$=CPU");

  // llama.cpp's loader moves exactly the planned tensors for that -ot value.
  const probe = await loadLlamaProbe();
  const moved = probe.memory(path, {
    ctx: 2048,
    batch: 512,
    ubatch: 512,
    overrideTensor: plan.overrideTensor,
  });
  expect(moved.overridden.sort()).toEqual(
    plan.tensors
      .filter((t) => t.device === "ram" && t.kind === "expert")
      .map((t) => t.name)
      .sort(),
  );

  // node-llama-cpp: the whole-layer split that keeps the same last layers on the GPU
  // (llama.cpp offloads the last n_gpu_layers blocks, the output layer counting as one).
  const gpuLayers = plan.blockCount + 1 - plan.ramLayers.length;
  const r = load(path, { gpuLayers, contextSize: 2048, batchSize: 512, flashAttention: true });
  expect(r.gpu).toBe(false);
  expect(r.gpuLayers).toBe(0);
  expect(r.contextSize).toBe(2048);
  expect(r.tokens.length).toBe(4);
  const kvLine = r.logs.find((l) => l.includes("llama_kv_cache: size"));
  expect(kvLine, r.logs.join("")).toBeDefined();
  // "%7.2f MiB" of llama_kv_cache's constructor.
  const logged = /size =\s+([\d.]+) MiB/.exec(kvLine!)![1];
  expect(logged).toBe((Number(plan.kv.total) / 2 ** 20).toFixed(2));
});

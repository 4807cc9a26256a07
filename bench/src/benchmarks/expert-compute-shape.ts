// `expert-compute-shape`: one real layer's routed-expert compute in the shape-true qwen35moe
// (Qwen3.5-122B-A10B's layers: 256 experts of 3072x1024, top-8, Q4_K_M types as llama-quantize
// gives them), through @moeswarm/worker-native on a slice of the layer's 256 experts, at batch
// 1, 8 and 64 with each token's 8 experts drawn at random from all 256 (as a router spreads them:
// at batch 64 most of the layer's experts are touched, unlike expert-compute's 16-expert slice).
// Layer 0 has Q4_K ffn_down, layer 3 Q6_K (use_more_bits). This is the "real layer's compute"
// that the decode benchmark's per-layer round trip is set against. Needs the shape-true model in
// .cache/models (about 6 GB, made by MOESWARM_BENCH_SHAPE=1 or by `decode` with
// MOESWARM_BENCH_DECODE_MODEL=shape); skipped with a note without it.
import { mkdtemp, rm, stat } from "node:fs/promises";
import { loadavg, tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { mulberry32 } from "@moeswarm/core";
import {
  ensureSyntheticModel,
  findExpertTensors,
  planSyntheticModel,
  readGguf,
  sliceExperts,
  syntheticModelKey,
  syntheticPreset,
} from "@moeswarm/shard";
import { NativeExpertCompute } from "@moeswarm/worker-native";
import type { Benchmark, Row } from "../harness.js";
import { nativeOrSkip, THREADS } from "../native-slice.js";

const CACHE_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", ".cache", "models");
const K = 8;
const TOKENS = [1, 8, 64] as const;
const SAMPLES = 5;

function request(layer: number, n: number, nExpert: number, nEmbd: number, seed: number) {
  const r = mulberry32(seed);
  const ids = new Int32Array(n * K);
  const w = new Float32Array(n * K).fill(1 / K);
  for (let i = 0; i < n; i++) {
    const chosen = new Set<number>();
    while (chosen.size < K) chosen.add(Math.floor(r() * nExpert));
    ids.set([...chosen], i * K);
  }
  const x = new Float32Array(n * nEmbd);
  for (let i = 0; i < x.length; i++) x[i] = r() * 2 - 1;
  return { layer, x, ids, k: K, w, mode: "sum" as const };
}

export const expertComputeShape: Benchmark = {
  name: "expert-compute-shape",
  description:
    "one shape-true qwen35moe layer's routed experts (256 x 3072x1024, top-8, Q4_K_M), batch 1/8/64, worker-native",
  async run() {
    const probe = await nativeOrSkip();
    if (probe.skipped) return probe.skipped;
    // 6 GB: made only when asked (MOESWARM_BENCH_SHAPE=1) or already there
    const { spec } = planSyntheticModel(syntheticPreset("shape", "qwen35moe"));
    const cached = join(CACHE_DIR, `qwen35moe-shape-${syntheticModelKey(spec.options).slice(0, 16)}.gguf`);
    if (process.env.MOESWARM_BENCH_SHAPE !== "1" && !(await stat(cached).catch(() => undefined))) {
      return {
        rows: [],
        ratios: {},
        notes: [
          "skipped: the shape-true model is not in .cache/models; set MOESWARM_BENCH_SHAPE=1 to make it (~6 GB)",
        ],
      };
    }
    const model = await ensureSyntheticModel("shape", { cacheDir: CACHE_DIR, arch: "qwen35moe" });
    const layout = findExpertTensors(await readGguf(model.path));
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    const dir = await mkdtemp(join(tmpdir(), "mswb-shape-layer-"));
    try {
      for (const layer of [0, 3]) {
        const info = layout.layers.find((l) => l.layer === layer)!;
        const path = join(dir, `layer${layer}.gguf`);
        {
          await using slice = await sliceExperts(model.path, {
            layers: [layer],
            experts: [...Array(info.nExpert).keys()],
          });
          await slice.write(path);
        }
        const native = await NativeExpertCompute.load(path, { threads: THREADS });
        try {
          const t = native.native.tensors[0]!;
          const types = `gate ${t.gate} up ${t.up} down ${t.down}`;
          let batch1 = 0;
          for (const n of TOKENS) {
            const req = request(layer, n, info.nExpert, model.options.nEmbd, 7 + n);
            await native.run(req);
            const walls: number[] = [];
            const cpus: number[] = [];
            for (let s = 0; s < SAMPLES; s++) {
              const c0 = process.cpuUsage();
              const t0 = process.hrtime.bigint();
              await native.run(req);
              walls.push(Number(process.hrtime.bigint() - t0) / 1e6);
              const c = process.cpuUsage(c0);
              cpus.push((c.user + c.system) / 1e3);
            }
            walls.sort((a, b) => a - b);
            cpus.sort((a, b) => a - b);
            const wall = walls[SAMPLES >> 1]!;
            rows.push({
              layer,
              types,
              batch: n,
              "compute ms": wall,
              "cpu ms": cpus[SAMPLES >> 1]!,
              "ms per token": wall / n,
              load1: loadavg()[0]!,
            });
            if (n === 1) batch1 = wall;
            // what batching buys per token: compute per token at batch n over batch 1
            if (n > 1) ratios[`layer${layer}_batch${n}_per_token_vs_batch1`] = wall / n / batch1;
          }
        } finally {
          await native.close();
        }
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
    return {
      rows,
      ratios,
      notes: [
        `threads ${THREADS}; median of ${SAMPLES} runs; load1 is the 1-minute load average (a shared machine inflates wall time, cpu ms less so)`,
      ],
    };
  },
};

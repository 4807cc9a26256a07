// `decode`: tokens/s of the `medium` synthetic qwen3moe (8 MoE layers, 64 experts, top-8, Q8_0)
// decoded greedily by node-llama-cpp's libllama (the llama-logits harness, one thread), plain
// against the same llama.cpp with libggml-moeswarm.so sending every MoE layer to 2 llama-cpu worker
// processes (half the experts each) through the bridge, over loopback, in the same run (rounds
// alternate so both see the same machine load). The swarm's tokens must equal the plain run's.
//
// Breakdown per decoded token, summed over the 8 remote layers:
//   backbone       the decode time not spent waiting for the plugin (attention, router, norms...)
//   plugin<->bridge the plugin's round trip minus the bridge's time (socket, frame codec, wake-ups)
//   bridge+dispatch the bridge's time minus the slowest worker's round trip (grouping, combine)
//   worker hop     the slowest worker's round trip minus the workers' mean compute (stdio pipes, codec)
//   worker compute what the workers report for their ggml graph
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import {
  type BridgeRequestStats,
  expertComputeHandler,
  type LogitsHarnessResult,
  runLogitsHarness,
  serveBackboneBridge,
} from "@moeswarm/backbone";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import {
  ensureSyntheticModel,
  findExpertTensors,
  ggmlTypeName,
  readGguf,
  sliceExperts,
} from "@moeswarm/shard";
import { ggmlQuantize, spawnLlamaExpertWorker, type WorkerProcessCompute } from "@moeswarm/worker-native";
import { type Benchmark, median, type Row } from "../harness.js";

const CACHE_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", ".cache", "models");
/**
 * MOESWARM_BENCH_DECODE_MODEL=shape decodes the shape-true qwen35moe instead (Qwen3.5-122B-A10B's
 * layers, 4 of them, Q4_K_M, ~6 GB, synthesised once: its weights as random valid blocks, the
 * language-model tensors through ggml's quantiser): per-layer overhead
 * against a real layer's compute. Fewer tokens and one round: a token costs a real layer's time.
 */
const SHAPE = process.env.MOESWARM_BENCH_DECODE_MODEL === "shape";
const N_PREDICT = SHAPE ? 16 : 64;
const ROUNDS = SHAPE ? 1 : 3;
const WORKERS = 2;
const PROMPT = "The swarm decodes";

export const decode: Benchmark = {
  name: "decode",
  description:
    "greedy decode of the medium synthetic qwen3moe (MOESWARM_BENCH_DECODE_MODEL=shape: the shape-true qwen35moe): plain llama.cpp vs llama.cpp + plugin + 2 llama-cpu workers (all MoE layers remote, loopback)",
  async run() {
    const model = SHAPE
      ? await ensureSyntheticModel("shape", {
          cacheDir: CACHE_DIR,
          arch: "qwen35moe",
          quantize: (type, values, ne0) => ggmlQuantize(ggmlTypeName(type), values, ne0),
        })
      : await ensureSyntheticModel("medium", { cacheDir: CACHE_DIR });
    const layout = findExpertTensors(await readGguf(model.path));
    const layers = layout.layers.map((l) => l.layer);
    const nExpert = layout.layers[0]!.nExpert;
    const dir = await mkdtemp(join(tmpdir(), "mswb-bench-"));
    const workers: WorkerProcessCompute[] = [];
    try {
      const placement = new Placement({ model: "bench" });
      const transport = new InProcessTransport();
      for (let w = 0; w < WORKERS; w++) {
        const experts = [...Array(nExpert / WORKERS).keys()].map((i) => i + (w * nExpert) / WORKERS);
        const path = join(dir, `w${w}.gguf`);
        await using slice = await sliceExperts(model.path, { layers, experts });
        await slice.write(path);
        // a shape-true slice (3 GB) loads in minutes on a loaded machine
        const worker = await spawnLlamaExpertWorker(path, {
          threads: 1,
          startTimeoutMs: SHAPE ? 1_800_000 : 120_000,
        });
        workers.push(worker);
        transport.set(`w${w}`, expertComputeHandler(worker));
        placement.register({ id: `w${w}`, model: "bench", layers, experts });
      }
      // the bridge's view of each single-token request: its time and the slowest worker's
      let decodeStats: BridgeRequestStats[] = [];
      await using bridge = await serveBackboneBridge({
        socket: join(dir, "bridge.sock"),
        placement,
        transport,
        onStats: (s) => {
          if (s.tokens === 1 && !s.error) decodeStats.push(s);
        },
      });
      // a shape-true run loads 6 GB and decodes real layers: minutes on a loaded machine
      const timeoutMs = SHAPE ? 1_800_000 : 120_000;
      const common = { modelPath: model.path, prompt: PROMPT, nPredict: N_PREDICT, threads: 1, timeoutMs };
      const plainRuns: LogitsHarnessResult[] = [];
      const swarmRuns: LogitsHarnessResult[] = [];
      const bridgeMs: number[] = [];
      const slowestMs: number[] = [];
      const computeMs: number[] = [];
      for (let r = 0; r < ROUNDS; r++) {
        plainRuns.push(await runLogitsHarness(common));
        decodeStats = [];
        const before = workers.map((w) => w.computeStats);
        const run = await runLogitsHarness({
          ...common,
          plugin: { bridge: bridge.address, layers: "all", model: "bench" },
        });
        if (!run.ok) throw new Error(`the swarm decode failed:\n${run.stderr}`);
        swarmRuns.push(run);
        const steps = decodeStats.length / layers.length;
        bridgeMs.push(decodeStats.reduce((s, d) => s + d.ms, 0) / steps);
        slowestMs.push(
          decodeStats.reduce(
            (s, d) => s + Math.max(0, ...Object.values(d.dispatch.owners).map((o) => o.latencyMs)),
            0,
          ) / steps,
        );
        const after = workers.map((w) => w.computeStats);
        const runs = after.reduce((s, a, i) => s + a.runs - before[i]!.runs, 0);
        const ms = after.reduce((s, a, i) => s + a.computeMs - before[i]!.computeMs, 0);
        // mean compute of one worker run, times the layers a token passes
        computeMs.push((ms / runs) * layers.length);
      }
      const identical = swarmRuns.every((s, i) => s.tokens.join() === plainRuns[i]!.tokens.join());
      const plainMsTok = median(plainRuns.map((p) => p.decodeMs / N_PREDICT));
      const swarmMsTok = median(swarmRuns.map((s) => s.decodeMs / N_PREDICT));
      const pluginMsTok = median(
        swarmRuns.map((s) => Object.values(s.plugin!.layers).reduce((sum, l) => sum + l.meanUs / 1000, 0)),
      );
      const bridge1 = median(bridgeMs);
      const slowest = median(slowestMs);
      const compute = median(computeMs);
      const p99 = Math.max(...Object.values(swarmRuns.at(-1)!.plugin!.layers).map((l) => l.p99Us / 1000));
      const rows: Row[] = [
        { mode: "plain llama.cpp", "tok/s": 1000 / plainMsTok, "ms/token": plainMsTok },
        {
          mode: `plugin + ${WORKERS} workers`,
          "tok/s": 1000 / swarmMsTok,
          "ms/token": swarmMsTok,
          backbone: swarmMsTok - pluginMsTok,
          "plugin<->bridge": pluginMsTok - bridge1,
          "bridge+dispatch": bridge1 - slowest,
          "worker hop": slowest - compute,
          "worker compute": compute,
        },
      ];
      return {
        rows,
        ratios: {
          swarm_vs_plain_tokens_per_s: plainMsTok / swarmMsTok,
          remote_share_of_token_time: pluginMsTok / swarmMsTok,
        },
        notes: [
          `${N_PREDICT} tokens x ${ROUNDS} rounds, 1 backbone thread, 1 thread per worker; ${layers.length} remote MoE layers per token`,
          `tokens identical to the plain run in every round: ${identical ? "yes" : "NO"}`,
          `per-layer plugin round trip: p99 up to ${p99.toFixed(2)} ms (last round)`,
          "breakdown columns are ms per decoded token, summed over the remote layers",
        ],
      };
    } finally {
      await Promise.all(workers.map((w) => w.close().catch(() => {})));
      await rm(dir, { recursive: true, force: true });
    }
  },
};

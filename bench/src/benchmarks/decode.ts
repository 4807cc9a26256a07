// `decode`: tokens/s of the `medium` synthetic qwen3moe (8 MoE layers, 64 experts, top-8, Q8_0)
// decoded greedily by node-llama-cpp's libllama (the llama-logits harness, one thread), plain
// against the same llama.cpp with libggml-moeswarm.so sending every MoE layer to 2 llama-cpu
// workers (half the experts each), over loopback, in the same run (each round decodes plain, then
// through each swarm, so all see the same machine load). Two swarms:
//   plugin + 2 workers   the bridge path: llama-cpu worker processes over stdio behind the bridge's
//                        in-process transport (no hub)
//   ..., native plane    the product's fastest path (decode-native.ts): a hub on loopback TLS, two
//                        `moeswarm-worker --listen-native` processes holding the same halves, the
//                        bridge with its `hub` option under trust "own"; the plugin sends each layer's
//                        split to both workers over TLS itself (ranged table entries). Left out, with
//                        the reason printed, where the native plane cannot run (no libssl.so.3, no
//                        native build) and for the shape-true model (a third copy of its experts).
// Every swarm's tokens must equal the plain run's in every round (the bench fails otherwise).
//
// Breakdown per decoded token, summed over the remote layers. Every column is decode-only: the
// prompt's ubatch (a many-token request) and the slow first calls would skew a mean, so each figure
// is a per-layer median over the single-token requests, summed over the layers, and the columns
// telescope to the swarm's ms/token:
//   backbone        swarm ms/token minus the plugin's round trips (the plugin's per-layer p50, summed):
//                   attention, router, norms... (the plugin's p50 counts the prompt's one call among
//                   N_PREDICT + 1, which cannot move a median)
//   plugin<->bridge the plugin's round trips minus the bridge's time (per-layer median of its 1-token
//                   requests): socket, frame codec, wake-ups
//   bridge+dispatch the bridge's time minus the slowest worker's round trip (per-layer median over the
//                   1-token requests of the slowest owner's latency): grouping, combine
//   worker hop      the slowest worker's round trip minus that worker's reported compute for the same
//                   request (per-layer median): stdio pipes, codec
//   worker compute  what the slowest worker reported for its ggml graph in that request (per-layer
//                   median over the 1-token requests; the prompt's run is left out)
// The native row has the plugin's own figures (what the demo's `native` line prints), times the
// remote layers: the p50 over its native splits of a layer's round trip (send to both workers, wait
// for both, combine) and of that round trip less the slower worker's reported compute. Its backbone
// column is the bridge row's definition; "native/all splits" and "fell back" are summed over rounds.
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import {
  type BackboneBridge,
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
import {
  bridgeNote,
  type NativeHalf,
  type NativeSwarm,
  nativePlaneMissing,
  startNativeSwarm,
} from "./decode-native.js";
import { checkSameTokens, type NativeRound, nativeRound, nativeRow } from "./decode-native-row.js";

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
const NATIVE_MODE = `plugin + ${WORKERS} workers, native plane`;

export const decode: Benchmark = {
  name: "decode",
  description:
    "greedy decode of the medium synthetic qwen3moe (MOESWARM_BENCH_DECODE_MODEL=shape: the shape-true qwen35moe): plain llama.cpp vs llama.cpp + plugin + 2 llama-cpu workers (all MoE layers remote, loopback), through the bridge and on the native plane",
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
    const dir = await mkdtemp(join(tmpdir(), "mswb-bench-"));
    const workers: WorkerProcessCompute[] = [];
    let swarm: BridgeSwarm | undefined;
    let native: NativeSwarm | undefined;
    try {
      const halves = await writeHalves(model.path, layout, dir);
      swarm = await startBridgeSwarm(halves, layers, dir, workers);
      const started = await nativeSwarmOrReason(dir, model.path, halves, layers);
      native = typeof started === "string" ? undefined : started;
      return await measureRounds(model.path, layers, swarm, native ?? started);
    } finally {
      await native?.close();
      await swarm?.bridge.close();
      await Promise.all(workers.map((w) => w.close().catch(() => {})));
      await rm(dir, { recursive: true, force: true });
    }
  },
};

/** Each worker's half of the experts of every MoE layer, written as a slice file. */
async function writeHalves(
  modelPath: string,
  layout: ReturnType<typeof findExpertTensors>,
  dir: string,
): Promise<NativeHalf[]> {
  const layers = layout.layers.map((l) => l.layer);
  const nExpert = layout.layers[0]!.nExpert;
  const per = nExpert / WORKERS;
  const halves: NativeHalf[] = [];
  for (let w = 0; w < WORKERS; w++) {
    const experts = { start: w * per, end: (w + 1) * per };
    const path = join(dir, `w${w}.gguf`);
    await using slice = await sliceExperts(modelPath, { layers, experts: expertIds(experts) });
    await slice.write(path);
    const bytes = layout.layers.reduce((sum, l) => sum + Number(l.bytesPerExpert) * per, 0);
    halves.push({ path, layers: { start: layers[0]!, end: layers.at(-1)! + 1 }, experts, bytes });
  }
  return halves;
}

/** The expert ids of a half-open range. */
const expertIds = (r: { start: number; end: number }) =>
  Array.from({ length: r.end - r.start }, (_, i) => r.start + i);

/** The bridge row's swarm: a llama-cpu worker process per half behind the bridge's in-process transport. */
interface BridgeSwarm {
  bridge: BackboneBridge;
  /** The single-token requests' samples since the last `take()`. */
  take(): DecodeSample[];
}

async function startBridgeSwarm(
  halves: readonly NativeHalf[],
  layers: number[],
  dir: string,
  workers: WorkerProcessCompute[],
): Promise<BridgeSwarm> {
  const placement = new Placement({ model: "bench" });
  const transport = new InProcessTransport();
  // the compute each worker reported for its latest request: decode sends one layer at a time, so
  // the bridge's stats for a request arrive after its workers' answers and before the next request
  const lastComputeMs = new Map<string, number>();
  for (const [w, half] of halves.entries()) {
    // a shape-true slice (3 GB) loads in minutes on a loaded machine
    const worker = await spawnLlamaExpertWorker(half.path, {
      threads: 1,
      startTimeoutMs: SHAPE ? 1_800_000 : 120_000,
    });
    workers.push(worker);
    const id = `w${w}`;
    const handler = expertComputeHandler(worker);
    transport.set(id, async (request, options) => {
      const before = worker.computeStats.computeMs;
      const result = await handler(request, options);
      lastComputeMs.set(id, worker.computeStats.computeMs - before);
      return result;
    });
    placement.register({ id, model: "bench", layers, experts: expertIds(half.experts) });
  }
  // each single-token request (a decode step of one layer): the bridge's time, the slowest
  // worker's round trip and that worker's reported compute
  let samples: DecodeSample[] = [];
  const bridge = await serveBackboneBridge({
    socket: join(dir, "bridge.sock"),
    placement,
    transport,
    onStats: (s) => {
      if (s.tokens === 1 && !s.error) samples.push(decodeSample(s, lastComputeMs));
      lastComputeMs.clear();
    },
  });
  const take = () => {
    const out = samples;
    samples = [];
    return out;
  };
  return { bridge, take };
}

/** The native swarm, or why its row is left out. */
async function nativeSwarmOrReason(
  dir: string,
  modelPath: string,
  halves: readonly NativeHalf[],
  layers: readonly number[],
): Promise<NativeSwarm | string> {
  if (SHAPE) return "not with the shape-true model (its workers would hold a third copy of its 6 GB)";
  return nativePlaneMissing() ?? (await startNativeSwarm({ dir, modelPath, halves, layers }));
}

/** The rounds (plain, bridge, native in turn) and the report. */
async function measureRounds(
  modelPath: string,
  layers: number[],
  swarm: BridgeSwarm,
  native: NativeSwarm | string,
) {
  // a shape-true run loads 6 GB and decodes real layers: minutes on a loaded machine
  const timeoutMs = SHAPE ? 1_800_000 : 120_000;
  const common = { modelPath, prompt: PROMPT, nPredict: N_PREDICT, threads: 1, timeoutMs };
  const plainRuns: LogitsHarnessResult[] = [];
  const swarmRuns: LogitsHarnessResult[] = [];
  const breakdowns: Breakdown[] = [];
  const nativeRounds: NativeRound[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    const plain = await runLogitsHarness(common);
    if (!plain.ok) throw new Error(`the plain decode failed:\n${plain.stderr}`);
    plainRuns.push(plain);
    swarm.take();
    const run = await runLogitsHarness({
      ...common,
      plugin: { bridge: swarm.bridge.address, layers: "all", model: "bench" },
    });
    if (!run.ok) throw new Error(`the swarm decode failed:\n${run.stderr}`);
    checkSameTokens(plain, run, `plugin + ${WORKERS} workers, round ${r + 1}`);
    swarmRuns.push(run);
    breakdowns.push(breakdownOf(run, swarm.take(), layers));
    if (typeof native === "string") continue;
    const nat = await runLogitsHarness({
      ...common,
      plugin: { bridge: native.bridge.address, layers: "all", model: native.model },
    });
    nativeRounds.push(nativeRound(nat, N_PREDICT));
    checkSameTokens(plain, nat, `${NATIVE_MODE}, round ${r + 1}`);
  }
  return report(layers, plainRuns, swarmRuns, breakdowns, native, nativeRounds);
}

/** One bridge round's breakdown, ms per token (per-layer medians summed over the layers). */
interface Breakdown {
  pluginMs: number;
  bridgeMs: number;
  slowestMs: number;
  computeMs: number;
}

function breakdownOf(
  run: LogitsHarnessResult,
  samples: readonly DecodeSample[],
  layers: number[],
): Breakdown {
  return {
    pluginMs: Object.values(run.plugin!.layers).reduce((sum, l) => sum + l.p50Us / 1000, 0),
    bridgeMs: sumOfLayerMedians(samples, layers, (d) => d.bridgeMs),
    slowestMs: sumOfLayerMedians(samples, layers, (d) => d.slowestMs),
    computeMs: sumOfLayerMedians(samples, layers, (d) => d.computeMs),
  };
}

function report(
  layers: number[],
  plainRuns: readonly LogitsHarnessResult[],
  swarmRuns: readonly LogitsHarnessResult[],
  breakdowns: readonly Breakdown[],
  native: NativeSwarm | string,
  nativeRounds: readonly NativeRound[],
) {
  const plainMsTok = median(plainRuns.map((p) => p.decodeMs / N_PREDICT));
  const swarmMsTok = median(swarmRuns.map((s) => s.decodeMs / N_PREDICT));
  const at = (pick: (b: Breakdown) => number) => median(breakdowns.map(pick));
  const pluginMsTok = at((b) => b.pluginMs);
  const pluginMeanMsTok = median(
    swarmRuns.map((s) => Object.values(s.plugin!.layers).reduce((sum, l) => sum + l.meanUs / 1000, 0)),
  );
  const bridge1 = at((b) => b.bridgeMs);
  const slowest = at((b) => b.slowestMs);
  const compute = at((b) => b.computeMs);
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
  const ratios: Record<string, number> = {
    swarm_vs_plain_tokens_per_s: plainMsTok / swarmMsTok,
    remote_share_of_token_time: pluginMsTok / swarmMsTok,
  };
  const notes = [
    `${N_PREDICT} tokens x ${ROUNDS} rounds, 1 backbone thread, 1 thread per worker; ${layers.length} remote MoE layers per token`,
    "tokens identical to the plain run in every round: yes (checked each round)",
    `per-layer plugin round trip: p99 up to ${p99.toFixed(2)} ms (last round)`,
    "breakdown columns are ms per decoded token, summed over the remote layers: per-layer medians of the 1-token (decode) requests, the plugin's p50",
    `plugin round trips per token: ${pluginMsTok.toFixed(2)} ms at the per-layer p50, ${pluginMeanMsTok.toFixed(2)} ms at the per-layer mean (which counts the prompt's call and the first slow calls)`,
  ];
  if (typeof native === "string") {
    notes.push(`no "${NATIVE_MODE}" row: ${native}`);
  } else {
    const n = nativeRow(NATIVE_MODE, nativeRounds, {
      layers: layers.length,
      plainMsTok,
      bridgeMsTok: swarmMsTok,
    });
    rows.push(n.row);
    Object.assign(ratios, n.ratios);
    notes.push(
      `${NATIVE_MODE}: tokens identical to the plain run in every round: yes (checked each round)`,
      `${NATIVE_MODE}: ${native.placement}${native.ranged ? " (ranged table entries)" : " (NOT split per layer: whole-layer entries)"}; ${bridgeNote(native.bridge)}`,
      ...n.notes,
    );
  }
  return { rows, ratios, notes };
}

interface DecodeSample {
  layer: number;
  bridgeMs: number;
  /** The slowest worker's round trip, as dispatch measured it. */
  slowestMs: number;
  /** What that worker reported for its ggml graph. */
  computeMs: number;
}

function decodeSample(s: BridgeRequestStats, lastComputeMs: ReadonlyMap<string, number>): DecodeSample {
  let slowest = "";
  let slowestMs = 0;
  for (const [owner, o] of Object.entries(s.dispatch.owners)) {
    if (o.latencyMs >= slowestMs) {
      slowest = owner;
      slowestMs = o.latencyMs;
    }
  }
  return { layer: s.layer, bridgeMs: s.ms, slowestMs, computeMs: lastComputeMs.get(slowest) ?? 0 };
}

/** Per layer the median of `pick` over that layer's samples, summed over the layers: ms per token. */
function sumOfLayerMedians(
  samples: readonly DecodeSample[],
  layers: readonly number[],
  pick: (d: DecodeSample) => number,
): number {
  return layers.reduce((sum, layer) => {
    const xs = samples.filter((d) => d.layer === layer).map(pick);
    return sum + (xs.length > 0 ? median(xs) : 0);
  }, 0);
}

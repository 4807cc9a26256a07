// `throughput-contexts`: does overlap inside createSwarmLlama pay? N sequences decoded greedily by
// node-llama-cpp in this process with the plugin (createSwarmLlama, hub form, every MoE layer
// remote, 2 llama-cpu workers behind the hub's relay, a userspace delay proxy adding RTT between
// the bridge and the hub), served two ways, interleaved round by round under the same load:
//   one: one context with N sequences: each step is one llama_decode of N tokens, one round trip
//        per remote layer, during which nothing else runs;
//   two: two contexts with N/2 sequences each, decoding at once on their own threads: each blocks
//        only its own decode on its layer's round trip, so one can compute while the other waits.
// Per cell: aggregate tok/s (median of the repeats, with their range), two/one paired per round,
// bridge round trips per remote layer per generated token, and whether every sequence's tokens are
// the same both ways. One backbone thread per context (so "two" may use two cores where "one" uses
// one: on a quiet machine that is part of what overlap buys, and the table says so).
// MOESWARM_BENCH_TP_MODEL (small, medium, shape; default medium), MOESWARM_BENCH_TPC_CLIENTS
// (default 4,16), MOESWARM_BENCH_TPC_RTTS (default 0,10,30), MOESWARM_BENCH_TPC_TOKENS (default 32)
// and MOESWARM_BENCH_REPEAT (default 3) choose the cells; MOESWARM_BENCH_TPC_ONE_THREADS=2 gives
// mode one as many threads as two has.
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createSwarmLlama, type SwarmLlama } from "@moeswarm/backbone";
import { mintToken } from "@moeswarm/hub";
import type { WorkerProcessCompute } from "@moeswarm/worker-native";
import { type Benchmark, median, type Row } from "../harness.js";
import { type DelayProxy, loadDelayProxy, SECRET, startSwarm, tpModel } from "./throughput-swarm.js";

const MODEL_ID = "bench-tpc";

function numbers(name: string, fallback: number[]): number[] {
  const v = process.env[name];
  if (v === undefined || v === "") return fallback;
  const xs = v.split(",").map(Number);
  if (xs.some((x) => !Number.isFinite(x) || x < 0)) throw new Error(`${name}: expected numbers, got ${v}`);
  return xs;
}

const CLIENTS = numbers("MOESWARM_BENCH_TPC_CLIENTS", [4, 16]);
const RTT_MS = numbers("MOESWARM_BENCH_TPC_RTTS", [0, 10, 30]);
const N_PREDICT = Number(process.env.MOESWARM_BENCH_TPC_TOKENS ?? 32);
const REPEAT = Math.max(1, Number(process.env.MOESWARM_BENCH_REPEAT ?? 3));
/**
 * Threads of mode one's single context (default 1, as each of mode two's): "two" then runs two
 * decodes at once on two threads, so on a busy machine it also gets twice the CPU share;
 * MOESWARM_BENCH_TPC_ONE_THREADS=2 gives "one" the same thread count.
 */
const ONE_THREADS = Math.max(1, Number(process.env.MOESWARM_BENCH_TPC_ONE_THREADS ?? 1));
type Mode = "one" | "two";
type Context = Awaited<ReturnType<SwarmLlama["model"]["createContext"]>>;
type Sequence = ReturnType<Context["getSequence"]>;

interface Group {
  contexts: Context[];
  /** Each context's sequences; client i is sequence i / count of context i mod count. */
  sequences: Sequence[][];
}

/** `count` contexts sharing N sequences evenly (client i on context i mod count). */
async function createGroup(s: SwarmLlama, n: number, count: number): Promise<Group> {
  const contexts: Context[] = [];
  try {
    for (let i = 0; i < count; i++) {
      contexts.push(
        await s.model.createContext({
          sequences: n / count,
          contextSize: 64 + N_PREDICT,
          batchSize: 512,
          threads: count === 1 ? ONE_THREADS : 1,
        }),
      );
    }
  } catch (error) {
    await Promise.all(contexts.map((c) => c.dispose()));
    throw error;
  }
  const sequences = contexts.map((c) => Array.from({ length: n / count }, () => c.getSequence()));
  return { contexts, sequences };
}

interface Run {
  tokS: number;
  tokens: number[][];
  generated: number;
}

/**
 * One context's sequences in lockstep: each step every sequence queues its next token in the same
 * tick, so the context decodes them as one batch (one round trip per remote layer). With
 * `evaluate`'s generators node-llama-cpp re-dispatches as soon as any sequence has sampled (on the
 * thread pool), which split 4 sequences' steps into 2-4 decodes here.
 */
async function lockstep(sequences: Sequence[], prompts: number[][]): Promise<number[][]> {
  const out = sequences.map((): number[] => []);
  const next = { generateNext: { token: true, options: { temperature: 0 } } };
  let inputs = prompts.map((p) => [...p.slice(0, -1), [p.at(-1)!, next]]);
  for (let step = 0; step < N_PREDICT; step++) {
    const results = await Promise.all(sequences.map((q, i) => q.controlledEvaluate(inputs[i] as never[])));
    inputs = results.map((r, i) => {
      const token = r.at(-1)?.next.token;
      if (token === undefined || token === null) throw new Error("controlledEvaluate returned no token");
      out[i]!.push(token);
      return [[token, next]];
    });
  }
  return out;
}

/** Every sequence decodes its prompt and then N_PREDICT tokens greedily; the contexts at once. */
async function drive(group: Group, prompts: number[][]): Promise<Run> {
  const count = group.contexts.length;
  await Promise.all(group.sequences.flat().map((q) => q.clearHistory()));
  const t0 = performance.now();
  const perContext = await Promise.all(
    group.sequences.map((qs, c) =>
      lockstep(
        qs,
        qs.map((_, j) => prompts[j * count + c]!),
      ),
    ),
  );
  const s = (performance.now() - t0) / 1000;
  const tokens = prompts.map((_, i) => perContext[i % count]![Math.floor(i / count)]!);
  const generated = tokens.reduce((a, t) => a + t.length, 0);
  return { tokS: generated / s, tokens, generated };
}

interface Cell {
  runs: Run[];
  requests: number;
  fallbacks: number;
}

/** Warm-up, then REPEAT rounds of both modes in alternating order (the same load for both). */
async function measure(s: SwarmLlama, n: number, prompts: number[][]): Promise<Map<Mode, Cell>> {
  const groups: Array<[Mode, Group]> = [
    ["one", await createGroup(s, n, 1)],
    ["two", await createGroup(s, n, 2)],
  ];
  const out = new Map<Mode, Cell>(groups.map(([m]) => [m, { runs: [], requests: 0, fallbacks: 0 }]));
  try {
    for (const [, g] of groups) await drive(g, prompts);
    for (let r = 0; r < REPEAT; r++) {
      for (let j = 0; j < groups.length; j++) {
        const [mode, g] = groups[(r + j) % groups.length]!;
        const m0 = s.metrics();
        const run = await drive(g, prompts);
        const m1 = s.metrics();
        const cell = out.get(mode)!;
        cell.runs.push(run);
        cell.requests += m1.requests - m0.requests;
        cell.fallbacks += m1.fallbacks - m0.fallbacks;
      }
    }
    return out;
  } finally {
    for (const [, g] of groups) await Promise.all(g.contexts.map((c) => c.dispose()));
  }
}

const fixed = (x: number, digits: number) => Number(x.toFixed(digits));

function rows(n: number, rtt: number, cells: Map<Mode, Cell>, layers: number): Row[] {
  const one = cells.get("one")!;
  const reference = one.runs[0]!.tokens;
  return [...cells].map(([mode, cell]) => {
    const tokS = cell.runs.map((r) => r.tokS);
    const generated = cell.runs.reduce((a, r) => a + r.generated, 0);
    const same = cell.runs.every((r) => r.tokens.every((t, i) => t.join() === reference[i]!.join()));
    return {
      mode,
      sequences: n,
      rttMs: rtt,
      tokS: fixed(median(tokS), 1),
      range: `${Math.min(...tokS).toFixed(1)}-${Math.max(...tokS).toFixed(1)}`,
      // paired: round r of this mode against round r of "one"
      vsOne: fixed(median(cell.runs.map((r, i) => r.tokS / one.runs[i]!.tokS)), 2),
      roundTripsPerToken: fixed(cell.requests / (layers * generated), 3),
      fallbacks: cell.fallbacks,
      identical: same ? "yes" : "NO",
    };
  });
}

/** createSwarmLlama through a delay proxy of `rtt` ms to the hub. */
async function swarmAt(
  startDelayProxy: DelayProxy,
  hubPort: string,
  model: string,
  dir: string,
  rtt: number,
): Promise<{ swarm: SwarmLlama; close(): Promise<void> }> {
  const proxy = await startDelayProxy({ target: `127.0.0.1:${hubPort}`, rttMs: rtt });
  try {
    const swarm = await createSwarmLlama({
      modelPath: model,
      remoteLayers: "all",
      hub: {
        url: `http://${proxy.url}`,
        token: mintToken({ role: "backbone", id: `bb-tpc-${rtt}`, ttlS: 3600 }, SECRET),
        model: MODEL_ID,
        statsIntervalMs: 0,
      },
      trust: "own",
      socket: join(dir, `tpc-${rtt}.sock`),
    });
    await swarm.bridge.hub!.waitForPlacement((p) => p.missing.length === 0);
    return {
      swarm,
      close: async () => {
        await swarm.close();
        await proxy.close();
      },
    };
  } catch (error) {
    await proxy.close();
    throw error;
  }
}

export const throughputContexts: Benchmark = {
  name: "throughput-contexts",
  description:
    "createSwarmLlama (node-llama-cpp + plugin, hub + 2 llama-cpu workers behind a delay proxy): N sequences in one context vs two contexts of N/2 decoding at once, x RTT",
  async run() {
    for (const n of CLIENTS) {
      if (n < 2 || n % 2 !== 0)
        throw new Error(`MOESWARM_BENCH_TPC_CLIENTS: ${n} cannot split in two groups`);
    }
    const preset = process.env.MOESWARM_BENCH_TP_MODEL ?? "medium";
    if (preset !== "small" && preset !== "medium" && preset !== "shape") {
      throw new Error(`MOESWARM_BENCH_TP_MODEL: expected small, medium or shape, got ${preset}`);
    }
    const model = await tpModel(preset, false);
    const startDelayProxy = await loadDelayProxy();
    const dir = await mkdtemp(join(tmpdir(), "mswb-tpc-"));
    const workers: WorkerProcessCompute[] = [];
    const closers: Array<() => Promise<unknown>> = [];
    const out: Row[] = [];
    const ratios: Record<string, number> = {};
    try {
      const { layers, hubPort } = await startSwarm(model.path, MODEL_ID, dir, workers, closers);
      for (const rtt of RTT_MS) {
        const at = await swarmAt(startDelayProxy, hubPort, model.path, dir, rtt);
        try {
          for (const n of CLIENTS) {
            const prompts = Array.from({ length: n }, (_, i) => [
              ...at.swarm.model.tokenize(`Client ${i} says`),
            ]);
            const cellRows = rows(n, rtt, await measure(at.swarm, n, prompts), layers.length);
            for (const r of cellRows) process.stderr.write(`throughput-contexts: ${JSON.stringify(r)}\n`);
            out.push(...cellRows);
            ratios[`two/one contexts N=${n} RTT=${rtt}ms`] = cellRows[1]!.vsOne as number;
          }
        } finally {
          await at.close();
        }
      }
      return {
        rows: out,
        ratios,
        notes: [
          `${preset} (${model.path.split("/").pop()}), ${layers.length} remote MoE layers, ${N_PREDICT} tokens per sequence, ${REPEAT} measured rounds per cell (median; range: min-max), threads: ${ONE_THREADS} for one, 1 per context for two; each context's sequences in lockstep (one decode per step)`,
          "RTT: a userspace delay proxy between the bridge and the hub (placement, relay); workers on loopback to the hub",
          "vsOne: median over rounds of this mode's tok/s over mode one's in the same round; roundTripsPerToken: bridge requests / (remote layers x generated tokens), 1/N is one frame per step for N sequences",
          "identical: every sequence's tokens equal mode one's first run",
        ],
      };
    } finally {
      for (const close of closers.reverse()) await close().catch(() => {});
      await Promise.all(workers.map((w) => w.close().catch(() => {})));
      await rm(dir, { recursive: true, force: true });
    }
  },
};

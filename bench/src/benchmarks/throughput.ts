// `throughput`: aggregate tokens/s of llama-server (the pinned llama.cpp, built by
// packages/backbone/scripts/build-llama-server.mjs) serving C concurrent clients, plain against the
// same llama-server with every MoE layer sent through the plugin to moeswarm's bridge, whose hub
// and 2 llama-cpu workers sit behind a userspace delay proxy (tools/delay-proxy.mjs) adding RTT.
// Three ways to serve the C sequences (throughput-servers.ts): "none" (one llama-server,
// --parallel C), "draft" (the same with a local draft model: speculative decoding verifies several
// tokens per round trip) and "overlap" (two llama-servers with C/2 slots each on one bridge: one
// computes while the other waits). Per cell: plain and swarm tok/s (median of the repeats, with
// their range), their ratio, the gain over "none" at the same C and RTT, round trips per remote
// layer per generated token, frames per remote layer per llama_decode, draft acceptance, bytes on
// the wire per token with the dtype the activations travelled in (`wire`: q8_0/q8_K where exact,
// as the dispatcher sends them to workers that advertise them; MOESWARM_BENCH_WIRE_DTYPE=f32 sends
// f32 for comparison, `q8,f32` measures both, a row each, in the same session), and whether the
// swarm's texts equal plain's (temperature 0).
// MOESWARM_BENCH_SHORT=1: the small model, fewer cells and tokens; MOESWARM_BENCH_TP_MODEL=shape: the
// shape-true qwen35moe (variant none, C=1/4/16, RTT 0/10, 32 tokens, 2 repeats unless asked);
// MOESWARM_BENCH_TP_CLIENTS and MOESWARM_BENCH_TP_RTTS (comma lists), MOESWARM_BENCH_TP_TOKENS,
// MOESWARM_BENCH_TP_VARIANTS
// (default none,draft,overlap), MOESWARM_BENCH_REPEAT (default 3) and MOESWARM_BENCH_DRAFT_MAX
// (default 8, the dispatcher's) choose the rest. Flags as the dispatcher prints them (-kvu,
// --load-mode none, the draft's), one thread per llama-server.
import { execFileSync } from "node:child_process";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createLocalFallback, type LocalFallback, pluginPath, serveBackboneBridge } from "@moeswarm/backbone";
import { mintToken } from "@moeswarm/hub";
import { loadActivationQuantizer, type WorkerProcessCompute } from "@moeswarm/worker-native";
import { type Benchmark, median, type Row } from "../harness.js";
import {
  drive,
  type Run,
  type ServerGroup,
  type ServerGroupOptions,
  startServerGroup,
  VARIANTS,
  type Variant,
} from "./throughput-servers.js";
import {
  type DelayProxy,
  loadDelayProxy,
  ROOT,
  SECRET,
  startSwarm,
  type TpModel,
  tpModel,
  tpPreset,
} from "./throughput-swarm.js";

const SHORT = process.env.MOESWARM_BENCH_SHORT === "1";
const PRESET = tpPreset();
const SHAPE = PRESET === "shape";
const N_PREDICT = Number(process.env.MOESWARM_BENCH_TP_TOKENS ?? (SHORT ? 16 : SHAPE ? 32 : 48));
const CONCURRENCY = numberList("MOESWARM_BENCH_TP_CLIENTS", [1, 4, 16]);
const RTT_MS = numberList("MOESWARM_BENCH_TP_RTTS", SHORT ? [0, 10, 30] : SHAPE ? [0, 10] : [0, 0.5, 10, 30]);
const REPEAT = Math.max(1, Number(process.env.MOESWARM_BENCH_REPEAT ?? (SHAPE ? 2 : 3)));
const DRAFT_MAX = Number(process.env.MOESWARM_BENCH_DRAFT_MAX ?? 8);
const MODEL_ID = "bench-tp";
/** What the bridge sends the activations as: q8 where exact (the dispatcher's default), or f32. */
type WireChoice = "q8" | "f32";
const WIRES = wireChoices();
const OVERRIDE = "blk\\.\\d+\\.ffn_(gate|up|down|gate_up)_exps\\..*=MOESWARM";

/** A comma-separated list of numbers from the environment, or the default. */
function numberList(name: string, fallback: number[]): number[] {
  const v = process.env[name];
  if (v === undefined || v === "") return fallback;
  const xs = v.split(",").map(Number);
  if (xs.some((x) => !Number.isFinite(x) || x < 0))
    throw new Error(`${name}: expected numbers like 1,4,16, got ${v}`);
  return xs;
}

function wireChoices(): WireChoice[] {
  const v = process.env.MOESWARM_BENCH_WIRE_DTYPE;
  const asked = v === undefined || v === "" ? ["q8"] : v.split(",");
  if (asked.length === 0 || asked.some((w) => w !== "q8" && w !== "f32"))
    throw new Error(`MOESWARM_BENCH_WIRE_DTYPE: expected q8, f32 or q8,f32, got ${v}`);
  return [...new Set(asked)] as WireChoice[];
}

function variants(): Variant[] {
  // the shape preset has no draft model, and its cells take minutes: "none" unless asked
  const fallback = SHAPE ? ["none"] : VARIANTS;
  const asked = (process.env.MOESWARM_BENCH_TP_VARIANTS ?? fallback.join(",")).split(",");
  for (const v of asked) {
    if (!VARIANTS.includes(v as Variant)) throw new Error(`MOESWARM_BENCH_TP_VARIANTS: unknown ${v}`);
    if (v === "draft" && SHAPE)
      throw new Error("MOESWARM_BENCH_TP_VARIANTS: the shape preset has no draft model");
  }
  return asked as Variant[];
}

/** Everything the cells share: llama-server, the models, the scratch directory. */
interface Setup {
  bin: string;
  model: string;
  draft: { path: string | undefined; max: number };
  dir: string;
  startDelayProxy: DelayProxy;
}

/** The swarm side, started once the plain cells are done: the hub with its two workers, the fallback. */
interface SwarmSetup {
  layers: number[];
  hubPort: string;
  fallback: LocalFallback;
}

/** The variants that apply at concurrency C ("none" first: the others are compared with it). */
function variantsAt(c: number): Variant[] {
  // one sequence cannot overlap with another
  const asked = variants().filter((v) => v !== "overlap" || c > 1);
  return [...asked].sort((x, y) => Number(y === "none") - Number(x === "none"));
}

/**
 * REPEAT measured runs of every group (after a warm-up each), interleaved and in a rotating
 * order: on a shared machine each variant then sees the same load, so their ratios hold better
 * than their absolute speeds. `around` is read before each run (the bridge's counters).
 */
async function interleave<T>(
  groups: Array<[Variant, ServerGroup]>,
  c: number,
  around: () => T,
  record: (variant: Variant, run: Run, before: T) => void,
): Promise<void> {
  for (const [, g] of groups) await drive(g, c, N_PREDICT);
  for (let r = 0; r < REPEAT; r++) {
    for (let j = 0; j < groups.length; j++) {
      const [variant, g] = groups[(r + j) % groups.length]!;
      const before = around();
      record(variant, await drive(g, c, N_PREDICT), before);
    }
  }
}

async function startGroups(
  s: Setup,
  c: number,
  plugin?: ServerGroupOptions["plugin"],
): Promise<Array<[Variant, ServerGroup]>> {
  const groups: Array<[Variant, ServerGroup]> = [];
  try {
    for (const variant of variantsAt(c)) {
      // without mmap llama-server still reads the shape preset's 6.1 GB through the plugin's buffer
      // (it keeps none of the experts): over 120 s on this loaded machine once the slices have
      // pushed the file out of the page cache
      const ready = SHAPE ? { readyTimeoutMs: 1_200_000 } : {};
      const options = {
        ...s,
        variant,
        clients: c,
        nPredict: N_PREDICT,
        ...ready,
        ...(plugin ? { plugin } : {}),
      };
      groups.push([variant, await startServerGroup(options)]);
    }
    return groups;
  } catch (error) {
    await Promise.all(groups.map(([, g]) => g.close()));
    throw error;
  }
}

/** Plain llama-server, every variant at concurrency C. */
async function measurePlain(s: Setup, c: number): Promise<Map<Variant, Run[]>> {
  const groups = await startGroups(s, c);
  const out = new Map<Variant, Run[]>(groups.map(([v]) => [v, []]));
  try {
    await interleave(
      groups,
      c,
      () => undefined,
      (v, run) => out.get(v)!.push(run),
    );
    return out;
  } finally {
    await Promise.all(groups.map(([, g]) => g.close()));
  }
}

interface SwarmCell {
  runs: Run[];
  requests: number;
  wireBytes: number;
  fallbacks: number;
  /** Worker requests the q8 sender passed on, and those that travelled as q8_0 / q8_K. */
  wire: { requests: number; q8_0: number; q8_K: number };
}

/** The dtypes the activations travelled in: "f32", "q8_0", or a mix with each one's share. */
function wireLabel(w: SwarmCell["wire"]): string {
  const f32 = w.requests - w.q8_0 - w.q8_K;
  const parts = (
    [
      ["q8_0", w.q8_0],
      ["q8_K", w.q8_K],
      ["f32", f32],
    ] as const
  ).filter(([, n]) => n > 0);
  if (parts.length === 0) return "f32";
  if (parts.length === 1) return parts[0]![0];
  return parts.map(([d, n]) => `${d} ${Math.round((100 * n) / w.requests)}%`).join(" + ");
}

/** The same with the plugin, one bridge for all, behind a delay proxy of `rtt` ms to the hub. */
async function measureSwarm(
  s: Setup,
  w: SwarmSetup,
  c: number,
  rtt: number,
  wire: WireChoice,
): Promise<Map<Variant, SwarmCell>> {
  const proxy = await s.startDelayProxy({ target: `127.0.0.1:${w.hubPort}`, rttMs: rtt });
  const bridge = await serveBackboneBridge({
    socket: join(s.dir, `b-${c}-${rtt}-${wire}.sock`),
    hub: {
      url: `http://${proxy.url}`,
      token: mintToken({ role: "backbone", id: `bb-${c}-${rtt}-${wire}`, ttlS: 3600 }, SECRET),
      model: MODEL_ID,
      statsIntervalMs: 0,
    },
    trust: "own",
    fallback: w.fallback.compute,
    // activations as q8 where exact (the dispatcher's default); MOESWARM_BENCH_WIRE_DTYPE=f32 compares
    ...(wire === "f32" ? {} : { wire: await loadActivationQuantizer(s.model) }),
  }).catch(async (error) => {
    await proxy.close();
    throw error;
  });
  try {
    await bridge.hub!.waitForPlacement((p) => p.missing.length === 0);
    const env = {
      GGML_BACKEND_PATH: pluginPath(),
      MOESWARM_BRIDGE: bridge.address,
      MOESWARM_MODEL: MODEL_ID,
    };
    const groups = await startGroups(s, c, { env, override: OVERRIDE });
    const out = new Map<Variant, SwarmCell>(
      groups.map(([v]) => [
        v,
        { runs: [], requests: 0, wireBytes: 0, fallbacks: 0, wire: { requests: 0, q8_0: 0, q8_K: 0 } },
      ]),
    );
    try {
      // dispatch counts activations as f32: the wire carried what q8 saved fewer
      const bytes = (m: ReturnType<typeof bridge.metrics>) =>
        m.dispatch.bytesOut + m.dispatch.bytesIn - ((m.wire?.bytesF32 ?? 0) - (m.wire?.bytesQuantized ?? 0));
      await interleave(
        groups,
        c,
        () => bridge.metrics(),
        (v, run, m0) => {
          const m1 = bridge.metrics();
          const cell = out.get(v)!;
          cell.runs.push(run);
          cell.requests += m1.requests - m0.requests;
          cell.wireBytes += bytes(m1) - bytes(m0);
          cell.fallbacks += m1.fallbacks - m0.fallbacks;
          if (m1.wire && m0.wire) {
            cell.wire.requests += m1.wire.requests - m0.wire.requests;
            cell.wire.q8_0 += m1.wire.quantizedByDtype.q8_0 - m0.wire.quantizedByDtype.q8_0;
            cell.wire.q8_K += m1.wire.quantizedByDtype.q8_K - m0.wire.quantizedByDtype.q8_K;
          }
        },
      );
      return out;
    } finally {
      await Promise.all(groups.map(([, g]) => g.close()));
    }
  } finally {
    await bridge.close();
    await proxy.close();
  }
}

const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
const fixed = (x: number, digits: number) => Number(x.toFixed(digits));

/** One table row from a cell's measurements. */
function row(
  variant: Variant,
  c: number,
  rtt: number,
  plain: Run[],
  swarm: SwarmCell,
  layers: number,
  none: SwarmCell | undefined,
): Row {
  const plainTokS = median(plain.map((r) => r.tokS));
  const tokS = swarm.runs.map((r) => r.tokS);
  const swarmTokS = median(tokS);
  const tokens = REPEAT * c * N_PREDICT;
  const drafted = sum(swarm.runs.map((r) => r.drafted));
  const same = swarm.runs.every((r) => r.texts.every((t, i) => t === plain[0]!.texts[i]));
  const repeatable = plain.every((r) => r.texts.every((t, i) => t === plain[0]!.texts[i]));
  // paired: run r of this variant against run r of "none", measured in the same round
  const vsNone =
    none && variant !== "none" ? median(swarm.runs.map((r, i) => r.tokS / none.runs[i]!.tokS)) : undefined;
  return {
    variant,
    clients: c,
    rttMs: rtt,
    plainTokS: fixed(plainTokS, 1),
    swarmTokS: fixed(swarmTokS, 1),
    swarmRange: `${Math.min(...tokS).toFixed(1)}-${Math.max(...tokS).toFixed(1)}`,
    ratio: fixed(swarmTokS / plainTokS, 3),
    vsNone: vsNone === undefined ? "-" : fixed(vsNone, 2),
    roundTripsPerToken: fixed(swarm.requests / (layers * tokens), 3),
    framesPerLayerStep: fixed(swarm.requests / (layers * sum(swarm.runs.map((r) => r.decodes))), 2),
    acceptance: drafted > 0 ? fixed(sum(swarm.runs.map((r) => r.accepted)) / drafted, 2) : "-",
    wire: wireLabel(swarm.wire),
    wireBytesPerToken: Math.round(swarm.wireBytes / tokens),
    fallbacks: swarm.fallbacks,
    identical: same ? "yes" : "NO",
    plainRepeatable: repeatable ? "yes" : "NO",
  };
}

/**
 * Plain llama-server at every C first, then the swarm (hub, workers, fallback) and its cells: the
 * plain servers and the workers never hold their models at the same time (the shape preset's
 * 6.1 GB file, and its two 3 GB slices).
 */
async function cells(
  s: Setup,
  rows: Row[],
  ratios: Record<string, number>,
  closers: Array<() => Promise<unknown>>,
  workers: WorkerProcessCompute[],
): Promise<number> {
  const plain = new Map<number, Map<Variant, Run[]>>();
  for (const c of CONCURRENCY) {
    const cell = await measurePlain(s, c);
    plain.set(c, cell);
    // the figures now: a failure in the swarm's cells later must not lose them
    const tokS = [...cell].map(([v, runs]) => `${v} ${median(runs.map((r) => r.tokS)).toFixed(1)}`);
    process.stderr.write(`throughput: plain C=${c} tok/s ${tokS.join(", ")}\n`);
  }
  const { layers, hubPort } = await startSwarm(s.model, MODEL_ID, s.dir, workers, closers);
  // the bridge's liveness deadline adapts down to 250 ms: on a loaded machine a worker can miss
  // it, and the fallback answers instead (counted in the table) rather than failing the request
  const fallback = await createLocalFallback(s.model, { threads: 1 });
  closers.push(() => fallback.close());
  const w: SwarmSetup = { layers, hubPort, fallback };
  const byWire = new Map<WireChoice, Row[]>(WIRES.map((wire) => [wire, []]));
  for (const c of CONCURRENCY) {
    for (const rtt of RTT_MS) {
      for (const wire of WIRES) {
        const swarm = await measureSwarm(s, w, c, rtt, wire);
        // the ratio names carry the wire dtype only when several are measured
        const tag = WIRES.length > 1 ? ` wire=${wire}` : "";
        for (const [variant, cell] of swarm) {
          const r = row(variant, c, rtt, plain.get(c)!.get(variant)!, cell, layers.length, swarm.get("none"));
          rows.push(r);
          byWire.get(wire)!.push(r);
          process.stderr.write(`throughput: ${JSON.stringify(r)}\n`);
          ratios[`${variant} swarm/plain C=${c} RTT=${rtt}ms${tag}`] = r.ratio as number;
          if (typeof r.vsNone === "number")
            ratios[`${variant} swarm/none-swarm C=${c} RTT=${rtt}ms${tag}`] = r.vsNone;
        }
      }
    }
  }
  for (const [wire, of] of byWire) batchGain(of, ratios, WIRES.length > 1 ? ` wire=${wire}` : "");
  return layers.length;
}

/** The goal's figure: aggregate swarm tok/s at the largest C over C = 1, per RTT (variant none). */
function batchGain(rows: Row[], ratios: Record<string, number>, tag: string): void {
  const most = Math.max(...CONCURRENCY);
  if (most <= 1 || !CONCURRENCY.includes(1)) return;
  for (const rtt of RTT_MS) {
    const at = (c: number) => rows.find((r) => r.variant === "none" && r.clients === c && r.rttMs === rtt);
    const one = at(1);
    const many = at(most);
    if (one && many) {
      ratios[`none swarm C=${most}/C=1 RTT=${rtt}ms${tag}`] =
        (many.swarmTokS as number) / (one.swarmTokS as number);
    }
  }
}

const DESCRIPTION_MODEL = SHAPE ? "shape-true qwen35moe" : "synthetic qwen3moe";

export const throughput: Benchmark = {
  name: "throughput",
  description: `llama-server, C concurrent clients x RTT to the hub: plain vs plugin + bridge + hub + 2 llama-cpu workers (${DESCRIPTION_MODEL}, all MoE layers remote), without and with speculation (draft model) and overlap (2 servers); MOESWARM_BENCH_TP_MODEL=shape for the shape-true layers`,
  async run() {
    const out = execFileSync(
      process.execPath,
      [join(ROOT, "packages/backbone/scripts/build-llama-server.mjs"), "--json"],
      { stdio: ["ignore", "pipe", "inherit"], encoding: "utf8" },
    );
    const bin = (JSON.parse(out.trim().split("\n").pop()!) as { bin: string }).bin;
    const startDelayProxy = await loadDelayProxy();
    const model: TpModel = await tpModel(PRESET, variants().includes("draft"));
    const dir = await mkdtemp(join(tmpdir(), "mswb-tp-"));
    const workers: WorkerProcessCompute[] = [];
    const closers: Array<() => Promise<unknown>> = [];
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    try {
      const setup: Setup = {
        bin,
        model: model.path,
        draft: { path: model.draftPath, max: DRAFT_MAX },
        dir,
        startDelayProxy,
      };
      const nLayers = await cells(setup, rows, ratios, closers, workers);
      const draftNote = model.draftPath ? ` (draft: ${PRESET}-draft, --spec-draft-n-max ${DRAFT_MAX})` : "";
      return {
        rows,
        ratios,
        notes: [
          `${PRESET} ${DESCRIPTION_MODEL}${draftNote}, ${nLayers} remote MoE layers, ${N_PREDICT} tokens per client, ${REPEAT} measured runs per cell (median; swarmRange: min-max), llama-server -t 1 -kvu`,
          "RTT: a userspace delay proxy between the bridge and the hub (placement, relay); workers on loopback to the hub",
          "plain cells are measured first, then the swarm's (so plain and swarm are not paired round by round; the variants are)",
          "variants run interleaved, round by round, under the same load; ratio: swarm/plain of the same variant; vsNone: median over rounds of swarm tok/s over variant none's swarm tok/s in the same round (same C and RTT)",
          "roundTripsPerToken: bridge requests / (remote layers x generated tokens); framesPerLayerStep: per llama_decode; acceptance: accepted / drafted tokens",
          "wire: the dtype the activations travelled in to the workers (a mix shows each one's share of the worker requests); wireBytesPerToken: dispatch and result bytes on the wire per generated token, activations as they travelled",
          "identical: swarm texts = plain's of the same variant; plainRepeatable: plain's repeats agree (llama-server batches by arrival time, so at C > 1 neither is guaranteed; the llama-server test checks identity at fixed batches)",
        ],
      };
    } finally {
      for (const close of closers.reverse()) await close().catch(() => {});
      await Promise.all(workers.map((w) => w.close().catch(() => {})));
      await rm(dir, { recursive: true, force: true });
    }
  },
};

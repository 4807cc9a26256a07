import { formatRange, frameAllocatorAdvice, frameAllocatorState, onAbort, toRanges } from "@moeswarm/core";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import { findExpertTensors, readGguf } from "@moeswarm/shard";
import {
  loadActivationQuantizer,
  spawnLlamaExpertWorker,
  type WorkerProcessCompute,
} from "@moeswarm/worker-native";
import {
  type BackboneBridge,
  type BackboneBridgeOptions,
  type BackboneHubOptions,
  serveBackboneBridge,
} from "../bridge.js";
import type { HubLinkEvent } from "../hub-events.js";
import { formatLayerSelection, moeswarmOverride } from "../layers.js";
import { pluginPath } from "../native-paths.js";
import { createLocalFallback, expertComputeHandler, type LocalFallback } from "../worker-handler.js";
import { waitForHub } from "./hub-wait.js";
import {
  CLI_NAME,
  type CliConfig,
  type CliIo,
  hubOptions,
  isUsageError,
  parse,
  readConfig,
  USAGE,
  usageError,
  type Values,
} from "./options.js";

export { CLI_NAME, type CliIo } from "./options.js";

type Out = (line: string) => void;

/** Runs the dispatcher until `signal` aborts; resolves with the exit status (2: bad usage). */
export async function runDispatcherCli(
  args: readonly string[],
  io: CliIo,
  signal: AbortSignal,
): Promise<number> {
  let values: Values;
  try {
    values = parse(args).values;
    if (values.help) {
      io.stdout.write(USAGE);
      return 0;
    }
  } catch (error) {
    io.stderr.write(`${CLI_NAME}: ${(error as Error).message}\n\n${USAGE}`);
    return 2;
  }
  try {
    const config = readConfig(values, io);
    if (config.hubUrl !== undefined) {
      const hub = hubOptions(config.hubUrl, values, config.modelId, config.reportS * 1000);
      return await serveHub({ ...config, io, signal, hub });
    }
    return await serveWorkers(config, values.worker ?? [], io, signal);
  } catch (error) {
    if (isUsageError(error)) {
      io.stderr.write(`${CLI_NAME}: ${(error as Error).message}\n\n${USAGE}`);
      return 2;
    }
    io.stderr.write(`${CLI_NAME}: ${error instanceof Error ? error.message : String(error)}\n`);
    return 1;
  }
}

function describeExperts(experts: readonly number[]): string {
  return toRanges([...experts])
    .map(formatRange)
    .join(",");
}

interface WorkerSpec {
  id: string;
  path: string;
}

function workerSpecs(flags: readonly string[]): WorkerSpec[] {
  const specs = flags.map((w) => {
    const eq = w.indexOf("=");
    if (eq <= 0 || eq === w.length - 1) throw usageError(`--worker ${w}: expected <id>=<slice.gguf>`);
    return { id: w.slice(0, eq), path: w.slice(eq + 1) };
  });
  if (new Set(specs.map((s) => s.id)).size !== specs.length) throw usageError("worker ids must be unique");
  return specs;
}

/** The MoE layers of a GGUF and its experts per layer. */
async function moeLayout(
  modelPath: string,
  signal: AbortSignal,
): Promise<{ layers: number[]; nExpert: number }> {
  const layout = findExpertTensors(await readGguf(modelPath, { signal }));
  if (layout.layers.length === 0) throw usageError(`${modelPath} has no routed experts`);
  return { layers: layout.layers.map((l) => l.layer), nExpert: layout.layers[0]!.nExpert };
}

/** Starts a llama-cpu worker process per --worker (pushed to `workers` as it starts), in one placement. */
async function startWorkers(
  specs: readonly WorkerSpec[],
  c: CliConfig,
  workers: WorkerProcessCompute[],
  out: Out,
  signal: AbortSignal,
): Promise<{ placement: Placement; transport: InProcessTransport }> {
  const model = c.modelId;
  const placement = new Placement({ model });
  const transport = new InProcessTransport();
  for (const spec of specs) {
    const worker = await spawnLlamaExpertWorker(spec.path, { threads: c.threads, model, signal });
    workers.push(worker);
    transport.set(spec.id, expertComputeHandler(worker));
    const { layers, experts } = worker.registration;
    placement.register({ id: spec.id, model, layers, experts });
    const line = `worker ${spec.id}: layers ${formatLayerSelection(layers)}, experts ${describeExperts(experts)} (${worker.info.device ?? "cpu"})`;
    if (!c.json) out(line);
  }
  return { placement, transport };
}

/** --worker: the bridge sends the experts to worker processes started here. */
async function serveWorkers(
  c: CliConfig,
  flags: readonly string[],
  io: CliIo,
  signal: AbortSignal,
): Promise<number> {
  const out: Out = (line) => io.stdout.write(`${line}\n`);
  const workers: WorkerProcessCompute[] = [];
  let bridge: BackboneBridge | undefined;
  let fallback: LocalFallback | undefined;
  try {
    const modelPath = c.modelPath;
    if (modelPath === undefined) throw usageError("--model <gguf> is required");
    const specs = workerSpecs(flags);
    const moe = await moeLayout(modelPath, signal);
    const { placement, transport } = await startWorkers(specs, c, workers, out, signal);
    if (!c.noFallback) fallback = await createLocalFallback(modelPath, { threads: c.threads });
    const missing = placement.missing({ layers: moe.layers, nExpert: moe.nExpert });
    if (c.noFallback && missing.length > 0) {
      const shown = missing.map((m) => `layer ${m.layer}: ${m.experts}`).join("; ");
      throw usageError(`with --no-fallback every expert needs a worker; nobody serves ${shown}`);
    }
    bridge = await serveBackboneBridge({
      socket: c.socket,
      model: c.modelId,
      placement,
      transport,
      deadlineMs: c.deadlineMs,
      ...c.extra,
      ...(await wireOption(c)),
      ...(fallback ? { fallback: fallback.compute } : {}),
    });
    // the remote layers: those some worker serves, or all (every expert then runs in the fallback)
    const served = [...new Set(workers.flatMap((w) => w.registration.layers))].sort((a, b) => a - b);
    const layers = served.length > 0 ? served : moe.layers;
    const override = moeswarmOverride(layers.length === moe.layers.length ? "all" : layers);
    printWorkersListening(out, c, bridge, { modelPath, override, layers, workers: specs.map((s) => s.id) });
    await untilAborted(out, c, bridge, signal, false);
    return 0;
  } finally {
    await bridge?.close();
    await fallback?.close();
    await Promise.all(workers.map((w) => w.close().catch(() => {})));
  }
}

function printWorkersListening(
  out: Out,
  c: CliConfig,
  bridge: BackboneBridge,
  shown: { modelPath: string; override: string; layers: number[]; workers: string[] },
): void {
  const plugin = pluginPath();
  const env = `GGML_BACKEND_PATH=${plugin} MOESWARM_BRIDGE=${bridge.address} MOESWARM_MODEL=${c.modelId}`;
  if (c.json) {
    out(
      JSON.stringify({
        event: "listening",
        address: bridge.address,
        model: c.modelId,
        plugin,
        override: shown.override,
        llamaServer: `${env} ${llamaServerCommand(shown.modelPath, shown.override, c.draft)}`,
        layers: shown.layers,
        fallback: !c.noFallback,
        workers: shown.workers,
        malloc: frameAllocatorState(),
      }),
    );
  } else {
    out(
      `listening on ${bridge.address} (model id ${JSON.stringify(c.modelId)}, local fallback ${c.noFallback ? "off" : "on"})`,
    );
    out(`  llama-server: ${env} ${llamaServerCommand(shown.modelPath, shown.override, c.draft)}`);
    out(`  node-llama-cpp: ${env} MOESWARM_LAYERS=${formatLayerSelection(shown.layers)}`);
    mallocLine(out);
  }
}

/**
 * The llama-server command line for the plugin: every flag that matters. `-ot` hands the experts
 * to the MOESWARM buffer type; `-fit off` because llama.cpp's fitting probe gives up when overrides
 * are set; `--load-mode none` (no mmap; `--no-mmap` is deprecated in this release) because with mmap loading llama.cpp still maps and touches the experts'
 * pages, so the memory saving only shows without it; `-kvu` (one unified KV cache) because with a
 * KV stream per slot llama.cpp splits a decode batch wherever the busy slots' ids are not
 * consecutive, and every piece pays each remote layer's round trip again. With a draft model,
 * `-md <draft> --spec-type draft-simple --spec-draft-n-max N`: the draft runs locally (no `-otd`),
 * and each remote layer's round trip verifies up to N + 1 tokens of every busy slot at once.
 */
export function llamaServerCommand(
  modelPath: string,
  override: string,
  draft?: { path: string; max: number },
): string {
  const spec = draft ? ` -md ${draft.path} --spec-type draft-simple --spec-draft-n-max ${draft.max}` : "";
  return `llama-server -m ${modelPath} -ot '${override}' -fit off --load-mode none -kvu${spec}`;
}

/**
 * Prints the metrics every --stats-interval until `signal` aborts, then once more (with
 * `closeFirst`, after closing the bridge: the metrics then include the final report to the hub).
 */
async function untilAborted(
  out: Out,
  c: Pick<CliConfig, "json" | "statsS">,
  bridge: BackboneBridge,
  signal: AbortSignal,
  closeFirst: boolean,
): Promise<void> {
  const report = () => printMetrics(out, c.json, bridge);
  const timer = c.statsS > 0 ? setInterval(report, c.statsS * 1000) : undefined;
  try {
    await new Promise<void>((resolve) => onAbort(signal, () => resolve()));
    if (closeFirst) await bridge.close();
    report();
  } finally {
    clearInterval(timer);
  }
}

function printMetrics(out: (line: string) => void, json: boolean, bridge: BackboneBridge): void {
  const m = bridge.metrics();
  if (json) {
    out(JSON.stringify({ event: "metrics", ...m }));
    return;
  }
  out(
    `requests ${m.requests} (failed ${m.failed}), tokens ${m.tokens}, failovers ${m.failovers}, fallbacks ${m.fallbacks}, audits ${m.audits}`,
  );
  for (const l of m.layers) {
    out(
      `  layer ${l.layer}: ${l.requests} requests, p50 ${l.p50Ms.toFixed(2)} ms, p99 ${l.p99Ms.toFixed(2)} ms`,
    );
  }
  if (m.verification && (m.verification.partsVerified > 0 || m.verification.unverifiableLocal > 0)) {
    const v = m.verification;
    out(
      `  verification: ${v.partsVerified} parts verified, ${v.disagreements} disagreements, ${v.thirdOpinions} third opinions, ` +
        `${v.quarantines} quarantined${v.quarantined.length ? ` (${v.quarantined.join(", ")})` : ""}, ${v.unverifiableLocal} served locally, ` +
        `cost ${(v.extraBytes / 1e6).toFixed(2)} MB + ${v.extraComputeMs.toFixed(0)} worker ms`,
    );
  }
  if (m.liveness && m.liveness.timeouts > 0) {
    const l = m.liveness;
    out(
      `  liveness: ${l.timeouts} timeouts, ${l.opens} circuits opened, open now: ${l.open.join(", ") || "none"}`,
    );
  }
  if (m.hub) {
    const h = m.hub;
    out(
      `  hub: placement v${h.placementVersion} (${h.placementUpdates} updates, ${h.workers} workers, ${h.missingExperts} experts missing), ` +
        `reports ${h.statsAccepted} (errors ${h.statsErrors}), poll errors ${h.pollErrors}, relay ${h.relay}`,
    );
    if (h.direct) {
      const d = h.direct;
      out(
        `  direct links: ${d.direct} requests direct, ${d.relay} over the relay (${d.retried} resent after a link died); ` +
          `up to ${d.linked.length ? d.linked.join(", ") : "no worker"}; ${d.dials} dials, ${d.dialFailures} failed`,
      );
    }
  }
  const n = m.native;
  if (n?.enabled) {
    const codes = Object.entries(n.failures).map(([code, count]) => `${code} ${count}`);
    out(
      `  native: ${n.table.layers.length} layer(s) in the table (v${n.table.seq}, deadline ${n.table.deadlineMs} ms), ` +
        `${n.splits} native splits, ${n.expertTokens} expert-tokens credited, ${n.fallbacks} fell back to the bridge` +
        `${codes.length ? ` (${codes.join(", ")})` : ""}${n.dropped.length ? `; backing off: ${n.dropped.join(", ")}` : ""}`,
    );
  }
}

/** The hub link's events as log lines (or JSON events). */
function hubEventPrinter(out: Out, io: CliIo, json: boolean): (e: HubLinkEvent) => void {
  return (e) => {
    if (e.type === "placement") {
      if (json) out(JSON.stringify({ event: "placement", ...e }));
      else {
        out(
          `placement v${e.version}: ${e.workers.length} worker(s)${e.workers.length ? ` (${e.workers.slice(0, 16).join(", ")}${e.workers.length > 16 ? ", ..." : ""})` : ""}, ${e.missing} expert(s) missing`,
        );
      }
    } else if (e.type === "relay") {
      const why = e.error ? `: ${e.error.code}: ${e.error.message}` : "";
      if (json)
        out(JSON.stringify({ event: "relay", state: e.state, ...(e.error ? { code: e.error.code } : {}) }));
      else if (e.state !== "connected") io.stderr.write(`${CLI_NAME}: relay ${e.state}${why}\n`);
      else out("relay connected");
    } else if (e.type === "direct") {
      const code = e.error && "code" in e.error ? String(e.error.code) : undefined;
      if (json)
        out(
          JSON.stringify({
            event: "direct",
            worker: e.worker,
            state: e.state,
            ...(e.url ? { url: e.url } : {}),
            ...(code ? { code } : {}),
            ...(e.retryInMs !== undefined ? { retryInMs: e.retryInMs } : {}),
          }),
        );
      else if (e.state === "linked") out(`direct link to worker ${e.worker} (${e.url})`);
      else
        out(
          `direct link to worker ${e.worker} ${e.state === "lost" ? "lost" : "failed"}${e.error ? ` (${code ? `${code}: ` : ""}${e.error.message})` : ""}; the relay carries its requests, next dial in ${Math.round((e.retryInMs ?? 0) / 1000)} s`,
        );
    } else if (e.type === "quarantine-report") {
      if (json) out(JSON.stringify({ event: "quarantine-report", worker: e.worker, accepted: e.accepted }));
      else out(`reported worker ${e.worker}'s quarantine to the hub`);
    } else if (e.type === "error") {
      const text = `hub ${e.source} failed: ${e.error.code}: ${e.error.message}${e.dropped ? " (report dropped)" : e.retryInMs !== undefined ? ` (retry in ${e.retryInMs} ms)` : ""}${e.hint ? `: ${e.hint}` : ""}`;
      if (json)
        out(
          JSON.stringify({
            event: "hub-error",
            source: e.source,
            code: e.error.code,
            message: e.error.message,
            ...(e.hint ? { hint: e.hint } : {}),
          }),
        );
      else io.stderr.write(`${CLI_NAME}: ${text}\n`);
    }
  };
}

interface HubServe extends CliConfig {
  io: CliIo;
  signal: AbortSignal;
  hub: BackboneHubOptions;
}

/**
 * --wire-dtype q8: the activation quantizer of --model. Without the native addon the activations
 * travel as f32 (the same bits, more bytes), so it is never a reason to stop.
 */
async function wireOption(c: CliConfig): Promise<Pick<BackboneBridgeOptions, "wire">> {
  if (c.wireDtype !== "q8" || c.modelPath === undefined) return {};
  try {
    return { wire: await loadActivationQuantizer(c.modelPath) };
  } catch {
    return {};
  }
}

/** --hub: the bridge follows the hub's placement and reaches its workers through the relay. */
async function serveHub(o: HubServe): Promise<number> {
  const { io, json, signal } = o;
  const out: Out = (line) => io.stdout.write(`${line}\n`);
  let fallback: LocalFallback | undefined;
  let bridge: BackboneBridge | undefined;
  try {
    const moe = o.modelPath !== undefined ? await moeLayout(o.modelPath, signal) : undefined;
    if (!o.noFallback) fallback = await createLocalFallback(o.modelPath as string, { threads: o.threads });
    const wire = await wireOption(o);
    const start = () =>
      serveBackboneBridge({
        socket: o.socket,
        hub: { ...o.hub, onEvent: hubEventPrinter(out, io, json) },
        deadlineMs: o.deadlineMs,
        ...o.extra,
        ...wire,
        signal,
        ...(fallback ? { fallback: fallback.compute } : {}),
      });
    bridge = await waitForHub(start, {
      signal,
      onRetry: (error, retryInMs) => {
        const e = error as Error & { code?: string };
        if (json) {
          out(
            JSON.stringify({
              event: "hub-wait",
              hub: o.hub.url,
              code: e.code,
              message: e.message,
              retryInMs,
            }),
          );
        } else {
          io.stderr.write(
            `${CLI_NAME}: cannot reach the hub at ${o.hub.url} (${e.code ? `${e.code}: ` : ""}${e.message}); retrying in ${(retryInMs / 1000).toFixed(1)} s (Ctrl-C to stop)\n`,
          );
        }
      },
    });
    const current = bridge.hub!.current();
    if (
      moe !== undefined &&
      (current.nExpert !== moe.nExpert || current.layers.join() !== moe.layers.join())
    ) {
      throw usageError(
        `--model ${o.modelPath} is not the hub's ${o.hub.model}: MoE layers ${formatLayerSelection(moe.layers)} x ${moe.nExpert} experts, the hub's ${formatLayerSelection([...current.layers])} x ${current.nExpert}`,
      );
    }
    // every MoE layer goes to the bridge: the placement changes while it runs, gaps go to the fallback
    printHubListening(out, o, bridge, moe?.layers ?? [...current.layers], fallback !== undefined);
    await untilAborted(out, o, bridge, signal, true);
    return 0;
  } finally {
    await bridge?.close();
    await fallback?.close();
  }
}

function printHubListening(
  out: Out,
  o: HubServe,
  bridge: BackboneBridge,
  layers: number[],
  fallback: boolean,
): void {
  const link = bridge.hub!;
  const current = link.current();
  const plugin = pluginPath();
  const override = moeswarmOverride("all");
  const env = `GGML_BACKEND_PATH=${plugin} MOESWARM_BRIDGE=${bridge.address} MOESWARM_MODEL=${o.hub.model}`;
  if (o.json) {
    out(
      JSON.stringify({
        event: "listening",
        address: bridge.address,
        model: o.hub.model,
        plugin,
        override,
        llamaServer: `${env} ${llamaServerCommand(o.modelPath ?? "<model.gguf>", override, o.draft)}`,
        layers,
        fallback,
        hub: link.url,
        id: link.id,
        placementVersion: current.version,
        workers: [...current.workers],
        malloc: frameAllocatorState(),
      }),
    );
  } else {
    out(
      `listening on ${bridge.address} (hub ${link.url}, model id ${JSON.stringify(o.hub.model)}, backbone id ${JSON.stringify(link.id)}, local fallback ${fallback ? "on" : "off"})`,
    );
    out(`  llama-server: ${env} ${llamaServerCommand(o.modelPath ?? "<model.gguf>", override, o.draft)}`);
    out(`  node-llama-cpp: ${env} MOESWARM_LAYERS=all`);
    mallocLine(out);
  }
}

/** The dispatcher receives workers' large results: with glibc's defaults, what to set (core frame-allocator.ts). */
function mallocLine(out: Out): void {
  const advice = frameAllocatorAdvice(frameAllocatorState());
  if (advice !== undefined) out(`  malloc: ${advice}`);
}

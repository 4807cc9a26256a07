import { existsSync, readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { formatRange, InvalidArgumentError, isMoeswarmError, toRanges } from "@moeswarm/core";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import { findExpertTensors, readGguf } from "@moeswarm/shard";
import { spawnLlamaExpertWorker, type WorkerProcessCompute } from "@moeswarm/worker-native";
import {
  type BackboneBridge,
  type BackboneBridgeOptions,
  type BackboneHubOptions,
  type BridgeSocket,
  serveBackboneBridge,
} from "../bridge.js";
import { checkHubOptions, type HubLinkEvent } from "../hub-link.js";
import { formatLayerSelection, moeswarmOverride } from "../layers.js";
import { pluginPath } from "../native-paths.js";
import { createLocalFallback, expertComputeHandler, type LocalFallback } from "../worker-handler.js";

export const CLI_NAME = "moeswarm-dispatcher";

/** Where the CLI writes: injectable so it runs in-process too. */
export interface CliIo {
  stdout: NodeJS.WritableStream;
  stderr: NodeJS.WritableStream;
}

const USAGE = `usage: ${CLI_NAME} (--socket <path> | --tcp <host:port>) --model <gguf> [--worker <id>=<slice>]... [options]
       ${CLI_NAME} (--socket <path> | --tcp <host:port>) --hub <url> (--token <t> | --token-file <f>)
                   --model-id <id> [--model <gguf>] [options]

Runs the bridge beside a llama.cpp that has libggml-moeswarm.so loaded (llama-server, the
llama-logits harness): it answers the plugin's requests by sending the experts to workers,
either worker processes it starts here (--worker), or the workers of a hub (--hub): then it
follows the hub's live placement, reaches the workers through the hub's relay and reports
routing statistics and receipts to the hub.

  --socket <path>         Unix socket to listen on (MOESWARM_BRIDGE=unix:<path>)
  --tcp <host:port>       TCP instead (port 0: any free port)
  --model <gguf>          the model llama.cpp loads: its layers, and the local fallback's experts
                          (optional with --hub: without it there is no local fallback)
  --model-id <id>         model id in the requests (MOESWARM_MODEL; default "moeswarm"); with
                          --hub, the hub's model id (required)
  --worker <id>=<slice>   start a llama-cpu worker process on a slice GGUF; repeatable
  --hub <url>             the hub's URL (https://hub.example); exclusive with --worker
  --token <token>         a backbone token of the hub
  --token-file <file>     the token in a file (read again at each use, so it can be rotated)
  --ca <pem file>         trust this CA for the hub (a self-hosted hub's certificate)
  --id <id>               this backbone's id on the hub (default: the token's, else host-pid-random)
  --report-interval <s>   seconds between statistics reports to the hub (default 10)
  --threads <n>           compute threads per worker and for the fallback (default 1)
  --no-fallback           experts no worker serves fail the decode instead of running here
  --deadline-ms <ms>      per worker request, before failover (default 30000)
  --spot-check <share>    recompute this share (0..1) of the workers' answers with the local
                          fallback (else a replica) and quarantine a worker that disagrees
  --hedge-ms <ms>         ask a replica too when a worker has not answered after this long
  --stats-interval <s>    print the metrics every s seconds (default: only at exit)
  --json                  one JSON object per line on stdout
  --help                  this text
`;

function usageError(message: string): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", message, { details: { usage: true } });
}

function isUsageError(error: unknown): boolean {
  return (
    isMoeswarmError(error, "MOESWARM_INVALID_ARGUMENT") &&
    (error.details as { usage?: unknown } | undefined)?.usage === true
  );
}

function int(text: string | undefined, name: string, fallback: number, min: number, max: number): number {
  if (text === undefined) return fallback;
  if (!/^\d+$/.test(text) || Number(text) < min || Number(text) > max) {
    throw usageError(`--${name} must be an integer in ${min}..${max}, got ${JSON.stringify(text)}`);
  }
  return Number(text);
}

/** The bridge options of --spot-check and --hedge-ms, with quarantines reported as they happen. */
function resilience(
  values: { "spot-check"?: string | undefined; "hedge-ms"?: string | undefined },
  json: boolean,
  io: CliIo,
): Pick<BackboneBridgeOptions, "spotCheck" | "hedgeMs"> {
  const out: Pick<BackboneBridgeOptions, "spotCheck" | "hedgeMs"> = {};
  const share = values["spot-check"];
  if (share !== undefined) {
    const fraction = Number(share);
    if (!/^(0|1|0?\.\d+|1\.0*)$/.test(share) || !(fraction >= 0 && fraction <= 1)) {
      throw usageError(`--spot-check must be a share in 0..1, got ${JSON.stringify(share)}`);
    }
    out.spotCheck = {
      fraction,
      onQuarantine: (e) => {
        if (json) io.stdout.write(`${JSON.stringify({ event: "quarantine", ...e })}\n`);
        else io.stderr.write(`${CLI_NAME}: quarantined worker ${e.worker} (layer ${e.layer}): ${e.reason}\n`);
      },
    };
  }
  if (values["hedge-ms"] !== undefined) out.hedgeMs = int(values["hedge-ms"], "hedge-ms", 0, 0, 2 ** 31 - 1);
  return out;
}

function describeExperts(experts: readonly number[]): string {
  return toRanges([...experts])
    .map(formatRange)
    .join(",");
}

/** Runs the dispatcher until `signal` aborts; resolves with the exit status (2: bad usage). */
export async function runDispatcherCli(
  args: readonly string[],
  io: CliIo,
  signal: AbortSignal,
): Promise<number> {
  const out = (line: string) => io.stdout.write(`${line}\n`);
  let values: ReturnType<typeof parse>["values"];
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
  const workers: WorkerProcessCompute[] = [];
  let bridge: BackboneBridge | undefined;
  let fallback: LocalFallback | undefined;
  let timer: NodeJS.Timeout | undefined;
  try {
    const json = values.json === true;
    const modelPath = values.model;
    const hubUrl = values.hub;
    if (hubUrl === undefined) {
      for (const flag of ["token", "token-file", "ca", "id", "report-interval"] as const) {
        if (values[flag] !== undefined) throw usageError(`--${flag} needs --hub`);
      }
      if (!modelPath) throw usageError("--model <gguf> is required");
    } else {
      if (values.worker !== undefined) throw usageError("--worker and --hub are exclusive");
      if (values["model-id"] === undefined) throw usageError("--hub needs --model-id <the hub's model id>");
      if ((values.token === undefined) === (values["token-file"] === undefined)) {
        throw usageError("--hub needs one of --token <t> or --token-file <f>");
      }
    }
    if (modelPath !== undefined && !existsSync(modelPath))
      throw usageError(`--model ${modelPath} does not exist`);
    if ((values.socket === undefined) === (values.tcp === undefined)) {
      throw usageError("give one of --socket <path> or --tcp <host:port>");
    }
    let socket: string | { host: string; port: number };
    if (values.socket !== undefined) socket = values.socket;
    else {
      const m = /^(.+):(\d+)$/.exec(values.tcp!);
      if (!m) throw usageError("--tcp must be host:port");
      socket = { host: m[1]!.replace(/^\[(.*)\]$/, "$1"), port: int(m[2], "tcp port", 0, 0, 65535) };
    }
    const threads = int(values.threads, "threads", 1, 1, 512);
    const deadlineMs = int(values["deadline-ms"], "deadline-ms", 30_000, 1, 2 ** 31 - 1);
    const statsS = int(values["stats-interval"], "stats-interval", 0, 0, 86_400);
    const reportS = int(values["report-interval"], "report-interval", 10, 1, 86_400);
    const modelId = values["model-id"] ?? "moeswarm";
    const noFallback = values["no-fallback"] === true || modelPath === undefined;
    const extra = resilience(values, json, io);
    if (hubUrl !== undefined) {
      const hub = hubOptions(hubUrl, values, modelId, reportS * 1000);
      return await serveHub({
        io,
        json,
        signal,
        socket,
        modelPath,
        noFallback,
        threads,
        deadlineMs,
        statsS,
        hub,
        extra,
      });
    }
    if (modelPath === undefined) throw usageError("--model <gguf> is required");
    const specs = (values.worker ?? []).map((w) => {
      const eq = w.indexOf("=");
      if (eq <= 0 || eq === w.length - 1) throw usageError(`--worker ${w}: expected <id>=<slice.gguf>`);
      return { id: w.slice(0, eq), path: w.slice(eq + 1) };
    });
    if (new Set(specs.map((s) => s.id)).size !== specs.length) throw usageError("worker ids must be unique");

    const layout = findExpertTensors(await readGguf(modelPath, { signal }));
    if (layout.layers.length === 0) throw usageError(`${modelPath} has no routed experts`);
    const nExpert = layout.layers[0]!.nExpert;
    const moeLayers = layout.layers.map((l) => l.layer);

    const placement = new Placement({ model: modelId });
    const transport = new InProcessTransport();
    for (const spec of specs) {
      const worker = await spawnLlamaExpertWorker(spec.path, { threads, model: modelId, signal });
      workers.push(worker);
      transport.set(spec.id, expertComputeHandler(worker));
      placement.register({
        id: spec.id,
        model: modelId,
        layers: worker.registration.layers,
        experts: worker.registration.experts,
      });
      const line = `worker ${spec.id}: layers ${formatLayerSelection(worker.registration.layers)}, experts ${describeExperts(worker.registration.experts)} (${worker.info.device ?? "cpu"})`;
      if (!json) out(line);
    }
    if (!noFallback) fallback = await createLocalFallback(modelPath, { threads });
    const missing = placement.missing({ layers: moeLayers, nExpert });
    if (noFallback && missing.length > 0) {
      const shown = missing.map((m) => `layer ${m.layer}: ${m.experts}`).join("; ");
      throw usageError(`with --no-fallback every expert needs a worker; nobody serves ${shown}`);
    }
    bridge = await serveBackboneBridge({
      socket,
      model: modelId,
      placement,
      transport,
      deadlineMs,
      ...extra,
      ...(fallback ? { fallback: fallback.compute } : {}),
    });
    // the remote layers: those some worker serves, or all (every expert then runs in the fallback)
    const served = [...new Set(workers.flatMap((w) => w.registration.layers))].sort((a, b) => a - b);
    const layers = served.length > 0 ? served : moeLayers;
    const plugin = pluginPath();
    const override = moeswarmOverride(layers.length === moeLayers.length ? "all" : layers);
    const env = `GGML_BACKEND_PATH=${plugin} MOESWARM_BRIDGE=${bridge.address} MOESWARM_MODEL=${modelId}`;
    if (json) {
      out(
        JSON.stringify({
          event: "listening",
          address: bridge.address,
          model: modelId,
          plugin,
          override,
          layers,
          fallback: !noFallback,
          workers: specs.map((s) => s.id),
        }),
      );
    } else {
      out(
        `listening on ${bridge.address} (model id ${JSON.stringify(modelId)}, local fallback ${noFallback ? "off" : "on"})`,
      );
      out(`  llama-server: ${env} llama-server -m ${modelPath} -ot '${override}' -fit off`);
      out(`  node-llama-cpp: ${env} MOESWARM_LAYERS=${formatLayerSelection(layers)}`);
    }
    const report = () => printMetrics(out, json, bridge!);
    if (statsS > 0) timer = setInterval(report, statsS * 1000);
    await aborted(signal);
    report();
    return 0;
  } catch (error) {
    if (isUsageError(error)) {
      io.stderr.write(`${CLI_NAME}: ${(error as Error).message}\n\n${USAGE}`);
      return 2;
    }
    io.stderr.write(`${CLI_NAME}: ${error instanceof Error ? error.message : String(error)}\n`);
    return 1;
  } finally {
    clearInterval(timer);
    await bridge?.close();
    await fallback?.close();
    await Promise.all(workers.map((w) => w.close().catch(() => {})));
  }
}

function printMetrics(out: (line: string) => void, json: boolean, bridge: BackboneBridge): void {
  const m = bridge.metrics();
  if (json) {
    out(JSON.stringify({ event: "metrics", ...m }));
    return;
  }
  out(
    `requests ${m.requests} (failed ${m.failed}), tokens ${m.tokens}, failovers ${m.failovers}, fallbacks ${m.fallbacks}`,
  );
  for (const l of m.layers) {
    out(
      `  layer ${l.layer}: ${l.requests} requests, p50 ${l.p50Ms.toFixed(2)} ms, p99 ${l.p99Ms.toFixed(2)} ms`,
    );
  }
  if (m.hub) {
    const h = m.hub;
    out(
      `  hub: placement v${h.placementVersion} (${h.placementUpdates} updates, ${h.workers} workers, ${h.missingExperts} experts missing), ` +
        `reports ${h.statsAccepted} (errors ${h.statsErrors}), poll errors ${h.pollErrors}, relay ${h.relay}`,
    );
  }
}

function aborted(signal: AbortSignal): Promise<void> {
  return new Promise<void>((resolve) => {
    if (signal.aborted) resolve();
    else signal.addEventListener("abort", () => resolve(), { once: true });
  });
}

type Values = ReturnType<typeof parse>["values"];

function hubOptions(url: string, values: Values, model: string, statsIntervalMs: number): BackboneHubOptions {
  let token: BackboneHubOptions["token"];
  const file = values["token-file"];
  if (file !== undefined) {
    const read = () => {
      let text: string;
      try {
        text = readFileSync(file, "utf8").trim();
      } catch (error) {
        throw usageError(`--token-file ${file}: ${(error as Error).message}`);
      }
      if (text.length === 0) throw usageError(`--token-file ${file} is empty`);
      return text;
    };
    read();
    token = read;
  } else token = values.token as string;
  let ca: string | undefined;
  if (values.ca !== undefined) {
    try {
      ca = readFileSync(values.ca, "utf8");
    } catch (error) {
      throw usageError(`--ca ${values.ca}: ${(error as Error).message}`);
    }
  }
  try {
    const hub: BackboneHubOptions = {
      url,
      token,
      model,
      statsIntervalMs,
      ...(ca !== undefined ? { ca } : {}),
      ...(values.id !== undefined ? { id: values.id } : {}),
    };
    checkHubOptions(hub);
    return hub;
  } catch (error) {
    const flags: Record<string, string> = {
      url: "hub",
      model: "model-id",
      statsIntervalMs: "report-interval",
    };
    throw usageError((error as Error).message.replace(/^hub\.(\w+)/, (_, k: string) => `--${flags[k] ?? k}`));
  }
}

interface HubServe {
  io: CliIo;
  json: boolean;
  signal: AbortSignal;
  socket: BridgeSocket;
  modelPath: string | undefined;
  noFallback: boolean;
  threads: number;
  deadlineMs: number;
  statsS: number;
  hub: BackboneHubOptions;
  extra: Pick<BackboneBridgeOptions, "spotCheck" | "hedgeMs">;
}

/** --hub: the bridge follows the hub's placement and reaches its workers through the relay. */
async function serveHub(o: HubServe): Promise<number> {
  const { io, json, signal } = o;
  const out = (line: string) => o.io.stdout.write(`${line}\n`);
  let fallback: LocalFallback | undefined;
  let bridge: BackboneBridge | undefined;
  let timer: NodeJS.Timeout | undefined;
  try {
    let moeLayers: number[] | undefined;
    let nExpert: number | undefined;
    if (o.modelPath !== undefined) {
      const layout = findExpertTensors(await readGguf(o.modelPath, { signal }));
      if (layout.layers.length === 0) throw usageError(`${o.modelPath} has no routed experts`);
      moeLayers = layout.layers.map((l) => l.layer);
      nExpert = layout.layers[0]!.nExpert;
    }
    if (!o.noFallback) fallback = await createLocalFallback(o.modelPath as string, { threads: o.threads });
    const onEvent = (e: HubLinkEvent) => {
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
      } else if (e.type === "error") {
        const text = `hub ${e.source} failed: ${e.error.code}: ${e.error.message}${e.dropped ? " (report dropped)" : e.retryInMs !== undefined ? ` (retry in ${e.retryInMs} ms)` : ""}`;
        if (json)
          out(
            JSON.stringify({
              event: "hub-error",
              source: e.source,
              code: e.error.code,
              message: e.error.message,
            }),
          );
        else io.stderr.write(`${CLI_NAME}: ${text}\n`);
      }
    };
    bridge = await serveBackboneBridge({
      socket: o.socket,
      hub: { ...o.hub, onEvent },
      deadlineMs: o.deadlineMs,
      ...o.extra,
      signal,
      ...(fallback ? { fallback: fallback.compute } : {}),
    });
    const link = bridge.hub!;
    const current = link.current();
    if (
      moeLayers !== undefined &&
      (current.nExpert !== nExpert || current.layers.join() !== moeLayers.join())
    ) {
      throw usageError(
        `--model ${o.modelPath} is not the hub's ${o.hub.model}: MoE layers ${formatLayerSelection(moeLayers)} x ${nExpert} experts, the hub's ${formatLayerSelection([...current.layers])} x ${current.nExpert}`,
      );
    }
    // every MoE layer goes to the bridge: the placement changes while it runs, gaps go to the fallback
    const layers = moeLayers ?? [...current.layers];
    const plugin = pluginPath();
    const override = moeswarmOverride("all");
    const env = `GGML_BACKEND_PATH=${plugin} MOESWARM_BRIDGE=${bridge.address} MOESWARM_MODEL=${o.hub.model}`;
    if (json) {
      out(
        JSON.stringify({
          event: "listening",
          address: bridge.address,
          model: o.hub.model,
          plugin,
          override,
          layers,
          fallback: fallback !== undefined,
          hub: link.url,
          id: link.id,
          placementVersion: current.version,
          workers: [...current.workers],
        }),
      );
    } else {
      out(
        `listening on ${bridge.address} (hub ${link.url}, model id ${JSON.stringify(o.hub.model)}, backbone id ${JSON.stringify(link.id)}, local fallback ${fallback ? "on" : "off"})`,
      );
      out(
        `  llama-server: ${env} llama-server -m ${o.modelPath ?? "<model.gguf>"} -ot '${override}' -fit off`,
      );
      out(`  node-llama-cpp: ${env} MOESWARM_LAYERS=all`);
    }
    const report = () => printMetrics(out, json, bridge!);
    if (o.statsS > 0) timer = setInterval(report, o.statsS * 1000);
    await aborted(signal);
    // closed first: the metrics then include the final report to the hub
    await bridge.close();
    report();
    return 0;
  } finally {
    clearInterval(timer);
    await bridge?.close();
    await fallback?.close();
  }
}

function parse(args: readonly string[]) {
  try {
    return parseArgs({
      args: [...args],
      strict: true,
      allowPositionals: false,
      options: {
        socket: { type: "string" },
        tcp: { type: "string" },
        model: { type: "string" },
        "model-id": { type: "string" },
        worker: { type: "string", multiple: true },
        threads: { type: "string" },
        "no-fallback": { type: "boolean" },
        "deadline-ms": { type: "string" },
        "spot-check": { type: "string" },
        "hedge-ms": { type: "string" },
        "stats-interval": { type: "string" },
        hub: { type: "string" },
        token: { type: "string" },
        "token-file": { type: "string" },
        ca: { type: "string" },
        id: { type: "string" },
        "report-interval": { type: "string" },
        json: { type: "boolean" },
        help: { type: "boolean", short: "h" },
      },
    });
  } catch (error) {
    throw usageError((error as Error).message);
  }
}

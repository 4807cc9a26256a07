import { existsSync } from "node:fs";
import { parseArgs } from "node:util";
import { formatRange, InvalidArgumentError, isMoeswarmError, toRanges } from "@moeswarm/core";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import { findExpertTensors, readGguf } from "@moeswarm/shard";
import { spawnLlamaExpertWorker, type WorkerProcessCompute } from "@moeswarm/worker-native";
import { type BackboneBridge, serveBackboneBridge } from "../bridge.js";
import { formatLayerSelection, moeswarmOverride } from "../layers.js";
import { pluginPath } from "../native-paths.js";
import { createLocalFallback, expertComputeHandler, type LocalFallback } from "../worker-handler.js";

export const CLI_NAME = "moeswarm-dispatcher";

/** Where the CLI writes: injectable so it runs in-process too. */
export interface CliIo {
  stdout: NodeJS.WritableStream;
  stderr: NodeJS.WritableStream;
}

const USAGE = `usage: ${CLI_NAME} (--socket <path> | --tcp <host:port>) --model <gguf> [options]

Runs the bridge beside a llama.cpp that has libggml-moeswarm.so loaded (llama-server, the
llama-logits harness): it answers the plugin's requests by sending the experts to workers.

  --socket <path>         Unix socket to listen on (MOESWARM_BRIDGE=unix:<path>)
  --tcp <host:port>       TCP instead (port 0: any free port)
  --model <gguf>          the model llama.cpp loads: its layers, and the local fallback's experts
  --model-id <id>         model id in the requests (MOESWARM_MODEL; default "moeswarm")
  --worker <id>=<slice>   start a llama-cpu worker process on a slice GGUF; repeatable
  --threads <n>           compute threads per worker and for the fallback (default 1)
  --no-fallback           experts no worker serves fail the decode instead of running here
  --deadline-ms <ms>      per worker request, before failover (default 30000)
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
    if (!modelPath) throw usageError("--model <gguf> is required");
    if (!existsSync(modelPath)) throw usageError(`--model ${modelPath} does not exist`);
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
    const modelId = values["model-id"] ?? "moeswarm";
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
    const noFallback = values["no-fallback"] === true;
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
    const report = () => {
      const m = bridge!.metrics();
      if (json) out(JSON.stringify({ event: "metrics", ...m }));
      else {
        out(
          `requests ${m.requests} (failed ${m.failed}), tokens ${m.tokens}, failovers ${m.failovers}, fallbacks ${m.fallbacks}`,
        );
        for (const l of m.layers) {
          out(
            `  layer ${l.layer}: ${l.requests} requests, p50 ${l.p50Ms.toFixed(2)} ms, p99 ${l.p99Ms.toFixed(2)} ms`,
          );
        }
      }
    };
    if (statsS > 0) timer = setInterval(report, statsS * 1000);
    await new Promise<void>((resolve) => {
      if (signal.aborted) resolve();
      else signal.addEventListener("abort", () => resolve(), { once: true });
    });
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
        "stats-interval": { type: "string" },
        json: { type: "boolean" },
        help: { type: "boolean", short: "h" },
      },
    });
  } catch (error) {
    throw usageError((error as Error).message);
  }
}

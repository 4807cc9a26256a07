import { readFile } from "node:fs/promises";
import { homedir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { parseByteSize } from "@moeswarm/shard";
import {
  BACKEND_CHOICES,
  type BackendChoice,
  GPU_BACKEND_CHOICES,
  isBackendChoice,
  probeCuda,
  probeVulkan,
} from "@moeswarm/worker-native";
import cliProgress from "cli-progress";
import { hostFacts, workerDefaults } from "./device-defaults.js";
import { DIRECT_MATCH_MINUTES, DIRECT_REPORT_MAX_MS, directSettings } from "./direct.js";
import { enrolledToken } from "./enrol.js";
import { formatBytes, formatWorkerEvent, type WorkerEvent } from "./events.js";
import { nativeSettings } from "./native.js";
import { MAX_BATCH_ROWS_LIMIT } from "./options.js";
import type { PowerOptions } from "./power.js";
import { type RunWorkerOptions, runWorker } from "./run-worker.js";

export const WORKER_CLI_NAME = "moeswarm-worker";

/** Where the CLI writes; injectable so it runs in-process too. */
export interface WorkerCliIo {
  stdout: NodeJS.WritableStream;
  stderr: NodeJS.WritableStream & { isTTY?: boolean };
  env?: NodeJS.ProcessEnv;
}

const USAGE = `usage: ${WORKER_CLI_NAME} --hub <url> [--token T | --token-file F] [options]

Joins a moeswarm hub's swarm: claims the expert slice the swarm needs that fits this machine,
downloads and verifies it, serves it through the hub's relay until SIGINT/SIGTERM (drains first).

  --hub URL            the hub (or MOESWARM_HUB)
  --token T            a worker token (or MOESWARM_TOKEN)
  --token-file F       read the token from a file
  --enrol CODE         enrol with a code from the hub's operator instead of a token (the token
                       it buys is kept in the cache dir and used on later starts)
  --capacity SIZE      memory offered for expert weights, e.g. 2GiB (default: half the free memory;
                       on a phone also at most a quarter of its memory)
  --vram SIZE          device memory offered (default 0; --backend vulkan/cuda: the device's less
                       the compute buffer (~209 MiB at 512 rows, see --max-batch-rows) and a margin
                       (512 MiB or 1/32 of it, whichever is more); a GPU worker's claims are sized
                       by it, not by --capacity)
  --cache-dir DIR      where slices are kept across restarts (default ~/.cache/moeswarm/worker)
  --cache-max SIZE     most disk the cache may use, e.g. 20GiB; least recently used slices not
                       being served are deleted to make room (default: no limit; on a phone
                       half the free storage)
  --id ID              this worker's id (default: the token's, else <hostname>-<random>)
  --backend B          auto | native | llama-cpu | worker | vulkan | cuda | ts (default auto: the
                       native addon, else the static executable (Android, musl), else TypeScript);
                       vulkan needs npm package @node-llama-cpp/linux-x64-vulkan@3.21.1, cuda
                       @node-llama-cpp/linux-x64-cuda@3.21.1 and the NVIDIA driver
  --max-batch-rows N   --backend vulkan/cuda: most (token, expert) rows per compute graph, 1..65536
                       (default 512). The compute buffer is reserved for this many at load and
                       never grows; bigger batches are computed in chunks. Fewer rows leave more
                       device memory for weights (the default --vram follows it)
  --threads N          most compute threads (default: all CPUs; on a phone 4, its big cores)
  --pause-battery PCT  pause at or below this charge while discharging, resume 5 points above or
                       once charging (default 20; off: never); read from /sys every 30 s
  --pause-temp C       pause at or above this temperature, resume 5 degrees below (default 45 on
                       a device with a battery, read from the battery, else the hottest thermal
                       zone; off: never). While paused the hub routes this worker nothing new
  --model ID           serve only this model
  --ca FILE            PEM CA to trust for a self-hosted hub
  --relay URL          the relay, when not the hub's /relay
  --poll SECONDS       pause between demand polls while nothing is needed (default 10)
  --lease-ttl SECONDS  lease lifetime to ask for (default: the hub's)
  --listen HOST:PORT   also serve backbones directly on this TLS WebSocket address, e.g.
                       0.0.0.0:7443 (the relay stays for backbones that cannot reach it)
  --advertise URL      the wss://name:port backbones dial (repeatable; default wss://<host>:<port>)
  --listen-native HOST:PORT
                       also serve backbone plugins on the native listener at this TLS address,
                       e.g. 0.0.0.0:7444: a layer's work goes straight into this process's
                       compute threads (no relay, no JavaScript on the way) for the layers one
                       in-process native or llama-cpu slice holds; with or without --listen.
                       Without OpenSSL 3 in this Node the worker says so and serves without it
  --advertise-native HOST:PORT
                       the address backbones dial for --listen-native (repeatable; default
                       <host>:<port>)
  --tls-cert FILE      PEM certificate for --listen and --listen-native, with --tls-key (default:
                       a self-signed one, made with openssl; backbones pin its fingerprint, no CA)
  --tls-key FILE       its PEM private key
  --direct-report SECONDS
                       how often to tell the hub what was answered directly, for credits
                       (with --listen or --listen-native; default 10, at most 600: the hub
                       waits 15 minutes for the backbone's half)
  --json               one JSON object per line instead of text
  -h, --help           this text`;

function usageError(message: string): InvalidArgumentError {
  return new InvalidArgumentError(message, { details: { usage: true } });
}

function isUsageError(error: unknown): boolean {
  return (
    isMoeswarmError(error, "MOESWARM_INVALID_ARGUMENT") &&
    (error.details as { usage?: unknown })?.usage === true
  );
}

function seconds(text: string | undefined, name: string, min: number): number | undefined {
  if (text === undefined) return undefined;
  if (!/^\d+(\.\d+)?$/.test(text) || Number(text) < min) {
    throw usageError(`--${name} must be a number of seconds >= ${min}, got ${JSON.stringify(text)}`);
  }
  return Math.round(Number(text) * 1000);
}

function size(text: string | undefined, name: string): number | undefined {
  if (text === undefined) return undefined;
  try {
    return Number(parseByteSize(text, `--${name}`));
  } catch {
    throw usageError(`--${name} must be a size such as 512MiB or 2GiB, got ${JSON.stringify(text)}`);
  }
}

function clock(): string {
  const d = new Date();
  const p = (n: number, w = 2) => String(n).padStart(w, "0");
  return `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}.${p(d.getMilliseconds(), 3)}`;
}

/** Turns events into lines (and, on a terminal, a progress bar on stderr). */
function printer(io: WorkerCliIo, json: boolean): (e: WorkerEvent) => void {
  const tty = !json && io.stderr.isTTY === true;
  let bar: cliProgress.SingleBar | undefined;
  let lastProgressLine = 0;
  const stopBar = () => {
    bar?.stop();
    bar = undefined;
  };
  return (e) => {
    if (e.event === "progress") {
      if (tty) {
        if (!bar) {
          bar = new cliProgress.SingleBar(
            {
              stream: io.stderr,
              format: "downloading [{bar}] {percentage}% {got} of {size} | {speed}/s | eta {eta_formatted}",
              hideCursor: true,
              clearOnComplete: true,
            },
            cliProgress.Presets.shades_classic,
          );
          bar.start(e.total ?? e.received, 0, { got: "0 B", size: formatBytes(e.total ?? 0), speed: "-" });
        }
        bar.update(e.received, {
          got: formatBytes(e.received),
          size: formatBytes(e.total ?? e.received),
          speed: formatBytes(e.bytesPerSecond),
        });
        return;
      }
      // without a terminal: a line now and then, not one per chunk (`downloaded` tells the end)
      const now = Date.now();
      if (now - lastProgressLine < (json ? 1000 : 2000) || e.received === e.total) return;
      lastProgressLine = now;
    } else {
      if (e.event === "download-start") lastProgressLine = Date.now();
      stopBar();
    }
    io.stdout.write(json ? `${JSON.stringify(e)}\n` : `${clock()} ${formatWorkerEvent(e)}\n`);
  };
}

const OPTIONS = {
  hub: { type: "string" },
  token: { type: "string" },
  "token-file": { type: "string" },
  enrol: { type: "string" },
  capacity: { type: "string" },
  vram: { type: "string" },
  "cache-dir": { type: "string" },
  "cache-max": { type: "string" },
  id: { type: "string" },
  backend: { type: "string" },
  threads: { type: "string" },
  "max-batch-rows": { type: "string" },
  "pause-battery": { type: "string" },
  "pause-temp": { type: "string" },
  model: { type: "string" },
  ca: { type: "string" },
  relay: { type: "string" },
  poll: { type: "string" },
  "lease-ttl": { type: "string" },
  listen: { type: "string" },
  advertise: { type: "string", multiple: true },
  "listen-native": { type: "string" },
  "advertise-native": { type: "string", multiple: true },
  "tls-cert": { type: "string" },
  "tls-key": { type: "string" },
  "direct-report": { type: "string" },
  json: { type: "boolean" },
  help: { type: "boolean", short: "h" },
} as const;

type Values = Record<string, string | string[] | boolean | undefined>;

async function readOption(path: string, option: string): Promise<string> {
  try {
    return await readFile(path, "utf8");
  } catch (error) {
    throw usageError(`cannot read --${option} ${path}: ${(error as Error).message}`);
  }
}

/** The token: --token, --token-file or MOESWARM_TOKEN. */
async function tokenOf(str: (name: string) => string | undefined, env: NodeJS.ProcessEnv): Promise<string> {
  let token = str("token") ?? env.MOESWARM_TOKEN;
  const tokenFile = str("token-file");
  if (tokenFile !== undefined) {
    if (token !== undefined && str("token") !== undefined)
      throw usageError("give --token or --token-file, not both");
    token = (await readOption(tokenFile, "token-file")).trim();
  }
  if (!token) throw usageError("a worker token is required: --token, --token-file or MOESWARM_TOKEN");
  return token;
}

/** runWorker's options from the command line (usage errors say which option is wrong). */
export async function workerOptions(values: Values, env: NodeJS.ProcessEnv): Promise<RunWorkerOptions> {
  const str = (name: string) => (typeof values[name] === "string" ? (values[name] as string) : undefined);
  const hub = str("hub") ?? env.MOESWARM_HUB;
  if (!hub) throw usageError("--hub <url> is required");
  const enrol = str("enrol");
  if (enrol !== undefined && (str("token") !== undefined || str("token-file") !== undefined))
    throw usageError("give --enrol or a token, not both");
  const backend = str("backend") ?? "auto";
  if (!isBackendChoice(backend)) {
    throw usageError(`--backend must be ${BACKEND_CHOICES.join(", ")}, got ${JSON.stringify(backend)}`);
  }
  const threadsText = str("threads");
  if (threadsText !== undefined && !/^[1-9]\d{0,3}$/.test(threadsText)) {
    throw usageError(`--threads must be a positive integer, got ${JSON.stringify(threadsText)}`);
  }
  const maxBatchRows = maxBatchRowsOf(str("max-batch-rows"), backend);
  const caFile = str("ca");
  const ca = caFile === undefined ? undefined : await readOption(caFile, "ca");
  const cacheDir =
    str("cache-dir") ?? join(env.XDG_CACHE_HOME || join(homedir(), ".cache"), "moeswarm", "worker");
  const defaults = workerDefaults(hostFacts(env, cacheDir));
  const ramBytes = size(str("capacity"), "capacity") ?? defaults.ramBytes;
  let vramBytes = size(str("vram"), "vram");
  if (vramBytes === undefined && (backend === "vulkan" || backend === "cuda")) {
    // the device's memory as ggml counts it, less the compute buffer the worker reserves at load
    // (for --max-batch-rows rows) and a margin (worker-native's gpuVramOffer): what the weights may
    // take (a missing package, driver or device fails here, before any claim, with what to install)
    const rows = maxBatchRows !== undefined ? { maxBatchRows } : {};
    vramBytes = (await (backend === "cuda" ? probeCuda(rows) : probeVulkan(rows))).vramOfferBytes;
  }
  const cacheMaxBytes = size(str("cache-max"), "cache-max") ?? defaults.cacheMaxBytes;
  const threads = threadsText !== undefined ? Number(threadsText) : defaults.threads;
  const token = enrol !== undefined ? await enrolledToken(hub, enrol, cacheDir, ca) : await tokenOf(str, env);
  const direct = await directOptions(str, values.advertise as string[] | undefined);
  const native = await nativeOptions(str, values["advertise-native"] as string[] | undefined, direct);
  const power = powerOptions(str, env);
  const pollMs = seconds(str("poll"), "poll", 0.01);
  const leaseTtlMs = seconds(str("lease-ttl"), "lease-ttl", 1);
  return {
    hub,
    token,
    capacity: { ramBytes, ...(vramBytes !== undefined ? { vramBytes } : {}) },
    cacheDir,
    ...(cacheMaxBytes !== undefined ? { cacheMaxBytes } : {}),
    backend,
    ...(threads !== undefined ? { threads } : {}),
    ...(maxBatchRows !== undefined ? { maxBatchRows } : {}),
    ...(str("id") !== undefined ? { id: str("id") as string } : {}),
    ...(ca !== undefined ? { ca } : {}),
    ...(str("model") !== undefined ? { model: str("model") as string } : {}),
    ...(str("relay") !== undefined ? { relay: str("relay") as string } : {}),
    ...(pollMs !== undefined ? { pollMs } : {}),
    ...(leaseTtlMs !== undefined ? { leaseTtlMs } : {}),
    ...(direct !== undefined ? { direct } : {}),
    ...(native !== undefined ? { native } : {}),
    power,
  };
}

/** --max-batch-rows: an integer in 1..65536, for a GPU backend only (usage errors otherwise). */
function maxBatchRowsOf(text: string | undefined, backend: BackendChoice): number | undefined {
  if (text === undefined) return undefined;
  if (!/^\d{1,6}$/.test(text) || Number(text) < 1 || Number(text) > MAX_BATCH_ROWS_LIMIT) {
    throw usageError(
      `--max-batch-rows must be an integer in 1..${MAX_BATCH_ROWS_LIMIT}, got ${JSON.stringify(text)}`,
    );
  }
  if (!GPU_BACKEND_CHOICES.includes(backend)) {
    throw usageError(
      `--max-batch-rows goes with --backend ${GPU_BACKEND_CHOICES.join(" or ")} (a GPU worker reserves its compute buffer at load), not --backend ${backend}`,
    );
  }
  return Number(text);
}

/** --pause-battery and --pause-temp (MOESWARM_SYSFS_ROOT moves /sys, for tests) as runWorker's `power`. */
function powerOptions(str: (name: string) => string | undefined, env: NodeJS.ProcessEnv): PowerOptions {
  const limit = (name: string, max: number): number | false | undefined => {
    const text = str(name);
    if (text === undefined) return undefined;
    if (text === "off") return false;
    if (!/^\d+(\.\d+)?$/.test(text) || Number(text) > max) {
      throw usageError(`--${name} must be a number in 0..${max} or off, got ${JSON.stringify(text)}`);
    }
    return Number(text);
  };
  const pauseBattery = limit("pause-battery", 100);
  const pauseTemp = limit("pause-temp", 150);
  return {
    ...(pauseBattery !== undefined ? { pauseBattery } : {}),
    ...(pauseTemp !== undefined ? { pauseTemp } : {}),
    ...(env.MOESWARM_SYSFS_ROOT ? { sysfsRoot: env.MOESWARM_SYSFS_ROOT } : {}),
  };
}

/** --listen, --advertise, --tls-cert and --tls-key as runWorker's `direct`. */
async function directOptions(
  str: (name: string) => string | undefined,
  advertise: string[] | undefined,
): Promise<RunWorkerOptions["direct"]> {
  const listen = str("listen");
  const certFile = str("tls-cert");
  const keyFile = str("tls-key");
  if (listen === undefined) {
    if (advertise !== undefined) throw usageError("--advertise goes with --listen HOST:PORT");
    if (str("direct-report") !== undefined && str("listen-native") === undefined) {
      throw usageError("--direct-report goes with --listen HOST:PORT or --listen-native HOST:PORT");
    }
    if ((certFile !== undefined || keyFile !== undefined) && str("listen-native") === undefined) {
      throw usageError("--tls-cert and --tls-key go with --listen HOST:PORT or --listen-native HOST:PORT");
    }
    return undefined;
  }
  if ((certFile === undefined) !== (keyFile === undefined)) {
    throw usageError("give both --tls-cert and --tls-key, or neither (a self-signed certificate is made)");
  }
  const reportMs = reportFlag(str);
  const direct = {
    listen,
    ...(advertise !== undefined ? { advertise } : {}),
    ...(reportMs !== undefined ? { reportMs } : {}),
    ...(certFile !== undefined ? { tlsCert: await readOption(certFile, "tls-cert") } : {}),
    ...(keyFile !== undefined ? { tlsKey: await readOption(keyFile, "tls-key") } : {}),
  };
  try {
    directSettings(direct);
  } catch (error) {
    throw usageError((error as Error).message);
  }
  return direct;
}

/** --direct-report as milliseconds (undefined when not given). */
function reportFlag(str: (name: string) => string | undefined): number | undefined {
  const reportMs = seconds(str("direct-report"), "direct-report", 0.1);
  if (reportMs !== undefined && reportMs > DIRECT_REPORT_MAX_MS) {
    throw usageError(
      `--direct-report must be at most ${DIRECT_REPORT_MAX_MS / 1000} seconds (the hub waits ${DIRECT_MATCH_MINUTES} minutes for the other half), got ${JSON.stringify(str("direct-report"))}`,
    );
  }
  return reportMs;
}

/** --listen-native, --advertise-native (and --tls-cert, --tls-key) as runWorker's `native`. */
async function nativeOptions(
  str: (name: string) => string | undefined,
  advertise: string[] | undefined,
  direct: RunWorkerOptions["direct"],
): Promise<RunWorkerOptions["native"]> {
  const listen = str("listen-native");
  if (listen === undefined) {
    if (advertise !== undefined) throw usageError("--advertise-native goes with --listen-native HOST:PORT");
    return undefined;
  }
  const certFile = str("tls-cert");
  const keyFile = str("tls-key");
  if ((certFile === undefined) !== (keyFile === undefined)) {
    throw usageError("give both --tls-cert and --tls-key, or neither (a self-signed certificate is made)");
  }
  // one pair for both listeners: the fingerprint published is theirs
  // without --listen, --direct-report times the native counts' reports
  const reportMs = direct === undefined ? reportFlag(str) : undefined;
  const native = {
    listen,
    ...(advertise !== undefined ? { advertise } : {}),
    ...(reportMs !== undefined ? { reportMs } : {}),
    ...(direct?.tlsCert !== undefined
      ? { tlsCert: direct.tlsCert, tlsKey: direct.tlsKey as string }
      : certFile !== undefined
        ? {
            tlsCert: await readOption(certFile, "tls-cert"),
            tlsKey: await readOption(keyFile as string, "tls-key"),
          }
        : {}),
  };
  try {
    nativeSettings(native);
  } catch (error) {
    throw usageError((error as Error).message.replace(/native\.listen/, "--listen-native"));
  }
  return native;
}

/**
 * The `moeswarm-worker` command; resolves with the exit status (0 drained, 1 failure, 2 usage).
 * `extra` composes options the command line has no flag for (e.g. `wrapCompute`) into the run.
 */
export async function runWorkerCli(
  argv: readonly string[],
  io: WorkerCliIo,
  signal: AbortSignal,
  extra: Pick<RunWorkerOptions, "wrapCompute"> = {},
): Promise<number> {
  const env = io.env ?? process.env;
  let values: Values;
  try {
    values = parseArgs({ args: [...argv], strict: true, allowPositionals: false, options: OPTIONS })
      .values as Values;
  } catch (error) {
    io.stderr.write(`${WORKER_CLI_NAME}: ${(error as Error).message}\n${USAGE}\n`);
    return 2;
  }
  if (values.help) {
    io.stdout.write(`${USAGE}\n`);
    return 0;
  }
  try {
    const options = await workerOptions(values, env);
    const log = printer(io, values.json === true);
    await runWorker({ ...options, ...extra, signal, log });
    log({ event: "exit", code: 0, time: new Date().toISOString() });
    return 0;
  } catch (error) {
    if (isUsageError(error)) {
      io.stderr.write(`${WORKER_CLI_NAME}: ${(error as Error).message}\n${USAGE}\n`);
      return 2;
    }
    const code = isMoeswarmError(error) ? error.code : ((error as Error)?.name ?? "Error");
    io.stderr.write(`${WORKER_CLI_NAME}: ${code}: ${(error as Error)?.message ?? String(error)}\n`);
    return 1;
  }
}

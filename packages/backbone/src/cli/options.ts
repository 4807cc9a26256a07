import { existsSync, readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import type { BackboneBridgeOptions, BackboneHubOptions } from "../bridge.js";
import { checkHubOptions } from "../hub-options.js";
import type { BridgeSocket } from "../plugin-socket.js";

// The dispatcher's command line: its flags, their checks, and what they mean as bridge options.

export const CLI_NAME = "moeswarm-dispatcher";

/** Where the CLI writes: injectable so it runs in-process too. */
export interface CliIo {
  stdout: NodeJS.WritableStream;
  stderr: NodeJS.WritableStream;
}

export const USAGE = `usage: ${CLI_NAME} (--socket <path> | --tcp <host:port>) --model <gguf> [--worker <id>=<slice>]... [options]
       ${CLI_NAME} (--socket <path> | --tcp <host:port>) --hub <url> (--token <t> | --token-file <f>)
                   --model-id <id> [--model <gguf>] [options]

Runs the bridge beside a llama.cpp that has libggml-moeswarm.so loaded (llama-server, the
llama-logits harness): it answers the plugin's requests by sending the experts to workers,
either worker processes it starts here (--worker), or the workers of a hub (--hub): then it
follows the hub's live placement, reaches the workers directly when they advertise an endpoint
and through the hub's relay otherwise, and reports routing statistics and receipts to the hub.

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
  --no-direct             send everything through the hub's relay, never dialing the workers
                          that advertise direct endpoints (default: dial them, pinning their
                          certificate by the hub's fingerprint; the relay carries the rest)
  --no-native             keep every remote layer on this bridge (default, with --hub and
                          --trust own: a layer one worker holds whole and that advertises a
                          native listener goes from llama.cpp's plugin straight to it, over TLS
                          with the hub's ticket; any failure there takes the bridge path)
  --threads <n>           compute threads per worker and for the fallback (default 1)
  --no-fallback           experts no worker serves fail the decode instead of running here
  --deadline-ms <ms>      per worker request, before failover (default 30000)
  --wire-dtype q8|f32     how activations travel to the workers: q8 (default with --model) sends
                          them in each layer's CPU vec_dot_type (q8_0/q8_K, ~3.7x fewer bytes,
                          the same result bits; workers that cannot take them get f32); f32 always
  --spot-check <share>    recompute this share (0..1) of the workers' answers with the local
                          fallback (else a replica) and quarantine a worker that disagrees
  --hedge-ms <ms>         ask a replica too when a worker has not answered after this long
                          (0: never; default: adaptive under --trust own, none under verify)
  --trust verify|own      verify (default with --hub): every expert part is computed by two
                          workers and compared, the local fallback decides a mismatch, a liar is
                          quarantined and reported to the hub; own: take answers as they come
                          (only for a swarm of your own devices)
  --draft-model <gguf>    a small model with the same vocabulary for llama-server's speculative
                          decoding: the printed command gains -md <gguf> --spec-type draft-simple,
                          so one round trip per remote layer verifies up to --draft-max + 1 tokens
  --draft-max <n>         tokens drafted per step (default 8, best for a few concurrent clients;
                          with many, 3 verifies less in vain)
  --stats-interval <s>    print the metrics every s seconds (default: only at exit)
  --json                  one JSON object per line on stdout
  --help                  this text
`;

/** A bad command line: the CLI prints it with the usage and exits 2. */
export function usageError(message: string): InvalidArgumentError {
  return new InvalidArgumentError(message, { details: { usage: true } });
}

export function isUsageError(error: unknown): boolean {
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
  values: {
    "spot-check"?: string | undefined;
    "hedge-ms"?: string | undefined;
    trust?: string | undefined;
    "no-native"?: boolean | undefined;
  },
  json: boolean,
  io: CliIo,
): Pick<BackboneBridgeOptions, "spotCheck" | "hedgeMs" | "trust" | "onQuarantine" | "native"> {
  const out: Pick<BackboneBridgeOptions, "spotCheck" | "hedgeMs" | "trust" | "onQuarantine" | "native"> = {};
  const trust = values.trust;
  if (trust !== undefined) {
    if (trust !== "verify" && trust !== "own") {
      throw usageError(`--trust must be verify or own, got ${JSON.stringify(trust)}`);
    }
    out.trust = trust;
  }
  out.onQuarantine = (e) => {
    if (json) io.stdout.write(`${JSON.stringify({ event: "quarantine", ...e })}\n`);
    else {
      io.stderr.write(
        `${CLI_NAME}: quarantined worker ${e.worker} (layer ${e.layer}, decided by ${e.decidedBy}): ${e.reason}\n`,
      );
    }
  };
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
  if (values["no-native"] === true) out.native = false;
  return out;
}

export type Values = ReturnType<typeof parse>["values"];

/** The checked command line, in the units the bridge takes. */
export interface CliConfig {
  json: boolean;
  /** --model: the GGUF llama.cpp loads (required without --hub). */
  modelPath: string | undefined;
  /** --hub: serve the hub's workers instead of --worker processes. */
  hubUrl: string | undefined;
  socket: BridgeSocket;
  threads: number;
  deadlineMs: number;
  /** Seconds between metrics printouts (0: only at exit). */
  statsS: number;
  /** Seconds between reports to the hub. */
  reportS: number;
  modelId: string;
  noFallback: boolean;
  /** --wire-dtype: q8 where a layer allows it (needs --model and the native addon), or f32. */
  wireDtype: "q8" | "f32";
  /** --draft-model and --draft-max: llama-server's speculative decoding, in the printed command. */
  draft: { path: string; max: number } | undefined;
  extra: Pick<BackboneBridgeOptions, "spotCheck" | "hedgeMs" | "trust" | "onQuarantine" | "native">;
}

/** The flags that decide the mode: --hub's companions, or --model and --worker. */
function checkMode(values: Values): void {
  if (values.hub === undefined) {
    for (const flag of ["token", "token-file", "ca", "id", "report-interval"] as const) {
      if (values[flag] !== undefined) throw usageError(`--${flag} needs --hub`);
    }
    if (!values.model) throw usageError("--model <gguf> is required");
  } else {
    if (values.worker !== undefined) throw usageError("--worker and --hub are exclusive");
    if (values["model-id"] === undefined) throw usageError("--hub needs --model-id <the hub's model id>");
    if ((values.token === undefined) === (values["token-file"] === undefined)) {
      throw usageError("--hub needs one of --token <t> or --token-file <f>");
    }
  }
  if (values.model !== undefined && !existsSync(values.model))
    throw usageError(`--model ${values.model} does not exist`);
}

/** --draft-model and --draft-max (the latter only with the former). */
function draftOf(values: Values): CliConfig["draft"] {
  const path = values["draft-model"];
  if (path === undefined) {
    if (values["draft-max"] !== undefined) throw usageError("--draft-max needs --draft-model");
    return undefined;
  }
  if (!existsSync(path)) throw usageError(`--draft-model ${path} does not exist`);
  return { path, max: int(values["draft-max"], "draft-max", DEFAULT_DRAFT_MAX, 1, 64) };
}

function wireDtypeOf(values: Values): CliConfig["wireDtype"] {
  const v = values["wire-dtype"];
  if (v === undefined) return values.model === undefined ? "f32" : "q8";
  if (v !== "q8" && v !== "f32") throw usageError(`--wire-dtype must be q8 or f32, got ${v}`);
  if (v === "q8" && values.model === undefined) throw usageError("--wire-dtype q8 needs --model <gguf>");
  return v;
}

/** Tokens drafted per step by default (`pnpm bench throughput`; the backbone README has the figures). */
export const DEFAULT_DRAFT_MAX = 8;

function socketOf(values: Values): BridgeSocket {
  if ((values.socket === undefined) === (values.tcp === undefined)) {
    throw usageError("give one of --socket <path> or --tcp <host:port>");
  }
  if (values.socket !== undefined) return values.socket;
  const m = /^(.+):(\d+)$/.exec(values.tcp!);
  if (!m) throw usageError("--tcp must be host:port");
  return { host: m[1]!.replace(/^\[(.*)\]$/, "$1"), port: int(m[2], "tcp port", 0, 0, 65535) };
}

/** Checks the flags together (usage errors in the order a reader of the usage would expect). */
export function readConfig(values: Values, io: CliIo): CliConfig {
  const json = values.json === true;
  checkMode(values);
  const socket = socketOf(values);
  return {
    json,
    modelPath: values.model,
    hubUrl: values.hub,
    socket,
    threads: int(values.threads, "threads", 1, 1, 512),
    deadlineMs: int(values["deadline-ms"], "deadline-ms", 30_000, 1, 2 ** 31 - 1),
    statsS: int(values["stats-interval"], "stats-interval", 0, 0, 86_400),
    reportS: int(values["report-interval"], "report-interval", 10, 1, 86_400),
    modelId: values["model-id"] ?? "moeswarm",
    noFallback: values["no-fallback"] === true || values.model === undefined,
    wireDtype: wireDtypeOf(values),
    draft: draftOf(values),
    extra: resilience(values, json, io),
  };
}

export function hubOptions(
  url: string,
  values: Values,
  model: string,
  statsIntervalMs: number,
): BackboneHubOptions {
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
      ...(values["no-direct"] === true ? { direct: false } : {}),
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

export function parse(args: readonly string[]) {
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
        "wire-dtype": { type: "string" },
        "deadline-ms": { type: "string" },
        "spot-check": { type: "string" },
        "hedge-ms": { type: "string" },
        trust: { type: "string" },
        "stats-interval": { type: "string" },
        "draft-model": { type: "string" },
        "draft-max": { type: "string" },
        hub: { type: "string" },
        token: { type: "string" },
        "token-file": { type: "string" },
        ca: { type: "string" },
        id: { type: "string" },
        "report-interval": { type: "string" },
        "no-direct": { type: "boolean" },
        "no-native": { type: "boolean" },
        json: { type: "boolean" },
        help: { type: "boolean", short: "h" },
      },
    });
  } catch (error) {
    throw usageError((error as Error).message);
  }
}

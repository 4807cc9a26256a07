// `moeswarm-hub pause <worker-id>`, `resume <worker-id>` and `pauses`: the hub's pause API
// (POST /api/workers/:id/pause and /resume, GET /api/pauses) from the command line. They talk to
// the running hub over HTTP with a token, because a pause acts at once (placements leave the
// worker out, the relay tells it) and only the running hub can do that; it keeps the hub's pause
// in its store, so a restart keeps it.
import { readFile } from "node:fs/promises";
import {
  InvalidArgumentError,
  isHubId,
  isMoeswarmError,
  parseWorkerPauseJson,
  parseWorkerPauseListJson,
  TransportError,
  WORKER_PAUSES_PATH,
  type WorkerPauseJson,
  workerPauseUrl,
} from "@moeswarm/core";
import { HubClient } from "@moeswarm/relay-client";

type Values = Record<string, string | boolean | string[] | undefined>;

interface Io {
  stdout: NodeJS.WritableStream;
  env?: NodeJS.ProcessEnv | undefined;
}

const str = (values: Values, name: string) => {
  const v = values[name];
  return typeof v === "string" ? v : undefined;
};

/** A mistake in the command line (exit status 2), as run.ts tells them apart. */
const usageError = (message: string) => new InvalidArgumentError(message, { details: { usage: true } });

const CONNECTION_OPTIONS = {
  hub: { type: "string", description: "the running hub's URL, as `serve` printed it (or MOESWARM_HUB)" },
  token: {
    type: "string",
    description:
      "an admin token, or a worker token of the worker's owner (or MOESWARM_TOKEN); `token --role admin` mints one",
  },
  "token-file": { type: "string", description: "read the token from a file instead" },
  ca: {
    type: "string",
    description: "PEM CA certificate to trust (a --tls-self-signed hub: the file its --tls-ca-out wrote)",
  },
  json: { type: "boolean", description: "print the hub's answer as one JSON object" },
} as const;

async function readOption(path: string, option: string): Promise<string> {
  try {
    return await readFile(path, "utf8");
  } catch (error) {
    throw usageError(`cannot read --${option} ${path}: ${(error as Error).message}`);
  }
}

/** A client of the hub the options name, with their token (`pauses` may go without one). */
async function hubClient(values: Values, env: NodeJS.ProcessEnv, tokenRequired: boolean): Promise<HubClient> {
  const hub = str(values, "hub") ?? env.MOESWARM_HUB;
  if (!hub) throw usageError("--hub <url> is required (or MOESWARM_HUB): the running hub's URL");
  if (str(values, "token") !== undefined && str(values, "token-file") !== undefined) {
    throw usageError("give --token or --token-file, not both");
  }
  const file = str(values, "token-file");
  const token =
    file !== undefined
      ? (await readOption(file, "token-file")).trim()
      : (str(values, "token") ?? env.MOESWARM_TOKEN);
  if (!token && tokenRequired) {
    throw usageError(
      "a token is required: --token, --token-file or MOESWARM_TOKEN (an admin token, or a worker token of the worker's owner)",
    );
  }
  const caFile = str(values, "ca");
  const ca = caFile === undefined ? undefined : await readOption(caFile, "ca");
  try {
    return new HubClient({ base: hub, ...(token ? { token } : {}), ...(ca !== undefined ? { ca } : {}) });
  } catch (error) {
    throw usageError(`--hub: ${(error as Error).message}`);
  }
}

/** The one worker id a command takes. */
function workerId(positionals: readonly string[], command: string): string {
  if (positionals.length !== 1) {
    throw usageError(`${command} takes one worker id, e.g. \`moeswarm-hub ${command} phone-1\``);
  }
  const id = positionals[0] as string;
  if (!isHubId(id)) throw usageError(`the worker id must be 1..128 bytes, got ${JSON.stringify(id)}`);
  return id;
}

const PAUSERS = { owner: "its owner", operator: "the operator", self: "itself" } as const;

function since(at: number): string {
  return new Date(at).toISOString();
}

/** "paused by the operator since <time>: maintenance" for one side of a pause. */
function pauseLine(by: keyof typeof PAUSERS, record: { at: number; reason?: string }): string {
  return `paused by ${PAUSERS[by]} since ${since(record.at)}${record.reason ? `: ${record.reason}` : ""}`;
}

/** "not seen since <time>; the pause is dropped at <time> unless it returns" (offline workers). */
function awayText(away: NonNullable<WorkerPauseJson["away"]>): string {
  const seen =
    away.lastSeen === undefined ? "not seen since the pause" : `not seen since ${since(away.lastSeen)}`;
  return `${seen}${away.listed ? "" : " (no longer listed by the hub)"}; the pause is dropped at ${since(away.dropsAt)} unless it returns or is resumed`;
}

/** What a worker's pause state says, in words. */
export function describePause(state: WorkerPauseJson): string {
  const sides = [
    ...(state.hub ? [pauseLine(state.hub.by, state.hub)] : []),
    ...(state.self ? [pauseLine("self", state.self)] : []),
  ];
  if (sides.length === 0) return `worker ${state.worker} is not paused: the hub routes it work`;
  const away = state.away ? `; ${awayText(state.away)}` : "";
  return `worker ${state.worker} is ${sides.join(", and ")}; the hub routes it nothing new until resumed${away}`;
}

async function withClient<T>(
  values: Values,
  io: Io,
  fn: (client: HubClient) => Promise<T>,
  tokenRequired = true,
): Promise<T> {
  const client = await hubClient(values, io.env ?? process.env, tokenRequired);
  try {
    return await fn(client);
  } catch (error) {
    if (!isMoeswarmError(error, "MOESWARM_TRANSPORT_CONNECT")) throw error;
    throw new TransportError(
      "MOESWARM_TRANSPORT_CONNECT",
      `${error.message}: is the hub running (moeswarm-hub serve), and is --hub the URL it printed?`,
      { cause: error, ...(error.details !== undefined ? { details: error.details } : {}) },
    );
  } finally {
    await client.close();
  }
}

export const pauseCommand = {
  name: "pause",
  summary: "pause a worker on a running hub: placements leave it out until `resume`, across restarts",
  usage:
    "pause <worker-id> --hub <url> (--token <t> | --token-file <f>) [--reason <text>] [--ca <pem>] [--json]",
  positionals: true,
  options: {
    ...CONNECTION_OPTIONS,
    reason: {
      type: "string",
      description: "why (at most 1024 bytes): the worker prints it, the dashboard shows it",
    },
  },
  async run(values: Values, io: Io, signal: AbortSignal, positionals: readonly string[]): Promise<void> {
    const id = workerId(positionals, "pause");
    const reason = str(values, "reason");
    if (reason !== undefined && Buffer.byteLength(reason) > 1024) {
      throw usageError("--reason must be at most 1024 bytes");
    }
    const state = await withClient(values, io, async (client) =>
      parseWorkerPauseJson(
        (
          await client.request(workerPauseUrl(id, "pause"), {
            method: "POST",
            body: reason !== undefined ? { reason } : {},
            signal,
          })
        ).json,
      ),
    );
    io.stdout.write(values.json === true ? `${JSON.stringify(state)}\n` : `${describePause(state)}\n`);
  },
};

export const resumeCommand = {
  name: "resume",
  summary: "lift the hub's pause of a worker (its own pause, on low battery or heat, it lifts itself)",
  usage: "resume <worker-id> --hub <url> (--token <t> | --token-file <f>) [--ca <pem>] [--json]",
  positionals: true,
  options: { ...CONNECTION_OPTIONS },
  async run(values: Values, io: Io, signal: AbortSignal, positionals: readonly string[]): Promise<void> {
    const id = workerId(positionals, "resume");
    const state = await withClient(values, io, async (client) =>
      parseWorkerPauseJson(
        (await client.request(workerPauseUrl(id, "resume"), { method: "POST", body: {}, signal })).json,
      ),
    );
    io.stdout.write(values.json === true ? `${JSON.stringify(state)}\n` : `${describePause(state)}\n`);
  },
};

export const pausesCommand = {
  name: "pauses",
  summary: "list the workers paused on a running hub: by whom, since when, why",
  usage: "pauses --hub <url> [--token <t> | --token-file <f>] [--ca <pem>] [--json]",
  positionals: false,
  options: { ...CONNECTION_OPTIONS },
  async run(values: Values, io: Io, signal: AbortSignal): Promise<void> {
    // a hub with public reads answers without a token; one serving --private needs it
    const list = await withClient(
      values,
      io,
      async (client) => parseWorkerPauseListJson((await client.request(WORKER_PAUSES_PATH, { signal })).json),
      false,
    );
    if (values.json === true) {
      io.stdout.write(`${JSON.stringify(list)}\n`);
      return;
    }
    // a worker away: when it was last seen ("-": connected; "?": not since the pause)
    const seen = (p: WorkerPauseJson) =>
      p.away === undefined ? "-" : p.away.lastSeen === undefined ? "?" : since(p.away.lastSeen);
    const drops = (p: WorkerPauseJson) => (p.away === undefined ? "-" : since(p.away.dropsAt));
    const rows = list.pauses.flatMap((p) => [
      ...(p.hub
        ? [[p.worker, PAUSERS[p.hub.by], since(p.hub.at), seen(p), drops(p), p.hub.reason ?? ""]]
        : []),
      ...(p.self ? [[p.worker, PAUSERS.self, since(p.self.at), seen(p), drops(p), p.self.reason ?? ""]] : []),
    ]);
    if (rows.length === 0) {
      io.stdout.write("no worker is paused\n");
      return;
    }
    const table = [["WORKER", "PAUSED BY", "SINCE", "LAST SEEN", "DROPPED AT", "REASON"], ...rows];
    const widths = [0, 1, 2, 3, 4].map((c) => Math.max(...table.map((r) => (r[c] as string).length)));
    for (const r of table) {
      io.stdout.write(
        `${r
          .map((cell, c) => (c < 5 ? cell.padEnd(widths[c] as number) : cell))
          .join("  ")
          .trimEnd()}\n`,
      );
    }
  },
};

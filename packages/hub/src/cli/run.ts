import { randomBytes } from "node:crypto";
import { readFile, writeFile } from "node:fs/promises";
import { hostname, networkInterfaces } from "node:os";
import { join, resolve as resolvePath } from "node:path";
import { parseArgs } from "node:util";
import {
  describeError,
  type FrameAllocatorState,
  frameAllocatorAdvice,
  frameAllocatorState,
  InvalidArgumentError,
  isMoeswarmError,
  onAbort,
} from "@moeswarm/core";
import type { ConnectionLimits } from "../connection-guard.js";
import { ENROL_BURST, ENROL_PER_MINUTE } from "../enrolment.js";
import { createHub } from "../hub.js";
import type { HubEvent, HubListener } from "../hub-types.js";
import { keptLoopbackCertificates } from "../kept-tls.js";
import { createLoopbackCertificates, isCertificateHost } from "../loopback-tls.js";
import type { ModelInfo } from "../model.js";
import { mintToken, type TokenRole } from "../token.js";
import { enrolCode } from "./enrol-code.js";
import { pauseCommand, pausesCommand, resumeCommand } from "./pause.js";

export const CLI_NAME = "moeswarm-hub";
/** The ids the tokens `serve` prints (no --secret-file) are bound to. */
const GENERATED_WORKER_ID = "worker-1";
const GENERATED_BACKBONE_ID = "backbone-1";

/** Where the CLI writes: injectable so it runs in-process too. */
export interface CliIo {
  stdout: NodeJS.WritableStream;
  stderr: NodeJS.WritableStream;
  /** Where MOESWARM_HUB and MOESWARM_TOKEN are read (default process.env). */
  env?: NodeJS.ProcessEnv;
}

type Values = Record<string, string | boolean | string[] | undefined>;

interface Option {
  type: "string" | "boolean";
  multiple?: boolean;
  short?: string;
  description: string;
}

interface Command {
  name: string;
  summary: string;
  usage: string;
  options: Record<string, Option>;
  /** Whether it takes arguments besides its options (`pause <worker-id>`). */
  positionals?: boolean;
  run(values: Values, io: CliIo, signal: AbortSignal, positionals: readonly string[]): Promise<void>;
}

/** A mistake in the command line (exit status 2), as opposed to a failure of the work (1). */
function usageError(message: string): InvalidArgumentError {
  return new InvalidArgumentError(message, { details: { usage: true } });
}

function isUsageError(error: unknown): boolean {
  return (
    isMoeswarmError(error, "MOESWARM_INVALID_ARGUMENT") &&
    (error.details as { usage?: unknown } | undefined)?.usage === true
  );
}

function str(values: Values, name: string): string | undefined {
  const v = values[name];
  return typeof v === "string" ? v : undefined;
}

function int(values: Values, name: string, fallback: number, min: number, max: number): number {
  const text = str(values, name);
  if (text === undefined) return fallback;
  if (!/^\d+$/.test(text) || Number(text) < min || Number(text) > max) {
    throw usageError(`--${name} must be an integer in ${min}..${max}, got ${JSON.stringify(text)}`);
  }
  return Number(text);
}

async function readText(path: string, what: string): Promise<string> {
  try {
    return await readFile(path, "utf8");
  } catch (error) {
    throw usageError(`cannot read the ${what} ${path}: ${(error as Error).message}`);
  }
}

async function readSecret(path: string): Promise<string> {
  // a trailing newline is an editor's, not part of the secret
  return (await readText(path, "secret file")).replace(/\r?\n$/, "");
}

const DAY_S = 86_400;
const DEFAULT_CA_OUT = "moeswarm-hub-ca.pem";

/**
 * The names a self-signed certificate covers: loopback, this machine's name, the bound address,
 * and on a wildcard bind every address of this machine, so that workers on the network can dial
 * any of them.
 */
function certificateHosts(bind: string): string[] {
  const hosts = ["localhost", "127.0.0.1", "::1"];
  const add = (h: string) => {
    if (!hosts.includes(h) && isCertificateHost(h)) hosts.push(h);
  };
  add(hostname());
  if (bind === "0.0.0.0" || bind === "::") {
    for (const addresses of Object.values(networkInterfaces())) {
      for (const a of addresses ?? []) add(a.address);
    }
  } else {
    add(bind);
  }
  return hosts.slice(0, 64);
}

function size(bytes: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = bytes;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${u === 0 ? v : v.toFixed(1)} ${units[u]}`;
}

type SelfSignedInfo = { ca: string; hosts: string[]; dir: string; made: boolean };

/**
 * Where the hub keeps its state (the SQLite store, the self-signed TLS material): --data-dir, else
 * the directory of --db, else the working directory; none with `--db :memory:` and no --data-dir.
 */
function dataDir(values: Values): string | undefined {
  const dir = str(values, "data-dir");
  if (dir !== undefined) return resolvePath(dir);
  const db = str(values, "db");
  if (db === ":memory:") return undefined;
  return resolvePath(db === undefined ? "." : resolvePath(db, ".."));
}

/** The store the options name: --db, else moeswarm-hub.db in the data directory. */
function dbPath(values: Values): string {
  const db = str(values, "db");
  if (db !== undefined) return db;
  const dir = str(values, "data-dir");
  return dir === undefined ? "moeswarm-hub.db" : join(resolvePath(dir), "moeswarm-hub.db");
}

const SQLITE_DRIVER_NAMES = ["auto", "better-sqlite3", "node:sqlite", "node-sqlite3-wasm"] as const;

function sqliteDriverOf(values: Values): (typeof SQLITE_DRIVER_NAMES)[number] {
  const name = str(values, "sqlite-driver") ?? "auto";
  const known = SQLITE_DRIVER_NAMES.find((n) => n === name);
  if (!known) throw usageError(`--sqlite-driver must be one of ${SQLITE_DRIVER_NAMES.join(", ")}`);
  return known;
}

/** The connection limits the flags set (the hub's defaults for the rest). */
function limitsOf(values: Values): ConnectionLimits {
  const limits: ConnectionLimits = {};
  const flag = (name: string, key: keyof ConnectionLimits, scale: number) => {
    if (str(values, name) !== undefined) limits[key] = int(values, name, 0, 1, 1_000_000_000) * scale;
  };
  flag("max-connections", "maxConnections", 1);
  flag("max-connections-per-address", "maxConnectionsPerAddress", 1);
  flag("max-unauthenticated-per-address", "maxUnauthenticatedPerAddress", 1);
  flag("idle-timeout", "idleConnectionMs", 1000);
  flag("headers-timeout", "headersTimeoutMs", 1000);
  return limits;
}

/** The certificate the options name (files, or a self-signed one made now); undefined if stopped meanwhile. */
async function serveTls(
  values: Values,
  host: string,
  signal: AbortSignal,
): Promise<{ tls?: { cert: string; key: string }; selfSignedInfo?: SelfSignedInfo } | undefined> {
  const certPath = str(values, "tls-cert");
  const keyPath = str(values, "tls-key");
  if ((certPath === undefined) !== (keyPath === undefined)) {
    throw usageError("--tls-cert and --tls-key go together");
  }
  const selfSigned = values["tls-self-signed"] === true;
  const caOut = str(values, "tls-ca-out");
  if (selfSigned && certPath !== undefined) {
    throw usageError(
      "--tls-self-signed makes its own certificate: give it or --tls-cert/--tls-key, not both",
    );
  }
  if (caOut !== undefined && !selfSigned) throw usageError("--tls-ca-out goes with --tls-self-signed");
  let tls: { cert: string; key: string } | undefined;
  let selfSignedInfo: SelfSignedInfo | undefined;
  if (certPath && keyPath) {
    tls = { cert: await readText(certPath, "certificate"), key: await readText(keyPath, "key") };
  } else if (selfSigned) {
    const hosts = certificateHosts(host);
    const data = dataDir(values);
    let certs: Awaited<ReturnType<typeof keptLoopbackCertificates>>;
    try {
      // kept in the data directory: a restart serves the same CA, so workers that trust it stay
      certs = data
        ? await keptLoopbackCertificates(join(data, "tls"), { hosts, signal })
        : { ...(await createLoopbackCertificates({ hosts, signal })), made: "missing" };
    } catch (error) {
      if (signal.aborted) return undefined; // stopped while starting
      throw error;
    }
    const ca = resolvePath(caOut ?? DEFAULT_CA_OUT);
    try {
      await writeFile(ca, certs.ca);
    } catch (error) {
      throw usageError(`cannot write the CA certificate to ${ca}: ${(error as Error).message}`);
    }
    tls = { cert: certs.cert, key: certs.key };
    selfSignedInfo = { ca, hosts, dir: data ? join(data, "tls") : "", made: certs.made !== undefined };
  }
  return { ...(tls ? { tls } : {}), ...(selfSignedInfo ? { selfSignedInfo } : {}) };
}

type Say = (line: string, event: Record<string, unknown>) => void;

/** The hub's events as the CLI prints them: a line each for what an operator wants to see. */
function hubEventPrinter(say: Say, io: CliIo): (e: HubEvent) => void {
  const lastPercent = new Map<string, number>();
  const loadingSince = new Map<string, number>();
  return (e: HubEvent) => {
    switch (e.type) {
      case "model-loading":
        loadingSince.set(e.id, performance.now());
        say(`${CLI_NAME}: loading ${e.id} (${e.path})`, { event: e.type, id: e.id, path: e.path });
        return;
      case "model-progress": {
        // building a manifest reads every expert byte once: when that takes a while, say how
        // far it is, every 10%
        if (performance.now() - (loadingSince.get(e.id) ?? 0) < 2000) return;
        const pct = e.bytesTotal === 0 ? 100 : Math.floor((e.bytesDone / e.bytesTotal) * 10) * 10;
        if (pct === lastPercent.get(e.id) || pct === 0) return;
        lastPercent.set(e.id, pct);
        say(`${CLI_NAME}: hashing ${e.id}'s experts for its manifest: ${pct}%`, {
          event: e.type,
          id: e.id,
          bytesDone: e.bytesDone,
          bytesTotal: e.bytesTotal,
        });
        return;
      }
      case "lease":
        // renewals come every few seconds per download: not worth a line each
        if (e.action === "renewed") return;
        say(
          `${CLI_NAME}: lease ${e.action}: ${e.worker} ${e.model} layers ${e.layers} experts ${e.experts}`,
          {
            event: "lease",
            action: e.action,
            id: e.id,
            worker: e.worker,
            model: e.model,
            layers: e.layers,
            experts: e.experts,
          },
        );
        return;
      case "quarantine":
        say(`${CLI_NAME}: worker ${e.worker} quarantined on ${e.by}'s report: ${e.reason}`, {
          event: "quarantine",
          worker: e.worker,
          by: e.by,
          model: e.model,
          reason: e.reason,
        });
        return;
      case "reinstate":
        say(`${CLI_NAME}: worker ${e.worker} reinstated`, { event: "reinstate", worker: e.worker });
        return;
      case "pause":
        say(
          e.dropped
            ? `${CLI_NAME}: worker ${e.worker}'s pause by ${e.by === "self" ? "itself" : `its ${e.by}`} dropped: ${e.dropped === "revoked" ? "the worker was quarantined" : "not seen for --pause-retention"}`
            : `${CLI_NAME}: worker ${e.worker} ${e.paused ? "paused" : "resumed"} by ${e.by === "self" ? "itself" : `its ${e.by}`}${e.reason ? `: ${e.reason}` : ""}`,
          {
            event: "pause",
            worker: e.worker,
            paused: e.paused,
            by: e.by,
            ...(e.reason ? { reason: e.reason } : {}),
            ...(e.dropped ? { dropped: e.dropped } : {}),
          },
        );
        return;
      case "relay":
        // an operator's drain is worth a line; the rest of the relay's traffic is in /metrics
        if (e.event.type === "drain" && e.event.by === "hub") {
          say(
            `${CLI_NAME}: worker ${e.event.id} drained by the hub${e.event.reason ? `: ${e.event.reason}` : ""}`,
            { event: "drain", worker: e.event.id, ...(e.event.reason ? { reason: e.event.reason } : {}) },
          );
        }
        return;
      case "model-unavailable":
        io.stderr.write(
          `${CLI_NAME}: model ${e.id} (${e.path}) is not served: ${isMoeswarmError(e.error) ? `${e.error.code}: ${e.error.message}` : String(e.error)}\n`,
        );
        return;
      case "request-error":
      case "store-error": {
        const err = e.error;
        const text = isMoeswarmError(err) ? `${err.code}: ${err.message}` : String(err);
        io.stderr.write(
          `${CLI_NAME}: ${e.type === "store-error" ? "store" : `${e.method} ${e.url}`}: ${text.replace(/\s*\n\s*/g, " ")}\n`,
        );
        return;
      }
      default:
        return;
    }
  };
}

function storeLine(values: Values, store: { kind: string; driver?: string }): string {
  if (store.kind !== "sqlite") return `${store.kind} (nothing is kept across restarts)`;
  return `sqlite via ${store.driver ?? "?"} (${dbPath(values)})`;
}

/** What the listening lines say of glibc's malloc: the relay moves large frames. */
function mallocLines(state: FrameAllocatorState): string[] {
  if (state === "tuned") return ["  malloc: glibc tuned for large frames (GLIBC_TUNABLES)"];
  const advice = frameAllocatorAdvice(state);
  return advice === undefined ? [] : [`  malloc: ${advice}`];
}

/** What `serve` prints once it listens (humans; --json prints the same as one object). */
function listeningLines(
  values: Values,
  store: { kind: string; driver?: string },
  listener: HubListener,
  infos: readonly ModelInfo[],
  selfSignedInfo: SelfSignedInfo | undefined,
  tokens: { admin: string; worker: string; backbone: string } | undefined,
  malloc: FrameAllocatorState,
): string[] {
  const lines = [
    `${CLI_NAME}: serving ${infos.length} model${infos.length === 1 ? "" : "s"} on ${listener.url} (relay ${listener.relayUrl})`,
    ...infos.map(
      (m) =>
        `  ${m.id}  ${m.arch ?? "?"}  ${m.layers} layers x ${m.experts} experts  ${size(m.expertBytes)}/expert  file ${size(m.fileSize)}`,
    ),
    `  dashboard: ${listener.url}/${values.private === true ? "#token=<token>" : ""}`,
    `  store: ${storeLine(values, store)}; reads ${values.private === true ? "need a token" : "are public"}`,
    ...mallocLines(malloc),
  ];
  if (selfSignedInfo) {
    lines.push(
      `  TLS: self-signed for ${selfSignedInfo.hosts.join(", ")}; CA certificate: ${selfSignedInfo.ca}`,
      selfSignedInfo.dir
        ? `    (${selfSignedInfo.made ? "made now and kept" : "kept from an earlier run"} in ${selfSignedInfo.dir})`
        : "    (made for this run only: --db :memory: keeps nothing; give --data-dir to keep it)",
      `    (workers and backbones trust it with --ca ${selfSignedInfo.ca})`,
    );
  }
  if (tokens) {
    lines.push(
      `${CLI_NAME}: no --secret-file given: generated a secret for this run only. These tokens (valid 7 days)`,
      "  stop working when this hub stops; give --secret-file <file> and mint tokens with",
      `  \`${CLI_NAME} token\` to keep them across restarts.`,
      `  admin token:    ${tokens.admin}`,
      `  worker token (id ${GENERATED_WORKER_ID}):     ${tokens.worker}`,
      `  backbone token (id ${GENERATED_BACKBONE_ID}): ${tokens.backbone}`,
    );
  }
  return lines;
}

const serve: Command = {
  name: "serve",
  summary: "serve models (expert-shard API, manifests, metrics) and the relay on one port",
  usage: "serve --model <gguf> [--model <gguf> ...] [options]",
  options: {
    model: {
      type: "string",
      multiple: true,
      description: "a GGUF model to serve (id: its file name); repeatable",
    },
    port: { type: "string", description: "TCP port (default 8443; 0 = any free port)" },
    host: { type: "string", description: 'interface to bind (default 127.0.0.1; "0.0.0.0" for the network)' },
    "tls-cert": { type: "string", description: "PEM certificate: serve https and wss" },
    "tls-key": { type: "string", description: "PEM private key of --tls-cert" },
    "tls-self-signed": {
      type: "boolean",
      description:
        "serve https and wss with a CA of its own (openssl CLI; for loopback and self-hosted networks), kept in <data-dir>/tls and reused at restart",
    },
    "tls-ca-out": {
      type: "string",
      description: `where --tls-self-signed writes its CA certificate, for workers' --ca (default ${DEFAULT_CA_OUT})`,
    },
    "secret-file": {
      type: "string",
      description:
        "file holding the token secret (>= 16 bytes); without it a secret is generated for this run",
    },
    db: {
      type: "string",
      description:
        'SQLite file for models, workers, leases and credits (default <data-dir>/moeswarm-hub.db; ":memory:" keeps none)',
    },
    "data-dir": {
      type: "string",
      description:
        "where the hub keeps its state (default: the directory of --db, else the working directory)",
    },
    "sqlite-driver": {
      type: "string",
      description:
        "SQLite driver for --db: auto (default: better-sqlite3, else node:sqlite, else node-sqlite3-wasm) or one by name",
    },
    "trust-proxy": {
      type: "string",
      multiple: true,
      description:
        "address or CIDR of a reverse proxy in front of the hub: its connections count under X-Forwarded-For's client address (repeatable; docs/deploy.md)",
    },
    "max-connections": { type: "string", description: "open TCP connections in all (default 8192)" },
    "max-connections-per-address": {
      type: "string",
      description: "open TCP connections from one IP address (default 256)",
    },
    "max-unauthenticated-per-address": {
      type: "string",
      description: "relay WebSockets from one address that have not said hello yet (default 64)",
    },
    "idle-timeout": {
      type: "string",
      description: "seconds a connection with no request in progress may send nothing (default 30)",
    },
    "headers-timeout": { type: "string", description: "seconds to receive a request's headers (default 10)" },
    "enrol-burst": {
      type: "string",
      description: "enrolment codes one address may try at once at POST /api/enrol (default 10)",
    },
    "enrol-per-minute": {
      type: "string",
      description: "enrolment tries an address regains per minute after the burst (default 10)",
    },
    "pause-retention": {
      type: "string",
      description:
        "days a paused worker may stay unseen before its pause is dropped (default 30; from the pause when later)",
    },
    "model-dir": { type: "string", description: "directory POST /api/models may register files from" },
    "manifest-dir": { type: "string", description: "where manifests are cached (default beside each model)" },
    private: { type: "boolean", description: "reads need a token too (default: reads are public)" },
    "lease-ttl": {
      type: "string",
      description: "seconds a claim is leased before it must be renewed (default 120)",
    },
    "half-life": {
      type: "string",
      description: "half-life of the backbones' routing counts, seconds (default 600)",
    },
    "max-replicas": { type: "string", description: "most replicas a hot expert is asked for (default 4)" },
    replicas: {
      type: "string",
      description:
        "distinct workers each expert needs to count as covered (default 2: answers can be compared)",
    },
    "allow-unbound-tokens": {
      type: "boolean",
      description:
        "accept worker/backbone tokens not bound to an id (a private swarm of trusted holders only)",
    },
    "trust-reports": {
      type: "boolean",
      description:
        "credit backbones' stats as reported, not bounded by what the relay forwarded (backbones you run, dispatching around the relay)",
    },
    json: { type: "boolean", description: "one JSON object per line on stdout, for machines" },
  },
  async run(values, io, signal) {
    const json = values.json === true;
    const models = (values.model as string[] | undefined) ?? [];
    const modelDir = str(values, "model-dir");
    if (models.length === 0 && modelDir === undefined) {
      throw usageError("give at least one --model <gguf> (or --model-dir to register models at run time)");
    }
    const port = int(values, "port", 8443, 0, 65535);
    const host = str(values, "host") ?? "127.0.0.1";
    const served = await serveTls(values, host, signal);
    if (served === undefined) return; // stopped while starting
    const { tls, selfSignedInfo } = served;
    const secretFile = str(values, "secret-file");
    const generated = secretFile === undefined;
    const secret = generated ? randomBytes(32).toString("base64url") : await readSecret(secretFile);
    const say = (line: string, event: Record<string, unknown>) => {
      io.stdout.write(json ? `${JSON.stringify(event)}\n` : `${line}\n`);
    };
    const onEvent = hubEventPrinter(say, io);
    const leaseTtlS = int(values, "lease-ttl", 120, 1, 86_400);
    const hub = createHub({
      secret,
      models: models.map((path) => ({ path })),
      modelDir,
      manifestDir: str(values, "manifest-dir"),
      store: dbPath(values),
      sqliteDriver: sqliteDriverOf(values),
      trustProxy: (values["trust-proxy"] as string[] | undefined) ?? [],
      limits: limitsOf(values),
      enrolment: {
        burst: int(values, "enrol-burst", ENROL_BURST, 1, 1_000_000),
        perMinute: int(values, "enrol-per-minute", ENROL_PER_MINUTE, 1, 1_000_000),
      },
      tls,
      publicReads: values.private !== true,
      defaultMetrics: true,
      market: {
        leaseTtlMs: leaseTtlS * 1000,
        maxLeaseTtlMs: Math.max(3_600_000, leaseTtlS * 1000),
        halfLifeMs: int(values, "half-life", 600, 1, 365 * DAY_S) * 1000,
        maxReplicas: int(values, "max-replicas", 4, 1, 1024),
      },
      replicas: int(values, "replicas", 2, 1, 1024),
      pauseRetentionMs: int(values, "pause-retention", 30, 1, 3650) * DAY_S * 1000,
      allowUnboundTokens: values["allow-unbound-tokens"] === true,
      trustReports: values["trust-reports"] === true,
      onEvent,
    });
    const stopping = onAbort(signal, () => void hub.close());
    try {
      if (signal.aborted) return;
      const listener = await hub.listen(port, host);
      const infos = hub.models();
      const tokens = generated
        ? {
            admin: mintToken({ role: "admin", ttlS: 7 * DAY_S }, secret),
            // bound to ids: an unbound token could say hello as anyone (README "Tokens")
            worker: mintToken({ role: "worker", id: GENERATED_WORKER_ID, ttlS: 7 * DAY_S }, secret),
            backbone: mintToken({ role: "backbone", id: GENERATED_BACKBONE_ID, ttlS: 7 * DAY_S }, secret),
          }
        : undefined;
      const malloc = frameAllocatorState();
      const lines = listeningLines(values, hub.store, listener, infos, selfSignedInfo, tokens, malloc);
      say(lines.join("\n"), {
        event: "listening",
        url: listener.url,
        relayUrl: listener.relayUrl,
        port: listener.port,
        models: infos,
        store: hub.store.kind,
        ...(hub.store.driver ? { storeDriver: hub.store.driver } : {}),
        malloc,
        ...(selfSignedInfo
          ? {
              tls: {
                selfSigned: true,
                ca: selfSignedInfo.ca,
                hosts: selfSignedInfo.hosts,
                ...(selfSignedInfo.dir ? { dir: selfSignedInfo.dir, made: selfSignedInfo.made } : {}),
              },
            }
          : {}),
        ...(tokens ? { tokens, secretGenerated: true } : {}),
      });
      await new Promise<void>((resolve) => onAbort(signal, () => resolve()));
      say(`${CLI_NAME}: shutting down`, { event: "closing" });
    } finally {
      stopping[Symbol.dispose]();
      await hub.close();
    }
  },
};

const token: Command = {
  name: "token",
  summary: "mint a token signed with the hub's secret",
  usage:
    "token --secret-file <file> --role worker|backbone|admin [--id <peer id>] [--owner <principal>] [--ttl <seconds>]",
  options: {
    "secret-file": { type: "string", description: "file holding the hub's token secret" },
    role: { type: "string", description: "worker, backbone or admin" },
    id: {
      type: "string",
      description: "the peer id the token is bound to (required for worker and backbone)",
    },
    owner: {
      type: "string",
      description:
        "who the identity belongs to (default: the id); replicas of one owner count once, so give all of one person's devices the same owner",
    },
    ttl: { type: "string", description: "lifetime in seconds (default 86400)" },
  },
  async run(values, io) {
    const file = str(values, "secret-file");
    if (file === undefined) throw usageError("--secret-file is required");
    const role = str(values, "role");
    if (role !== "worker" && role !== "backbone" && role !== "admin") {
      throw usageError("--role must be worker, backbone or admin");
    }
    const ttlS = int(values, "ttl", DAY_S, 1, 10 * 365 * DAY_S);
    // each worker and backbone gets its own id: only its holder can then act as it
    if (role !== "admin" && str(values, "id") === undefined) {
      throw usageError(`--id <peer id> is required for a ${role} token (one token per peer)`);
    }
    const secret = await readSecret(file);
    const owner = str(values, "owner");
    io.stdout.write(
      `${mintToken({ role: role as TokenRole, id: str(values, "id"), ...(owner !== undefined ? { owner } : {}), ttlS }, secret)}\n`,
    );
  },
};

const COMMANDS: readonly Command[] = [serve, token, enrolCode, pauseCommand, resumeCommand, pausesCommand];

function helpText(command?: Command): string {
  if (command) {
    const opts = Object.entries(command.options).map(([name, o]) => {
      const flag = `--${name}${o.type === "string" ? " <value>" : ""}`;
      return `  ${flag.padEnd(26)} ${o.description}`;
    });
    return [`usage: ${CLI_NAME} ${command.usage}`, "", command.summary, "", "options:", ...opts, ""].join(
      "\n",
    );
  }
  return [
    `usage: ${CLI_NAME} <command> [options]`,
    "",
    "commands:",
    ...COMMANDS.map((c) => `  ${c.name.padEnd(8)} ${c.summary}`),
    "",
    `Run \`${CLI_NAME} <command> --help\` for its options. Errors print one line with their code.`,
    "",
  ].join("\n");
}

/**
 * Runs the CLI with `argv` (without node and the script): 0 on success (serve: after `signal`
 * stopped it), 1 on an error (one line `moeswarm-hub: CODE: message` on stderr), 2 on a usage error.
 */
export async function runCli(
  argv: readonly string[],
  io: CliIo,
  signal: AbortSignal = new AbortController().signal,
): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === "--help" || name === "-h" || name === "help") {
    io.stdout.write(helpText(name === "help" ? COMMANDS.find((c) => c.name === rest[0]) : undefined));
    return name === undefined ? 2 : 0;
  }
  const fail = (error: unknown, status: number): number => {
    const { code, message } = describeError(error);
    // one line: the first line of a multi-line message, the rest folded in
    io.stderr.write(`${CLI_NAME}: ${code}: ${message.replace(/\s*\n\s*/g, " ")}\n`);
    return status;
  };
  const command = COMMANDS.find((c) => c.name === name);
  if (!command) return fail(usageError(`unknown command ${JSON.stringify(name)}; try --help`), 2);
  let values: Values;
  let positionals: string[];
  try {
    const parsed = parseArgs({
      args: [...rest],
      options: { ...command.options, help: { type: "boolean", short: "h" } },
      allowPositionals: command.positionals === true,
      strict: true,
    });
    values = parsed.values as Values;
    positionals = parsed.positionals;
  } catch (error) {
    return fail(error, 2);
  }
  if (values.help === true) {
    io.stdout.write(helpText(command));
    return 0;
  }
  try {
    await command.run(values, io, signal, positionals);
    return 0;
  } catch (error) {
    return fail(error, isUsageError(error) ? 2 : 1);
  }
}

import { randomBytes } from "node:crypto";
import { hostname } from "node:os";
import {
  type ClaimCapacityJson as ClaimCapacity,
  capacityWeightBytes,
  InvalidArgumentError,
} from "@moeswarm/core";
import { type HubCa as CaOption, HubClient } from "@moeswarm/relay-client";
import {
  BACKEND_CHOICES,
  type BackendChoice,
  type ComputeBackend,
  type ExpertCompute,
  GPU_BACKEND_CHOICES,
  isBackendChoice,
} from "@moeswarm/worker-native";
import { type DirectOptions, type DirectSettings, directSettings } from "./direct.js";
import type { WorkerEvent } from "./events.js";
import { type NativeListenOptions, type NativeSettings, nativeSettings } from "./native.js";
import { checkPowerOptions, type PowerOptions } from "./power.js";

// runWorker's options, checked once into Settings, and the summary it resolves with.

export interface RunWorkerOptions {
  /** The hub's base URL (http or https). */
  hub: string | URL;
  /** A worker token of the hub (`moeswarm-hub token --role worker`). */
  token: string;
  /**
   * Memory this worker offers for expert weights: the slices it claims (as many as fit) add up to
   * at most `vramBytes` on a GPU backend ("vulkan", "cuda": the weights live on the device) when
   * given, else `ramBytes + vramBytes` (core's capacityWeightBytes, the hub's rule too).
   */
  capacity: { ramBytes: number; vramBytes?: number };
  /** Where slices are kept across restarts (`<cacheDir>/<model>/<layers>_<experts>.gguf`). */
  cacheDir: string;
  /**
   * Most bytes the cache may hold (default: no limit). Before a download, abandoned partial
   * downloads and then the least recently used slices not being served are deleted until the new
   * slice fits; slices being served are never deleted, so the cache can exceed this when they
   * alone do.
   */
  cacheMaxBytes?: number;
  /**
   * Aborting it is how a worker is stopped: before serving it gives up its lease at once; while
   * serving it drains (no new work, in-flight requests finish, deregisters) and runWorker resolves.
   * A lease it holds for a slice not yet registered is given back either way.
   */
  signal?: AbortSignal;
  /**
   * Expert compute: "auto" (default: native when it loads, else the static executable where the
   * platform has one, e.g. Android, else TypeScript), "native", "llama-cpu", "worker", "vulkan", "cuda",
   * "ts".
   */
  backend?: BackendChoice;
  /**
   * Wraps each loaded compute before it serves (instrumentation, tracing, fault injection in tests
   * and the demo's liar). The wrapper owns the compute it is given and must dispose of it.
   */
  wrapCompute?: (compute: ExpertCompute) => ExpertCompute;
  /** Compute threads (native paths; default all CPUs). */
  threads?: number;
  /**
   * GPU backends ("vulkan", "cuda"): most (token, expert) rows per compute graph, 1..65536
   * (default 512, worker-native's GPU_MAX_BATCH_ROWS). The worker reserves its compute buffer for
   * this many at load and computes larger requests in chunks; fewer rows leave more device memory
   * for weights (the CLI's default `--vram` offer follows it). Refused with another backend, where
   * no buffer is reserved.
   */
  maxBatchRows?: number;
  /** This worker's id on the relay (default: the token's bound id, else `<hostname>-<random>`). */
  id?: string;
  /** PEM CA certificate(s) to trust for a self-hosted hub (https and wss). */
  ca?: CaOption;
  /** Every step, one event each. Exceptions it throws are ignored. */
  log?: (event: WorkerEvent) => void;
  /** Pause between demand polls while there is nothing to claim (default 10000 ms, +-20% jitter). */
  pollMs?: number;
  /** Serve only this model (default: whatever the hub needs). */
  model?: string;
  /** Lease lifetime to ask for (default: the hub's). */
  leaseTtlMs?: number;
  /** The relay's URL (default: the hub's `/relay`, ws or wss as the hub is http or https). */
  relay?: string;
  /** Downloads of a slice that fail its sha256 check before giving up (default 3). */
  maxVerifyAttempts?: number;
  /** Longest wait for in-flight requests when draining (default 30000 ms). */
  drainTimeoutMs?: number;
  /** Relay heartbeat interval (default relay-client's, 5000 ms). */
  heartbeatMs?: number;
  /** Download retries: consecutive failures without progress (default 6) and the idle cut (30 s). */
  download?: { maxAttempts?: number; initialDelayMs?: number; maxDelayMs?: number; idleTimeoutMs?: number };
  /** Least time between two `progress` events (default 250 ms). */
  progressIntervalMs?: number;
  /** Also serve backbones directly on a TLS WebSocket endpoint (the relay stays for the others). */
  direct?: DirectOptions;
  /**
   * Also serve backbone plugins on the native listener (protocol section 10.9: TLS into the
   * addon's threads, no relay): the layers one in-process native or llama-cpu slice holds alone.
   * Its certificate is `direct`'s when both are on (one fingerprint).
   */
  native?: NativeListenOptions;
  /**
   * Pause on low battery or heat, read from sysfs every 30 s (see PowerOptions); the worker tells
   * the hub, which routes it nothing new until it recovers. Default: off (`moeswarm-worker` turns
   * it on with --pause-battery 20 and --pause-temp 45).
   */
  power?: PowerOptions | false;
}

/** A slice a worker served. */
export interface WorkerSliceSummary {
  model: string;
  /** "a:b" */
  layers: string;
  /** "a:b" */
  experts: string;
  path: string;
  /** Taken from the cache (verified), not downloaded. */
  reused: boolean;
}

export interface WorkerSummary {
  id: string;
  /** Why it ended: the caller's signal, or a `drain` from the hub. */
  reason: "signal" | "drain";
  /** Whether it reached `serving`. */
  served: boolean;
  /** Every slice it registered, in order. */
  slices: WorkerSliceSummary[];
  /** The first of `slices` (kept for callers of one-slice workers). */
  slice?: WorkerSliceSummary | undefined;
  backend?: ComputeBackend | undefined;
  /** Bytes downloaded by this run (0 when a cached slice was reused). */
  downloadedBytes: number;
  /** Dispatches answered with a result, and their tokens. */
  requests: number;
  tokens: number;
  /** Dispatches answered with an error. */
  failed: number;
  ms: number;
}

/** The options, checked and with their defaults. */
export interface Settings {
  hub: HubClient;
  token: string;
  id: string;
  capacity: ClaimCapacity;
  capacityBytes: number;
  cacheDir: string;
  cacheMaxBytes: number | undefined;
  backend: BackendChoice;
  wrapCompute: ((compute: ExpertCompute) => ExpertCompute) | undefined;
  threads: number | undefined;
  /** GPU backends only; undefined: worker-native's default. */
  maxBatchRows: number | undefined;
  pollMs: number;
  model: string | undefined;
  leaseTtlMs: number | undefined;
  relay: string;
  maxVerifyAttempts: number;
  drainTimeoutMs: number;
  heartbeatMs: number | undefined;
  download: NonNullable<RunWorkerOptions["download"]>;
  progressIntervalMs: number;
  direct: DirectSettings | undefined;
  native: NativeSettings | undefined;
  power: PowerOptions | false;
}

function bytesOption(name: string, v: unknown, required: boolean): number {
  if (v === undefined && !required) return 0;
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
    throw new InvalidArgumentError(`${name} must be an integer number of bytes >= 0`);
  }
  return v;
}

function msOption(name: string, v: number | undefined, fallback: number, min: number): number {
  const x = v ?? fallback;
  if (typeof x !== "number" || !Number.isFinite(x) || x < min)
    throw new InvalidArgumentError(`${name} must be a number >= ${min}`);
  return x;
}

/** The id a `msw1.` token is bound to (read, not verified: the hub verifies). */
export function tokenSubject(token: string): string | undefined {
  const parts = token.split(".");
  if (parts.length !== 3 || parts[0] !== "msw1") return undefined;
  try {
    const claims = JSON.parse(Buffer.from(parts[1] as string, "base64url").toString("utf8")) as {
      sub?: unknown;
    };
    return typeof claims.sub === "string" ? claims.sub : undefined;
  } catch {
    return undefined;
  }
}

export function settings(o: RunWorkerOptions): Settings {
  if (typeof o !== "object" || o === null)
    throw new InvalidArgumentError("runWorker needs an options object");
  if (typeof o.token !== "string" || o.token.length === 0)
    throw new InvalidArgumentError("token must be a non-empty string");
  if (typeof o.capacity !== "object" || o.capacity === null)
    throw new InvalidArgumentError("capacity must be {ramBytes, vramBytes?}");
  const ramBytes = bytesOption("capacity.ramBytes", o.capacity.ramBytes, true);
  const vramBytes = bytesOption("capacity.vramBytes", o.capacity.vramBytes, false);
  if (ramBytes + vramBytes <= 0) throw new InvalidArgumentError("capacity must offer some bytes");
  if (typeof o.cacheDir !== "string" || o.cacheDir.length === 0)
    throw new InvalidArgumentError("cacheDir must be a directory path");
  const backend = o.backend ?? "auto";
  if (!isBackendChoice(backend)) {
    throw new InvalidArgumentError(
      `backend must be ${BACKEND_CHOICES.map((b) => `"${b}"`).join(", ")}, got ${String(backend)}`,
    );
  }
  if (o.threads !== undefined && (!Number.isInteger(o.threads) || o.threads < 1 || o.threads > 1024)) {
    throw new InvalidArgumentError("threads must be an integer in 1..1024");
  }
  const bound = tokenSubject(o.token);
  if (
    o.id !== undefined &&
    (typeof o.id !== "string" || o.id.length === 0 || Buffer.byteLength(o.id) > 128)
  ) {
    throw new InvalidArgumentError("id must be a string of 1..128 bytes");
  }
  if (o.id !== undefined && bound !== undefined && o.id !== bound) {
    throw new InvalidArgumentError(
      `the token is bound to worker ${JSON.stringify(bound)}, not ${JSON.stringify(o.id)}`,
    );
  }
  const id = o.id ?? bound ?? `${hostname().slice(0, 64) || "worker"}-${randomBytes(3).toString("hex")}`;
  const hub = new HubClient({ base: o.hub, token: o.token, ca: o.ca });
  let relay = o.relay ?? hub.relayUrl();
  try {
    const u = new URL(relay);
    if (u.protocol !== "ws:" && u.protocol !== "wss:") throw new Error();
    relay = u.href;
  } catch {
    throw new InvalidArgumentError(`relay must be a ws:// or wss:// URL, got ${JSON.stringify(o.relay)}`);
  }
  if (o.model !== undefined && typeof o.model !== "string")
    throw new InvalidArgumentError("model must be a string");
  const maxVerifyAttempts = o.maxVerifyAttempts ?? 3;
  if (!Number.isInteger(maxVerifyAttempts) || maxVerifyAttempts < 1)
    throw new InvalidArgumentError("maxVerifyAttempts must be an integer >= 1");
  const capacity = {
    ramBytes,
    ...(vramBytes ? { vramBytes } : {}),
    backend: GPU_BACKEND_CHOICES.includes(backend) ? backend : "cpu",
  };
  return {
    hub,
    token: o.token,
    id,
    capacity,
    capacityBytes: capacityWeightBytes(capacity),
    cacheDir: o.cacheDir,
    cacheMaxBytes:
      o.cacheMaxBytes === undefined ? undefined : bytesOption("cacheMaxBytes", o.cacheMaxBytes, true),
    backend,
    wrapCompute: checkWrapCompute(o.wrapCompute),
    threads: o.threads,
    maxBatchRows: maxBatchRowsOption(o.maxBatchRows, backend),
    pollMs: msOption("pollMs", o.pollMs, 10_000, 10),
    model: o.model,
    leaseTtlMs: o.leaseTtlMs === undefined ? undefined : msOption("leaseTtlMs", o.leaseTtlMs, 0, 1000),
    relay,
    maxVerifyAttempts,
    drainTimeoutMs: msOption("drainTimeoutMs", o.drainTimeoutMs, 30_000, 0),
    heartbeatMs: o.heartbeatMs,
    download: o.download ?? {},
    progressIntervalMs: msOption("progressIntervalMs", o.progressIntervalMs, 250, 0),
    direct: directSettings(o.direct),
    native: nativeSettingsWith(o.native, o.direct),
    power: powerSettings(o.power),
  };
}

/** The most rows a GPU worker's graph may take: worker-native's own bounds (1..65536). */
export const MAX_BATCH_ROWS_LIMIT = 65_536;

function maxBatchRowsOption(v: unknown, backend: BackendChoice): number | undefined {
  if (v === undefined) return undefined;
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 1 || v > MAX_BATCH_ROWS_LIMIT) {
    throw new InvalidArgumentError(
      `maxBatchRows must be an integer in 1..${MAX_BATCH_ROWS_LIMIT}, got ${String(v)}`,
    );
  }
  // only a GPU worker reserves a compute buffer at load: elsewhere the bound would mean nothing
  if (!GPU_BACKEND_CHOICES.includes(backend)) {
    throw new InvalidArgumentError(
      `maxBatchRows applies to the GPU backends (${GPU_BACKEND_CHOICES.join(", ")}), not backend "${backend}"`,
    );
  }
  return v;
}

function checkWrapCompute(v: unknown): Settings["wrapCompute"] {
  if (v !== undefined && typeof v !== "function")
    throw new InvalidArgumentError("wrapCompute must be a function");
  return v as Settings["wrapCompute"];
}

function powerSettings(v: PowerOptions | false | undefined): PowerOptions | false {
  if (v === undefined || v === false) return false;
  checkPowerOptions(v);
  return { ...v };
}

/** `native`, checked, with one certificate for both listeners (the fingerprint published is theirs). */
function nativeSettingsWith(
  native: NativeListenOptions | undefined,
  direct: DirectOptions | undefined,
): NativeSettings | undefined {
  const n = nativeSettings(native);
  if (
    n?.cert !== undefined &&
    direct?.tlsCert !== undefined &&
    (n.cert !== direct.tlsCert || n.key !== direct.tlsKey)
  ) {
    throw new InvalidArgumentError(
      "native and direct must serve the same TLS certificate and key (backbones pin one fingerprint)",
    );
  }
  return n;
}

import { randomBytes } from "node:crypto";
import { mkdir } from "node:fs/promises";
import { hostname } from "node:os";
import {
  AuthError,
  abortReason,
  type ClaimCapacityJson as ClaimCapacity,
  GgufError,
  InvalidArgumentError,
  isMoeswarmError,
  type LeaseJson,
  type MoeswarmError,
  parseRange,
  type Range,
  sleep,
  TransportError,
  traceHop,
} from "@moeswarm/core";
import {
  type HubCa as CaOption,
  connectRelay,
  HubClient,
  type IncomingDispatch,
  isTransient,
  type RelayConnection,
} from "@moeswarm/relay-client";
import { type SliceManifest, verifySlice } from "@moeswarm/shard";
import {
  BACKEND_CHOICES,
  type BackendChoice,
  type ComputeBackend,
  type ExpertCompute,
  isBackendChoice,
  loadExpertCompute,
  nativeStatus,
} from "@moeswarm/worker-native";
import { chooseSlices, type SliceRect } from "./choose.js";
import { downloadResumable } from "./download.js";
import type { WorkerEvent, WorkerEventBody } from "./events.js";
import { LeaseKeeper } from "./lease-keeper.js";
import { manifestOf } from "./manifest.js";
import {
  listCachedSlices,
  pruneSliceCache,
  removeSlice,
  type SlicePaths,
  slicePaths,
  touchSlice,
  writeSliceMeta,
} from "./slice-cache.js";
import { SliceRouter } from "./slice-router.js";

export interface RunWorkerOptions {
  /** The hub's base URL (http or https). */
  hub: string | URL;
  /** A worker token of the hub (`moeswarm-hub token --role worker`). */
  token: string;
  /**
   * Memory this worker offers for expert weights: the slices it claims (as many as fit) add up to
   * at most `ramBytes + vramBytes`.
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
  /** Expert compute: "auto" (default: native when it loads, else TypeScript), "native", "llama-cpu", "ts". */
  backend?: BackendChoice;
  /** Compute threads (native paths; default all CPUs). */
  threads?: number;
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

interface Settings {
  hub: HubClient;
  token: string;
  id: string;
  capacity: ClaimCapacity;
  capacityBytes: number;
  cacheDir: string;
  cacheMaxBytes: number | undefined;
  backend: BackendChoice;
  threads: number | undefined;
  pollMs: number;
  model: string | undefined;
  leaseTtlMs: number | undefined;
  relay: string;
  maxVerifyAttempts: number;
  drainTimeoutMs: number;
  heartbeatMs: number | undefined;
  download: NonNullable<RunWorkerOptions["download"]>;
  progressIntervalMs: number;
}

function invalid(message: string): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", message);
}

function bytesOption(name: string, v: unknown, required: boolean): number {
  if (v === undefined && !required) return 0;
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
    throw invalid(`${name} must be an integer number of bytes >= 0`);
  }
  return v;
}

function msOption(name: string, v: number | undefined, fallback: number, min: number): number {
  const x = v ?? fallback;
  if (typeof x !== "number" || !Number.isFinite(x) || x < min)
    throw invalid(`${name} must be a number >= ${min}`);
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

function settings(o: RunWorkerOptions): Settings {
  if (typeof o !== "object" || o === null) throw invalid("runWorker needs an options object");
  if (typeof o.token !== "string" || o.token.length === 0) throw invalid("token must be a non-empty string");
  if (typeof o.capacity !== "object" || o.capacity === null)
    throw invalid("capacity must be {ramBytes, vramBytes?}");
  const ramBytes = bytesOption("capacity.ramBytes", o.capacity.ramBytes, true);
  const vramBytes = bytesOption("capacity.vramBytes", o.capacity.vramBytes, false);
  if (ramBytes + vramBytes <= 0) throw invalid("capacity must offer some bytes");
  if (typeof o.cacheDir !== "string" || o.cacheDir.length === 0)
    throw invalid("cacheDir must be a directory path");
  const backend = o.backend ?? "auto";
  if (!isBackendChoice(backend)) {
    throw invalid(
      `backend must be ${BACKEND_CHOICES.map((b) => `"${b}"`).join(", ")}, got ${String(backend)}`,
    );
  }
  if (o.threads !== undefined && (!Number.isInteger(o.threads) || o.threads < 1 || o.threads > 1024)) {
    throw invalid("threads must be an integer in 1..1024");
  }
  const bound = tokenSubject(o.token);
  if (
    o.id !== undefined &&
    (typeof o.id !== "string" || o.id.length === 0 || Buffer.byteLength(o.id) > 128)
  ) {
    throw invalid("id must be a string of 1..128 bytes");
  }
  if (o.id !== undefined && bound !== undefined && o.id !== bound) {
    throw invalid(`the token is bound to worker ${JSON.stringify(bound)}, not ${JSON.stringify(o.id)}`);
  }
  const id = o.id ?? bound ?? `${hostname().slice(0, 64) || "worker"}-${randomBytes(3).toString("hex")}`;
  const hub = new HubClient({ base: o.hub, token: o.token, ca: o.ca });
  let relay = o.relay ?? hub.relayUrl();
  try {
    const u = new URL(relay);
    if (u.protocol !== "ws:" && u.protocol !== "wss:") throw new Error();
    relay = u.href;
  } catch {
    throw invalid(`relay must be a ws:// or wss:// URL, got ${JSON.stringify(o.relay)}`);
  }
  if (o.model !== undefined && typeof o.model !== "string") throw invalid("model must be a string");
  const maxVerifyAttempts = o.maxVerifyAttempts ?? 3;
  if (!Number.isInteger(maxVerifyAttempts) || maxVerifyAttempts < 1)
    throw invalid("maxVerifyAttempts must be an integer >= 1");
  return {
    hub,
    token: o.token,
    id,
    capacity: { ramBytes, ...(vramBytes ? { vramBytes } : {}), backend: "cpu" },
    capacityBytes: ramBytes + vramBytes,
    cacheDir: o.cacheDir,
    cacheMaxBytes:
      o.cacheMaxBytes === undefined ? undefined : bytesOption("cacheMaxBytes", o.cacheMaxBytes, true),
    backend,
    threads: o.threads,
    pollMs: msOption("pollMs", o.pollMs, 10_000, 10),
    model: o.model,
    leaseTtlMs: o.leaseTtlMs === undefined ? undefined : msOption("leaseTtlMs", o.leaseTtlMs, 0, 1000),
    relay,
    maxVerifyAttempts,
    drainTimeoutMs: msOption("drainTimeoutMs", o.drainTimeoutMs, 30_000, 0),
    heartbeatMs: o.heartbeatMs,
    download: o.download ?? {},
    progressIntervalMs: msOption("progressIntervalMs", o.progressIntervalMs, 250, 0),
  };
}

function message(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

function codeOf(error: unknown): string {
  return isMoeswarmError(error) ? error.code : "MOESWARM_DISPATCH_FAILED";
}

function jitter(ms: number): number {
  return Math.round(ms * (0.8 + 0.4 * Math.random()));
}

function rangeValues(r: Range): number[] {
  return Array.from({ length: r.end - r.start }, (_, i) => r.start + i);
}

/** A lease whose slice is on disk and verified. */
interface Acquired {
  lease: LeaseJson;
  keeper: LeaseKeeper;
  layers: Range;
  experts: Range;
  paths: SlicePaths;
  reused: boolean;
}

/** A slice loaded, registered and served. */
interface Held {
  model: string;
  layers: Range;
  experts: Range;
  /** Expert bytes, as the hub counted them in the lease. */
  bytes: number;
  compute: ExpertCompute;
  summary: WorkerSliceSummary;
}

/** Thrown inside the acquire loop when the lease went away: claim again. */
class LeaseLost extends Error {}

/**
 * The autonomous worker: finds what the hub's swarm needs, claims the slice that fits its capacity
 * and adds the most value, downloads it (resuming, renewing the lease), verifies every slab's
 * sha256 against the model's manifest, loads it into an expert compute, registers exactly that
 * slice on the relay and serves dispatches. While capacity is left and the demand has something
 * that fits, it claims, fetches, loads and registers the next slice the same way (one compute per
 * slice; a dispatch whose slots span several of its slices is split between them and merged, with
 * the bits of one compute over them all). It serves until the `signal` aborts or the hub sends
 * `drain`; then it stops taking work, finishes what it holds, deregisters and resolves with a
 * summary.
 *
 * The choice is made here from `GET /api/demand` (see `chooseSlices`), not by
 * `POST /api/claims/auto`, because only the worker knows what its cache holds: a slice it already
 * has costs no download, so it claims those first (every verified one that the hub still wants).
 *
 * Rejects on what retrying cannot fix before anything is served: a refused token, a slice that
 * fails verification `maxVerifyAttempts` times, a compute that cannot load; and, at any time, a
 * relay connection that closes for good. Such a failure of a later slice is logged
 * (`grow-failed`) and the worker keeps serving what it has. Network failures and hub errors (5xx)
 * are retried with backoff.
 */
export async function runWorker(options: RunWorkerOptions): Promise<WorkerSummary> {
  const s = settings(options);
  try {
    return await new WorkerRun(s, options.signal, options.log).run();
  } finally {
    await s.hub.close();
  }
}

function overlap(a: SliceRect, b: { layers: Range; experts: Range }): boolean {
  return (
    a.layers.start < b.layers.end &&
    b.layers.start < a.layers.end &&
    a.experts.start < b.experts.end &&
    b.experts.start < a.experts.end
  );
}

class WorkerRun {
  readonly #s: Settings;
  readonly #log: ((event: WorkerEvent) => void) | undefined;
  readonly #userSignal: AbortSignal | undefined;
  /** Aborted to stop: by the caller's signal, or by a drain from the hub. */
  readonly #stop = new AbortController();
  #reason: "signal" | "drain" = "signal";
  #drainReason = "";
  readonly #t0 = performance.now();
  #downloadedBytes = 0;
  #bandwidthBps: number | undefined;
  #requests = 0;
  #tokens = 0;
  #failed = 0;
  #inFlight = 0;
  #draining = false;
  #idleWaiters: Array<() => void> = [];
  #dispatchErrors = 0;
  #fatal: MoeswarmError | undefined;
  /** The slices served, in the order registered, and their computes per model. */
  readonly #held: Held[] = [];
  readonly #routers = new Map<string, SliceRouter>();
  #conn: RelayConnection | undefined;
  /** Cached slice files already tried in this run. */
  readonly #cachedTried = new Set<string>();
  /** No lease granted yet in this run. */
  #fresh = true;

  constructor(s: Settings, signal: AbortSignal | undefined, log: ((event: WorkerEvent) => void) | undefined) {
    this.#s = s;
    this.#userSignal = signal;
    this.#log = log;
  }

  #emit(body: WorkerEventBody): void {
    if (!this.#log) return;
    try {
      this.#log({ ...body, time: new Date().toISOString() } as WorkerEvent);
    } catch {
      // a logger's failure is its own
    }
  }

  #summary(extra: Partial<WorkerSummary> = {}): WorkerSummary {
    const slices = this.#held.map((h) => ({ ...h.summary }));
    const first = this.#held[0]?.compute.info.backend;
    return {
      id: this.#s.id,
      reason: this.#reason,
      served: false,
      slices,
      slice: slices[0],
      ...(first !== undefined ? { backend: first } : {}),
      downloadedBytes: this.#downloadedBytes,
      requests: this.#requests,
      tokens: this.#tokens,
      failed: this.#failed,
      ms: performance.now() - this.#t0,
      ...extra,
    };
  }

  #requestStop(reason: "signal" | "drain", text: string): void {
    if (this.#stop.signal.aborted) return;
    this.#reason = reason;
    this.#drainReason = text;
    this.#stop.abort(new TransportError("MOESWARM_TRANSPORT_DRAINING", `worker stopping: ${text}`));
  }

  /** The capacity its slices leave for another (expert bytes, as the hub counts them). */
  #capacityLeft(): number {
    return Math.max(0, this.#s.capacityBytes - this.#held.reduce((n, h) => n + h.bytes, 0));
  }

  #heldRects(): SliceRect[] {
    return this.#held.map((h) => ({ model: h.model, layers: h.layers, experts: h.experts }));
  }

  async run(): Promise<WorkerSummary> {
    const s = this.#s;
    const onAbort = () => {
      const why = this.#userSignal?.reason;
      this.#requestStop("signal", typeof why === "string" && why.length <= 64 ? why : "stop requested");
    };
    if (this.#userSignal?.aborted) onAbort();
    this.#userSignal?.addEventListener("abort", onAbort, { once: true });
    try {
      this.#emit({
        event: "start",
        id: s.id,
        hub: s.hub.base.href,
        capacityBytes: s.capacityBytes,
        cacheDir: s.cacheDir,
        backend: s.backend,
      });
      await mkdir(s.cacheDir, { recursive: true });
      await this.#grow();
      if (this.#fatal) throw this.#fatal;
      if (!this.#conn || this.#held.length === 0) {
        this.#emit({ event: "stopped", reason: this.#drainReason });
        return this.#summary();
      }
      return await this.#drain(this.#conn);
    } catch (error) {
      this.#emit({ event: "error", error: message(error), code: codeOf(error) });
      throw error;
    } finally {
      this.#userSignal?.removeEventListener("abort", onAbort);
      await this.#conn?.close();
      for (const h of this.#held) await h.compute.close().catch(() => {});
    }
  }

  /**
   * Claims, fetches, loads and registers slices while capacity is left and the demand has
   * something that fits (polling while it has not); returns once the worker is to stop.
   */
  async #grow(): Promise<void> {
    const stop = this.#stop.signal;
    while (!stop.aborted) {
      let acquired: Acquired;
      try {
        acquired = await this.#acquire();
      } catch (error) {
        if (stop.aborted) return;
        if (this.#held.length === 0) throw error;
        await this.#stopGrowing(error);
        return;
      }
      try {
        await this.#add(acquired);
      } catch (error) {
        acquired.keeper.stop();
        // not registered: the lease is not fulfilled, give it back
        await this.#release(acquired.lease);
        if (stop.aborted) return;
        if (this.#held.length === 0) throw error;
        await this.#stopGrowing(error);
        return;
      }
    }
  }

  /** A later slice cannot be had: say why, keep serving the others until told to stop. */
  async #stopGrowing(error: unknown): Promise<void> {
    this.#emit({ event: "grow-failed", error: message(error), code: codeOf(error) });
    const stop = this.#stop.signal;
    await new Promise<void>((resolve) => {
      if (stop.aborted) resolve();
      else stop.addEventListener("abort", () => resolve(), { once: true });
    });
  }

  // --- finding, claiming and fetching a slice -------------------------------------------------

  async #acquire(): Promise<Acquired> {
    const s = this.#s;
    const stop = this.#stop.signal;
    let lastIdle = "";
    let quickRetries = 0;
    let hubFailures = 0;
    for (;;) {
      if (stop.aborted) throw abortReason(stop);
      if (this.#held.length > 0 && this.#capacityLeft() === 0) {
        // nothing can fit any more (slices are never given up while it runs): stop polling
        this.#emit({
          event: "idle",
          reason: "full",
          ranges: 0,
          capacityBytes: 0,
          pollMs: s.pollMs,
          heldBytes: s.capacityBytes,
        });
        // nothing to do until stopped: the sleep rejects with the stop's reason
        for (;;) await sleep(2 ** 31 - 1, stop);
      }
      let lease: LeaseJson | undefined;
      let value: number | undefined;
      try {
        // what it has cached first (no download), then the demand, with the room left
        lease = await this.#claimCached();
        if (!lease) {
          const left = this.#capacityLeft();
          const demand = await s.hub.demand({ model: s.model, signal: stop });
          const ranges = demand.ranges.filter((r) => s.model === undefined || r.model === s.model);
          const [choice] = chooseSlices(ranges, left, { limit: 1, exclude: this.#heldRects() });
          hubFailures = 0;
          if (!choice) {
            const idle = ranges.length === 0 ? "covered" : `no-fit:${ranges.length}`;
            if (idle !== lastIdle) {
              this.#emit({
                event: "idle",
                reason: ranges.length === 0 ? "covered" : "no-fit",
                ranges: ranges.length,
                capacityBytes: left,
                pollMs: s.pollMs,
                ...(this.#held.length > 0 ? { heldBytes: s.capacityBytes - left } : {}),
              });
              lastIdle = idle;
            }
            await sleep(jitter(s.pollMs), stop);
            continue;
          }
          value = choice.value;
          this.#emit({
            event: "demand",
            ranges: ranges.length,
            cells: ranges.reduce((n, r) => n + r.count, 0),
            rangeBytes: ranges.reduce((n, r) => n + r.bytes, 0),
            model: choice.model,
            layers: `${choice.layers.start}:${choice.layers.end}`,
            experts: `${choice.experts.start}:${choice.experts.end}`,
            value: choice.value,
            bytes: choice.bytes,
            capacityBytes: left,
          });
          lease = await this.#tryClaim(choice.model, choice.layers, choice.experts);
          if (!lease) {
            // another worker took it first: the demand has changed, read it again soon
            quickRetries++;
            const pause = quickRetries < 5 ? 50 + Math.random() * 250 : jitter(s.pollMs);
            if (quickRetries >= 5) quickRetries = 0;
            await sleep(pause, stop);
            continue;
          }
        }
      } catch (error) {
        if (stop.aborted) throw abortReason(stop);
        if (!isTransient(error)) throw error;
        hubFailures++;
        const retryInMs = Math.min(s.pollMs, 30_000, 500 * 2 ** Math.min(hubFailures - 1, 10));
        this.#emit({ event: "hub-unreachable", error: message(error), code: codeOf(error), retryInMs });
        await sleep(jitter(retryInMs), stop);
        continue;
      }
      lastIdle = "";
      quickRetries = 0;
      const layers = parseRange(lease.layers);
      const experts = parseRange(lease.experts);
      const paths = slicePaths(s.cacheDir, lease.model, layers, experts);
      const cached = (await listCachedSlices(s.cacheDir, lease.model)).some((c) => c.path === paths.path);
      this.#emit({
        event: "claimed",
        model: lease.model,
        layers: lease.layers,
        experts: lease.experts,
        leaseId: lease.leaseId,
        bytes: lease.bytes,
        ttlMs: lease.ttlMs,
        cached,
        value,
      });
      const keeper = new LeaseKeeper(s.hub, lease, {
        ttlMs: s.leaseTtlMs,
        onRenewed: (l) => this.#emit({ event: "lease-renewed", leaseId: l.leaseId, ttlMs: l.ttlMs }),
        onLost: (e) => this.#emit({ event: "lease-lost", leaseId: lease.leaseId, error: message(e) }),
      });
      try {
        const reused = await this.#fetch(lease, keeper, paths, cached);
        return { lease, keeper, layers, experts, paths, reused };
      } catch (error) {
        keeper.stop();
        if (stop.aborted) {
          await this.#release(lease);
          throw abortReason(stop);
        }
        if (error instanceof LeaseLost) continue;
        await this.#release(lease);
        if (isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND")) {
          // the model left the hub while we fetched it: pick again
          this.#emit({ event: "lease-lost", leaseId: lease.leaseId, error: message(error) });
          continue;
        }
        if (isTransient(error)) {
          // the download gave up on the network: claim again later (the .part file stays for resume)
          this.#emit({
            event: "hub-unreachable",
            error: message(error),
            code: codeOf(error),
            retryInMs: s.pollMs,
          });
          await sleep(jitter(s.pollMs), stop);
          continue;
        }
        throw error;
      }
    }
  }

  /**
   * Claims the newest cached slice, not tried yet in this run and not overlapping what the worker
   * holds, that the hub still needs below its target; undefined when none.
   */
  async #claimCached(): Promise<LeaseJson | undefined> {
    const s = this.#s;
    for (const c of await listCachedSlices(s.cacheDir, s.model)) {
      if (this.#cachedTried.has(c.path)) continue;
      this.#cachedTried.add(c.path);
      if (this.#heldRects().some((h) => h.model === c.model && overlap(h, c))) continue;
      this.#emit({
        event: "cached",
        model: c.model,
        layers: c.meta.layers,
        experts: c.meta.experts,
        path: c.path,
      });
      const lease = await this.#tryClaim(c.model, c.layers, c.experts);
      if (lease) return lease;
    }
    return undefined;
  }

  /** POST /api/claims; undefined when the hub refuses it (409, or the model is gone). */
  async #tryClaim(model: string, layers: Range, experts: Range): Promise<LeaseJson | undefined> {
    const s = this.#s;
    const fields = {
      model,
      layers: `${layers.start}:${layers.end}`,
      experts: `${experts.start}:${experts.end}`,
    };
    try {
      const lease = await s.hub.claim(
        {
          ...fields,
          capacity: {
            ...s.capacity,
            ...(this.#bandwidthBps ? { bandwidthBps: Math.round(this.#bandwidthBps) } : {}),
          },
          worker: s.id,
          ...(s.leaseTtlMs !== undefined ? { ttlMs: s.leaseTtlMs } : {}),
          // until its first lease, whatever the hub still holds for this id is a previous run's
          ...(this.#fresh ? { replaceLeases: true } : {}),
        },
        this.#stop.signal,
      );
      this.#fresh = false;
      return lease;
    } catch (error) {
      if (
        isMoeswarmError(error, "MOESWARM_HUB_CONFLICT") ||
        isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND")
      ) {
        const d = error.details ?? {};
        this.#emit({
          event: "claim-refused",
          ...fields,
          reason:
            typeof d.reason === "string"
              ? d.reason
              : error.code === "MOESWARM_HUB_NOT_FOUND"
                ? "not-found"
                : "conflict",
          retryAfterMs: typeof d.retryAfterMs === "number" ? d.retryAfterMs : undefined,
        });
        return undefined;
      }
      throw error;
    }
  }

  /** Gives a lease back (best effort, bounded: the hub expires it anyway). */
  async #release(lease: LeaseJson): Promise<void> {
    try {
      await this.#s.hub.release(lease.leaseId, AbortSignal.timeout(5000));
      this.#emit({ event: "lease-released", leaseId: lease.leaseId });
    } catch {
      // gone already, or the hub is unreachable: it expires by itself
    }
  }

  /** Puts the leased slice on disk, verified; true when a cached copy was reused. */
  async #fetch(lease: LeaseJson, keeper: LeaseKeeper, paths: SlicePaths, cached: boolean): Promise<boolean> {
    const s = this.#s;
    const signal = AbortSignal.any([this.#stop.signal, keeper.signal]);
    const lost = () => {
      if (keeper.signal.aborted && !this.#stop.signal.aborted) throw new LeaseLost();
    };
    let manifest: SliceManifest;
    try {
      manifest = await manifestOf(s.hub, lease.manifest, signal);
    } catch (error) {
      lost();
      throw error;
    }
    if (cached) {
      try {
        await this.#verify(manifest, paths, signal, true);
        await touchSlice(paths);
        return true;
      } catch (error) {
        lost();
        if (!(error instanceof GgufError)) throw error;
        this.#emit({
          event: "corrupt",
          error: error.message,
          ...slabOf(error),
          attempt: 0,
          maxAttempts: s.maxVerifyAttempts,
          reused: true,
        });
        await removeSlice(paths);
      }
    }
    await mkdir(paths.dir, { recursive: true });
    if (s.cacheMaxBytes !== undefined) {
      const keep = new Set(this.#held.map((h) => slicePaths(s.cacheDir, h.model, h.layers, h.experts).path));
      keep.add(paths.path);
      const pruned = await pruneSliceCache(s.cacheDir, {
        maxBytes: s.cacheMaxBytes,
        incomingBytes: lease.bytes,
        keep,
      });
      if (pruned.removed.length > 0 || !pruned.fits) {
        this.#emit({
          event: "cache-pruned",
          removed: pruned.removed,
          cacheBytes: pruned.bytes,
          incomingBytes: lease.bytes,
          maxBytes: s.cacheMaxBytes,
          fits: pruned.fits,
        });
      }
    }
    for (let attempt = 1; ; attempt++) {
      const url = s.hub.resolve(lease.url);
      let lastProgress = 0;
      let started = false;
      const t0 = performance.now();
      let result: Awaited<ReturnType<typeof downloadResumable>>;
      try {
        result = await downloadResumable(url, paths.path, {
          signal,
          client: s.hub,
          headers: await s.hub.authHeader(),
          ...s.download,
          onResponse: ({ offset, total }) => {
            if (started) return;
            started = true;
            this.#emit({ event: "download-start", url: url.href, bytes: total, resumeFrom: offset });
          },
          onProgress: ({ received, total }) => {
            const now = performance.now();
            if (now - lastProgress < s.progressIntervalMs && received !== total) return;
            lastProgress = now;
            const secs = (now - t0) / 1000;
            this.#emit({
              event: "progress",
              received,
              total,
              bytesPerSecond: secs > 0 ? Math.round(received / secs) : 0,
            });
          },
          onRetry: ({ attempt: n, error, delayMs, received }) =>
            this.#emit({
              event: "download-retry",
              attempt: n,
              error: error.message,
              code: error.code,
              delayMs,
              received,
            }),
        });
      } catch (error) {
        lost();
        throw error;
      }
      const fresh = result.bytes - result.reusedBytes;
      this.#downloadedBytes += fresh;
      const bps = result.ms > 0 ? (fresh * 1000) / result.ms : 0;
      if (bps > 0) this.#bandwidthBps = bps;
      this.#emit({
        event: "downloaded",
        bytes: result.bytes,
        ms: result.ms,
        bytesPerSecond: Math.round(bps),
        requests: result.requests,
        resumes: result.resumes,
      });
      try {
        await this.#verify(manifest, paths, signal, false);
        await writeSliceMeta(paths, {
          model: lease.model,
          layers: lease.layers,
          experts: lease.experts,
          fileBytes: result.bytes,
          etag: result.etag,
          sourceSha256: manifest.source.headerSha256,
          savedAt: Date.now(),
          lease: { leaseId: lease.leaseId, expiresAt: keeper.lease.expiresAt, hub: s.hub.base.href },
        });
        return false;
      } catch (error) {
        lost();
        if (!(error instanceof GgufError)) throw error;
        this.#emit({
          event: "corrupt",
          error: error.message,
          ...slabOf(error),
          attempt,
          maxAttempts: s.maxVerifyAttempts,
          reused: false,
        });
        await removeSlice(paths);
        if (attempt >= s.maxVerifyAttempts) {
          throw new GgufError(
            "MOESWARM_SLICE_MISMATCH",
            `the slice failed verification ${attempt} times (last: ${error.message})`,
            { cause: error, details: { ...error.details, url: url.href, attempts: attempt } },
          );
        }
      }
    }
  }

  async #verify(
    manifest: SliceManifest,
    paths: SlicePaths,
    signal: AbortSignal,
    reused: boolean,
  ): Promise<void> {
    const t0 = performance.now();
    const v = await verifySlice(paths.path, manifest, { signal });
    this.#emit({ event: "verified", slabs: v.slabs, bytes: v.bytes, ms: performance.now() - t0, reused });
  }

  // --- serving ----------------------------------------------------------------------------------

  /** Loads an acquired slice, connects (the first time), registers it and serves it. */
  async #add(a: Acquired): Promise<void> {
    const s = this.#s;
    const stop = this.#stop.signal;
    const model = a.lease.model;
    const t0 = performance.now();
    const compute = await loadExpertCompute(a.paths.path, {
      backend: s.backend,
      ...(s.threads !== undefined ? { threads: s.threads } : {}),
      signal: stop,
    });
    let router: SliceRouter | undefined;
    try {
      const info = compute.info;
      const backend = info.device === "llama-cpu" ? "llama-cpu" : info.backend;
      this.#emit({
        event: "loaded",
        backend,
        cpu: info.cpu,
        threads: info.threads,
        device: info.device,
        fallback:
          info.backend === "ts" && s.backend === "auto"
            ? (nativeStatus()?.message?.split("\n")[0] ?? "the native addon did not load")
            : undefined,
        ms: performance.now() - t0,
      });
      this.#conn ??= await this.#connect();
      if (stop.aborted) throw abortReason(stop);
      router = this.#routers.get(model);
      if (!router) {
        router = new SliceRouter(model);
        this.#routers.set(model, router);
      }
      // dispatches may reach it as soon as the relay has the registration
      router.add({ layers: a.layers, experts: a.experts, compute });
      this.#conn.register({
        model,
        layers: rangeValues(a.layers),
        experts: rangeValues(a.experts),
        capacity: s.capacityBytes,
        backend,
      });
    } catch (error) {
      router?.remove(compute);
      await compute.close().catch(() => {});
      throw error;
    }
    // the registration fulfils the lease on the hub: nothing left to renew
    a.keeper.stop();
    this.#held.push({
      model,
      layers: a.layers,
      experts: a.experts,
      bytes: a.lease.bytes,
      compute,
      summary: {
        model,
        layers: a.lease.layers,
        experts: a.lease.experts,
        path: a.paths.path,
        reused: a.reused,
      },
    });
    this.#emit({
      event: "registered",
      model,
      layers: a.lease.layers,
      experts: a.lease.experts,
      cells: (a.layers.end - a.layers.start) * (a.experts.end - a.experts.start),
      slices: this.#held.length,
      bytes: this.#s.capacityBytes - this.#capacityLeft(),
      capacityBytes: this.#s.capacityBytes,
    });
    if (this.#held.length === 1) this.#emit({ event: "serving" });
  }

  /** Connects to the relay, retrying transient failures until it works or the worker stops. */
  async #connect(): Promise<RelayConnection> {
    const s = this.#s;
    const stop = this.#stop.signal;
    for (let attempt = 1; ; attempt++) {
      // aborting connectRelay's signal closes the connection, and a drain must not: this one
      // only aborts while connecting
      const connecting = new AbortController();
      const onStop = () => connecting.abort(abortReason(stop));
      stop.addEventListener("abort", onStop, { once: true });
      if (stop.aborted) onStop();
      try {
        const conn = await connectRelay(s.relay, {
          role: "worker",
          id: s.id,
          token: s.token,
          ...(s.hub.ca !== undefined ? { ca: s.hub.ca } : {}),
          ...(s.heartbeatMs !== undefined ? { heartbeatMs: s.heartbeatMs } : {}),
          signal: connecting.signal,
          onDispatch: (req) => this.#onDispatch(req),
          // the hub takes this worker out of service: drain as on a signal
          onDrain: (reason) => this.#requestStop("drain", `the hub asked${reason ? `: ${reason}` : ""}`),
        });
        this.#emit({ event: "connected", url: s.relay });
        conn.on((e) => {
          if (e.type === "drain") return; // onDrain has it
          if (e.type === "notice") {
            this.#emit({ event: "relay", state: "notice", error: `${e.error.code}: ${e.error.message}` });
            return;
          }
          if (e.state === "closed") {
            if (!stop.aborted) {
              this.#fatal =
                e.error && isMoeswarmError(e.error)
                  ? e.error
                  : new TransportError(
                      "MOESWARM_TRANSPORT_CLOSED",
                      `the relay connection closed${e.error ? `: ${e.error.message}` : ""}`,
                    );
              this.#emit({ event: "relay", state: "closed", error: this.#fatal.message });
              this.#requestStop("signal", "relay connection closed");
            }
            return;
          }
          this.#emit({
            event: "relay",
            state: e.state,
            attempt: e.attempt,
            delayMs: e.delayMs,
            error: e.error ? message(e.error) : undefined,
          });
        });
        return conn;
      } catch (error) {
        if (stop.aborted) throw abortReason(stop);
        if (error instanceof AuthError || !isTransient(error)) throw error;
        const retryInMs = Math.min(30_000, 500 * 2 ** Math.min(attempt - 1, 10));
        this.#emit({ event: "hub-unreachable", error: message(error), code: codeOf(error), retryInMs });
        await sleep(jitter(retryInMs), stop);
      } finally {
        stop.removeEventListener("abort", onStop);
      }
    }
  }

  async #onDispatch(req: IncomingDispatch) {
    if (this.#draining) {
      throw new TransportError("MOESWARM_TRANSPORT_DRAINING", `worker ${this.#s.id} is draining`);
    }
    this.#inFlight++;
    try {
      const router = this.#routers.get(req.model);
      if (!router || router.size === 0) {
        throw new InvalidArgumentError(
          "MOESWARM_INVALID_ARGUMENT",
          `model ${req.model} is not served here (${[...this.#routers.keys()].join(", ") || "nothing yet"})`,
        );
      }
      if (req.embd !== router.nEmbd) {
        throw new InvalidArgumentError(
          "MOESWARM_INVALID_ARGUMENT",
          `embd ${req.embd} does not match the slice's n_embd ${router.nEmbd}`,
        );
      }
      const t0 = performance.now();
      traceHop("worker.run", req.layer);
      // layer and expert ids are checked against the slices (InvalidArgumentError)
      const y = await router.run(
        {
          layer: req.layer,
          x: req.activations(),
          ids: req.ids,
          k: req.k,
          ...(req.w ? { w: req.w } : {}),
          mode: req.mode,
        },
        { signal: req.signal },
      );
      traceHop("worker.ran", req.layer);
      this.#requests++;
      this.#tokens += req.n;
      return { y, ms: performance.now() - t0 };
    } catch (error) {
      this.#failed++;
      this.#dispatchErrors++;
      // a hostile or confused backbone must not flood the log: the first ten, then every hundredth
      if (this.#dispatchErrors <= 10 || this.#dispatchErrors % 100 === 0) {
        this.#emit({
          event: "dispatch-error",
          error: message(error),
          code: codeOf(error),
          layer: req.layer,
          from: req.from,
        });
      }
      throw error;
    } finally {
      this.#inFlight--;
      if (this.#inFlight === 0) for (const w of this.#idleWaiters.splice(0)) w();
    }
  }

  async #drain(conn: RelayConnection): Promise<WorkerSummary> {
    const t0 = performance.now();
    this.#draining = true;
    this.#emit({ event: "drain", reason: this.#drainReason, inFlight: this.#inFlight });
    try {
      // withdraws every registration on the relay
      conn.drain(this.#drainReason);
    } catch {
      // the connection is down: nothing to tell the relay
    }
    let abandoned = 0;
    if (this.#inFlight > 0) {
      const idle = new Promise<void>((resolve) => this.#idleWaiters.push(resolve));
      const timedOut = !(await Promise.race([
        idle.then(() => true),
        sleep(this.#s.drainTimeoutMs).then(() => false),
      ]));
      if (timedOut) abandoned = this.#inFlight;
    }
    await conn.close();
    this.#emit({
      event: "drained",
      requests: this.#requests,
      tokens: this.#tokens,
      failed: this.#failed,
      inFlightAbandoned: abandoned,
      slices: this.#held.length,
      ms: performance.now() - t0,
    });
    return this.#summary({ served: true });
  }
}

function slabOf(error: GgufError): { layer?: number; expert?: number; tensor?: string } {
  const d = error.details ?? {};
  return {
    ...(typeof d.layer === "number" ? { layer: d.layer } : {}),
    ...(typeof d.expert === "number" ? { expert: d.expert } : {}),
    ...(typeof d.tensor === "string" ? { tensor: d.tensor } : {}),
  };
}

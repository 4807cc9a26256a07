import { mkdir } from "node:fs/promises";
import {
  abortReason,
  frameAllocatorState,
  isMoeswarmError,
  type LeaseJson,
  type MoeswarmError,
  onAbort,
  parseRange,
  type Range,
  sleep,
  TransportError,
} from "@moeswarm/core";
import { isTransient, type RelayConnection } from "@moeswarm/relay-client";
import { type ExpertCompute, loadExpertCompute, nativeStatus } from "@moeswarm/worker-native";
import { chooseSlices, type SliceChoice, type SliceRect } from "./choose.js";
import { Claims } from "./claims.js";
import { computeClassOf, wireDtypesOf } from "./compute-class.js";
import type { WorkerEvent, WorkerEventBody } from "./events.js";
import { type FetchContext, fetchSlice, LeaseLost } from "./fetch-slice.js";
import { LeaseKeeper } from "./lease-keeper.js";
import {
  type RunWorkerOptions,
  type Settings,
  settings,
  type WorkerSliceSummary,
  type WorkerSummary,
} from "./options.js";
import { RunPause } from "./pause.js";
import { codeOf, jitter, message, rangeValues } from "./run-helpers.js";
import { Serving } from "./serving.js";
import { listCachedSlices, type SlicePaths, slicePaths } from "./slice-cache.js";
import { SliceRouter } from "./slice-router.js";

export type { RunWorkerOptions, WorkerSliceSummary, WorkerSummary } from "./options.js";

/** A lease whose slice is on disk and verified. */
interface Acquired {
  lease: LeaseJson;
  keeper: LeaseKeeper;
  layers: Range;
  experts: Range;
  paths: SlicePaths;
  reused: boolean;
}

/** The acquire loop's pacing between polls and claims. */
interface PollState {
  lastIdle: string;
  quickRetries: number;
  hubFailures: number;
  /** When the demand's best choice became part of a layer (a top-up fragment), for the grace. */
  fragmentSince?: number | undefined;
}

/**
 * How long a worker that already serves a slice lets the demand's best choice be part of a layer
 * (a fragment, for the room it has left) before it claims it. Workers that start together race:
 * the first to finish its first download would top up with a fragment of layers that a slower
 * worker is about to claim whole (its claim was refused a moment ago; it reads the demand again
 * within ~300 ms, up to 5 times), and every token's layer would then cost two requests. Whole
 * layers, and a worker's first slice, are claimed at once.
 */
const FRAGMENT_GRACE_MS = 2000;

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
  #fatal: MoeswarmError | undefined;
  /** The slices served, in the order registered. */
  readonly #held: Held[] = [];
  #conn: RelayConnection | undefined;
  readonly #claims: Claims;
  readonly #serving: Serving;
  readonly #pause: RunPause;

  constructor(s: Settings, signal: AbortSignal | undefined, log: ((event: WorkerEvent) => void) | undefined) {
    this.#s = s;
    this.#userSignal = signal;
    this.#log = log;
    this.#claims = new Claims({
      s,
      emit: (body) => this.#emit(body),
      stop: this.#stop.signal,
      heldRects: () => this.#heldRects(),
      bandwidthBps: () => this.#bandwidthBps,
    });
    this.#pause = new RunPause({
      s,
      emit: (body) => {
        this.#emit(body);
        // the native listener serves nothing while paused (the relay path is left to the hub)
        if (body.event === "paused" || body.event === "resumed") this.#serving.nativeRoutes();
      },
      stop: this.#stop.signal,
    });
    this.#serving = new Serving({
      s,
      emit: (body) => this.#emit(body),
      stop: this.#stop.signal,
      requestStop: (reason, text) => this.#requestStop(reason, text),
      fatal: (error) => {
        this.#fatal = error;
      },
      onNotice: (code, msg) => this.#pause.onNotice(code, msg),
      onReconnect: () => this.#pause.onReconnect(),
      paused: () => this.#pause.paused,
    });
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
      requests: this.#serving.requests,
      tokens: this.#serving.tokens,
      failed: this.#serving.failed,
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

  #fetchContext(): FetchContext {
    return {
      s: this.#s,
      emit: (body) => this.#emit(body),
      stop: this.#stop.signal,
      servedPaths: () =>
        this.#held.map((h) => slicePaths(this.#s.cacheDir, h.model, h.layers, h.experts).path),
      downloaded: (fresh, bps) => {
        this.#downloadedBytes += fresh;
        if (bps > 0) this.#bandwidthBps = bps;
      },
    };
  }

  #heldRects(): SliceRect[] {
    return this.#held.map((h) => ({ model: h.model, layers: h.layers, experts: h.experts }));
  }

  async run(): Promise<WorkerSummary> {
    const s = this.#s;
    const stopOnAbort = () => {
      const why = this.#userSignal?.reason;
      this.#requestStop("signal", typeof why === "string" && why.length <= 64 ? why : "stop requested");
    };
    // already aborted: stop before the first claim, not a microtask later
    if (this.#userSignal?.aborted) stopOnAbort();
    const userStop = onAbort(this.#userSignal, stopOnAbort);
    try {
      this.#emit({
        event: "start",
        id: s.id,
        hub: s.hub.base.href,
        capacityBytes: s.capacityBytes,
        cacheDir: s.cacheDir,
        backend: s.backend,
        malloc: frameAllocatorState(),
      });
      await mkdir(s.cacheDir, { recursive: true });
      this.#pause.start();
      await this.#grow();
      if (this.#fatal) throw this.#fatal;
      if (!this.#conn || this.#held.length === 0) {
        this.#emit({ event: "stopped", reason: this.#drainReason });
        return this.#summary();
      }
      await this.#serving.drain(this.#conn, this.#drainReason, this.#held.length);
      return this.#summary({ served: true });
    } catch (error) {
      this.#emit({ event: "error", error: message(error), code: codeOf(error) });
      throw error;
    } finally {
      userStop[Symbol.dispose]();
      this.#pause.stop();
      await this.#conn?.close();
      await this.#serving.closeDirect();
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
        await this.#claims.release(acquired.lease);
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
    await new Promise<void>((resolve) => onAbort(stop, () => resolve()));
  }

  // --- finding, claiming and fetching a slice -------------------------------------------------

  async #acquire(): Promise<Acquired> {
    const s = this.#s;
    const stop = this.#stop.signal;
    const poll: PollState = { lastIdle: "", quickRetries: 0, hubFailures: 0 };
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
      if (this.#pause.paused) {
        // paused (by the hub, or its battery or heat): nothing new is claimed or downloaded
        await this.#pause.whenResumed();
        continue;
      }
      const claimed = await this.#claimNext(poll);
      if (!claimed) continue;
      poll.lastIdle = "";
      poll.quickRetries = 0;
      poll.fragmentSince = undefined;
      const acquired = await this.#fetchClaimed(claimed.lease, claimed.value);
      if (acquired) return acquired;
    }
  }

  /** Whether to leave `chosen` (a fragment, as a top-up) to other workers a while longer. */
  #fragmentWaits(poll: PollState, chosen: SliceChoice | undefined): boolean {
    if (this.#held.length === 0 || chosen === undefined || chosen.whole) {
      poll.fragmentSince = undefined;
      return false;
    }
    poll.fragmentSince ??= performance.now();
    return performance.now() - poll.fragmentSince < FRAGMENT_GRACE_MS;
  }

  /**
   * One claim: a cached slice, else the demand's best fit for the room left. Undefined after
   * waiting (nothing fits, the claim was refused, the hub is unreachable): try again.
   */
  async #claimNext(poll: PollState): Promise<{ lease: LeaseJson; value: number | undefined } | undefined> {
    const s = this.#s;
    const stop = this.#stop.signal;
    let value: number | undefined;
    let lease: LeaseJson | undefined;
    try {
      // the demand's best fit for the room left; its bytes from the cache when they are there
      const left = this.#capacityLeft();
      const demand = await s.hub.demand({ model: s.model, signal: stop });
      const ranges = demand.ranges.filter((r) => s.model === undefined || r.model === s.model);
      const choices = chooseSlices(ranges, left, { limit: 64, exclude: this.#heldRects() });
      poll.hubFailures = 0;
      const choice = await this.#claims.pick(choices);
      if (!choice) {
        const idle = ranges.length === 0 ? "covered" : `no-fit:${ranges.length}`;
        if (idle !== poll.lastIdle) {
          this.#emit({
            event: "idle",
            reason: ranges.length === 0 ? "covered" : "no-fit",
            ranges: ranges.length,
            capacityBytes: left,
            pollMs: s.pollMs,
            ...(this.#held.length > 0 ? { heldBytes: s.capacityBytes - left } : {}),
          });
          poll.lastIdle = idle;
        }
        await sleep(jitter(s.pollMs), stop);
        return undefined;
      }
      value = choice.value;
      const chosen = choices.find(
        (c) =>
          c.model === choice.model &&
          c.layers.start === choice.layers.start &&
          c.layers.end === choice.layers.end &&
          c.experts.start === choice.experts.start &&
          c.experts.end === choice.experts.end,
      );
      if (this.#fragmentWaits(poll, chosen)) {
        await sleep(Math.min(jitter(s.pollMs), FRAGMENT_GRACE_MS / 4), stop);
        return undefined;
      }
      if (chosen) {
        this.#emit({
          event: "demand",
          ranges: ranges.length,
          cells: ranges.reduce((n, r) => n + r.count, 0),
          rangeBytes: ranges.reduce((n, r) => n + r.bytes, 0),
          model: chosen.model,
          layers: `${chosen.layers.start}:${chosen.layers.end}`,
          experts: `${chosen.experts.start}:${chosen.experts.end}`,
          value: chosen.value,
          bytes: chosen.bytes,
          capacityBytes: left,
        });
      }
      lease = await this.#claims.tryClaim(choice.model, choice.layers, choice.experts);
      if (!lease) {
        // another worker took it first: the demand has changed, read it again soon
        poll.quickRetries++;
        const pause = poll.quickRetries < 5 ? 50 + Math.random() * 250 : jitter(s.pollMs);
        if (poll.quickRetries >= 5) poll.quickRetries = 0;
        await sleep(pause, stop);
        return undefined;
      }
    } catch (error) {
      if (stop.aborted) throw abortReason(stop);
      if (!isTransient(error)) throw error;
      poll.hubFailures++;
      const retryInMs = Math.min(s.pollMs, 30_000, 500 * 2 ** Math.min(poll.hubFailures - 1, 10));
      this.#emit({ event: "hub-unreachable", error: message(error), code: codeOf(error), retryInMs });
      await sleep(jitter(retryInMs), stop);
      return undefined;
    }
    return { lease, value };
  }

  /** Fetches a claimed slice while keeping its lease; undefined when it is to be claimed anew. */
  async #fetchClaimed(lease: LeaseJson, value: number | undefined): Promise<Acquired | undefined> {
    const s = this.#s;
    const stop = this.#stop.signal;
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
      const reused = await fetchSlice(this.#fetchContext(), lease, keeper, paths, cached);
      return { lease, keeper, layers, experts, paths, reused };
    } catch (error) {
      keeper.stop();
      if (stop.aborted) {
        await this.#claims.release(lease);
        throw abortReason(stop);
      }
      if (error instanceof LeaseLost) return undefined;
      await this.#claims.release(lease);
      if (isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND")) {
        // the model left the hub while we fetched it: pick again
        this.#emit({ event: "lease-lost", leaseId: lease.leaseId, error: message(error) });
        return undefined;
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
        return undefined;
      }
      throw error;
    }
  }

  // --- serving ----------------------------------------------------------------------------------

  /** Loads an acquired slice, connects (the first time), registers it and serves it. */
  async #add(a: Acquired): Promise<void> {
    const s = this.#s;
    const stop = this.#stop.signal;
    const model = a.lease.model;
    const t0 = performance.now();
    const loaded = await loadExpertCompute(a.paths.path, {
      backend: s.backend,
      ...(s.threads !== undefined ? { threads: s.threads } : {}),
      ...(s.maxBatchRows !== undefined ? { maxBatchRows: s.maxBatchRows } : {}),
      signal: stop,
    });
    const compute = s.wrapCompute ? s.wrapCompute(loaded) : loaded;
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
      // the first slice's compute says what the hello advertises (one backend per run)
      this.#conn ??= await this.#serving.connect(wireDtypesOf(info));
      if (stop.aborted) throw abortReason(stop);
      router = this.#serving.routers.get(model);
      if (!router) {
        router = new SliceRouter(model);
        this.#serving.routers.set(model, router);
      }
      // dispatches may reach it as soon as the relay has the registration
      router.add({ layers: a.layers, experts: a.experts, compute });
      this.#serving.nativeRoutes();
      this.#conn.register({
        model,
        layers: rangeValues(a.layers),
        experts: rangeValues(a.experts),
        capacity: s.capacityBytes,
        backend: computeClassOf(backend, info),
      });
    } catch (error) {
      router?.remove(compute);
      this.#serving.nativeRoutes();
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
}

// The hub: the expert-shard HTTP API, the relay and the coverage market behind one handle.
// Options are checked in hub-options.ts, models live in hub-models.ts, the routes in routes/,
// and the hub's own server in hub-server.ts; this file wires them and answers the public API.
import type { Server as HttpServer, IncomingMessage, ServerResponse } from "node:http";
import type { Server as HttpsServer } from "node:https";
import { formatRange, HubError, InvalidArgumentError, toRanges } from "@moeswarm/core";
import type { ExpertSlice } from "@moeswarm/shard";
import type { ConnectionGuard } from "./connection-guard.js";
import { DirectKeys } from "./direct.js";
import { Enrolment, openEnrolStore } from "./enrolment.js";
import { sendError } from "./http-errors.js";
import { ModelRegistry } from "./hub-models.js";
import { type HubConfig, openHubStore, readHubOptions, type Settings } from "./hub-options.js";
import { bindServer, checkListenAddress, createHubServer } from "./hub-server.js";
import type { Hub, HubEvent, HubListener, HubOptions, HubStatus } from "./hub-types.js";
import type { CoverageMarket } from "./market.js";
import { MarketBook } from "./market-book.js";
import type { MarketHttpContext } from "./market-http.js";
import { HubMetrics, type RouteLabel } from "./metrics.js";
import type { ModelInfo } from "./model.js";
import {
  createRelay,
  type Relay,
  type RelayOptions,
  type RelayServerEvent,
  type SliceInfo,
} from "./relay.js";
import { bannedError, Reputation } from "./reputation.js";
import { authorize, type RouteContext } from "./routes/context.js";
import { matchRoute, serveRoute } from "./routes/table.js";
import type { HubStore } from "./store.js";
import { type DirectStore, openDirectStore } from "./store-direct.js";
import { openPauseStore, type PauseStore } from "./store-pauses.js";
import { openReportStore, type QuarantineEvidence, type QuarantineRecord } from "./store-reports.js";
import { type HubWorkerInfo, WorkerBook } from "./worker-book.js";
import { WorkerPauses } from "./worker-pause.js";

/** `(req, res) => boolean`: the hub's HTTP API as a handler for an embedder's own server. */
export function createHubHandler(hub: Hub): (req: IncomingMessage, res: ServerResponse) => boolean {
  return (req, res) => hub.handleRequest(req, res);
}

/**
 * Creates the hub: the expert-shard HTTP API, the relay and the registry of models and workers.
 * Models load in the background (`ready`); `listen()` waits for them. Options are checked now
 * (InvalidArgumentError); a SQLite path that cannot be opened throws HubError MOESWARM_HUB_STORE.
 */
export function createHub(options: HubOptions): Hub {
  if (typeof options !== "object" || options === null) {
    throw new InvalidArgumentError("createHub needs an options object");
  }
  return new HubImpl(options);
}

const noop = () => {};
const API_ROOT = "/api";

type LeaseAction = Extract<HubEvent, { type: "lease" }>["action"];

class HubImpl implements Hub {
  readonly relay: Relay;
  readonly store: HubStore;
  readonly metrics: HubMetrics;
  readonly market: CoverageMarket;
  readonly ready: Promise<void>;
  readonly handleUpgrade: Relay["handleUpgrade"];
  listener: HubListener | undefined;
  readonly #s: Settings;
  readonly #ownsStore: boolean;
  readonly #models: ModelRegistry;
  readonly #book: WorkerBook;
  /** The direct-link ticket key, and the pairs it admitted (routes and credits both ask). */
  readonly #directKeys = new DirectKeys();
  readonly #marketBook: MarketBook;
  readonly #routes: RouteContext;
  readonly #reputation: Reputation;
  readonly #enrolment: Enrolment;
  /** Direct credits' unmatched halves and the ticketed pairs, across restarts. */
  readonly #directStore: DirectStore;
  readonly #pauses: WorkerPauses;
  readonly #inflight = new Set<Promise<void>>();
  readonly #downloads = new Set<AbortController>();
  readonly #persistTimer: ReturnType<typeof setInterval>;
  #server: HttpServer | HttpsServer | undefined;
  #guard: ConnectionGuard | undefined;
  #closing: Promise<void> | undefined;

  constructor(options: HubOptions) {
    const config = readHubOptions(options);
    this.#s = config.settings;
    this.relay = createRelay(this.#relayOptions(options.relay));
    this.handleUpgrade = (req, socket, head) => this.relay.handleUpgrade(req, socket, head);
    try {
      ({ store: this.store, owned: this.#ownsStore } = openHubStore(options.store, options.sqliteDriver));
    } catch (error) {
      void this.relay.close();
      throw error;
    }
    let pauseStore: PauseStore;
    try {
      pauseStore = openPauseStore(options.store, this.store);
      this.#reputation = new Reputation({
        reports: openReportStore(options.store, this.store),
        clock: config.clock,
      });
      this.#enrolment = new Enrolment({
        store: openEnrolStore(options.store, this.store),
        secret: this.#s.secret,
        clock: config.clock,
        limits: this.#s.enrolment,
      });
      this.#directStore = openDirectStore(options.store, this.store);
    } catch (error) {
      void this.relay.close();
      if (this.#ownsStore) void this.store.close();
      throw error;
    }
    this.metrics = this.#createMetrics(options.defaultMetrics === true);
    this.#book = new WorkerBook({
      store: this.store,
      relay: () => this.relay,
      forgetAfterMs: config.forgetMs,
      onStoreError: (error) => this.#storeError(error),
      onForget: (forgotten) => this.#pauses.forgotten(forgotten),
    });
    try {
      this.#marketBook = this.#createMarketBook(config);
    } catch (error) {
      void this.relay.close();
      if (this.#ownsStore) void this.store.close();
      throw error;
    }
    this.market = this.#marketBook.market;
    this.#pauses = new WorkerPauses({
      store: pauseStore,
      setPaused: (id, paused) => this.#marketBook.setPaused(id, paused),
      notice: (id, code, msg) => this.relay.notice(id, code, msg),
      clock: config.clock,
      retentionMs: config.pauseRetentionMs,
      seen: (id) => this.#book.seen(id),
      emit: (e) => this.#emit({ type: "pause", ...e }),
      dropped: (reason) => this.metrics.pauseDropped(reason),
    });
    this.#models = new ModelRegistry({
      settings: this.#s,
      store: this.store,
      marketBook: this.#marketBook,
      metrics: this.metrics,
      emit: (event) => this.#emit(event),
      closing: () => this.#closing !== undefined,
    });
    this.#routes = this.#routeContext();
    this.#persistTimer = setInterval(() => {
      void this.#book.flush();
      void this.#marketBook.flush();
      this.#pauses.sweep().catch((error) => this.#storeError(error));
    }, config.persistMs);
    this.#persistTimer.unref?.();

    this.ready = this.#load(config.configured);
    this.ready.catch(noop); // observed by listen() or the embedder; never an unhandled rejection
  }

  /** The relay's options: the hub's secret, and an event hook that feeds the hub's parts, then the embedder's. */
  #relayOptions(relay: Omit<RelayOptions, "secret"> | undefined): RelayOptions {
    const userRelayEvent = relay?.onEvent;
    // made once: the hook runs for every answer the relay forwards (its `routed` event)
    const observers: ReadonlyArray<(event: RelayServerEvent) => void> = [
      (event) => this.metrics.relayEvent(event),
      (event) => {
        if (event.type === "connect") this.#guard?.authenticated(event.remote);
      },
      (event) => this.#book.onRelayEvent(event),
      (event) => this.#marketBook.onRelayEvent(event),
      (event) => this.#pauses.onRelayEvent(event),
      (event) => this.#emit({ type: "relay", event }),
      (event) => userRelayEvent?.(event),
    ];
    return {
      ...relay,
      secret: this.#s.secret,
      allowUnboundTokens: this.#s.allowUnboundTokens,
      admitHello: (role, id) => (role === "worker" ? this.#banned(id) : undefined),
      admitRegister: (worker, slice) => this.#admitRegister(worker, slice),
      onForward: (forward) => this.#marketBook.ledger.forward(forward),
      onEvent: (event) => {
        for (const observe of observers) {
          try {
            observe(event);
          } catch {
            // one observer's failure must not keep the event from the others
          }
        }
      },
    };
  }

  #banned(worker: string): { code: string; message: string } | undefined {
    return this.#reputation.isQuarantined(worker) ? bannedError(worker) : undefined;
  }

  /** A register is accepted only for a slice a live lease of the worker covers (README "Claims"). */
  #admitRegister(worker: string, slice: SliceInfo): { code: string; message: string } | undefined {
    const banned = this.#banned(worker);
    if (banned || !this.#s.requireLeases) return banned;
    if (this.market.covers(worker, slice.model, slice.layers, slice.experts, this.#marketBook.now())) {
      return undefined;
    }
    return {
      code: "MOESWARM_HUB_NO_LEASE",
      message:
        `no live lease of worker ${worker} covers this slice of ${slice.model}: claim it first ` +
        "(POST /api/claims or /api/claims/auto), then register what the lease grants",
    };
  }

  /** Withdraws the registrations of a worker that no live lease covers any more (a lease ended). */
  #reconcile(worker: string): void {
    if (!this.#s.requireLeases) return;
    const now = this.#marketBook.now();
    this.relay.withdrawSlices(
      worker,
      (s) => this.market.covers(worker, s.model, s.layers, s.experts, now),
      "MOESWARM_HUB_NO_LEASE",
      "the lease that covered it ended",
    );
  }

  /** Records a quarantine, then applies it: leases end, registrations go, the connection closes. */
  async #quarantine(
    backbone: string,
    model: string,
    evidence: QuarantineEvidence,
  ): Promise<QuarantineRecord> {
    const record = await this.#reputation.quarantine(backbone, model, evidence);
    // a banned owner enrols again only with a code the operator issues after the ban
    await this.#enrolment.revokeFor(record.worker, this.market.ownerOf(record.worker));
    await this.#pauses.revoke(record.worker).catch((error) => this.#storeError(error));
    const leases = this.market.revokeWorker(record.worker);
    if (leases.length > 0) {
      await this.#marketBook.flush();
    }
    this.relay.disconnect(record.worker, "MOESWARM_HUB_BANNED", bannedError(record.worker).message);
    this.#reconcile(record.worker);
    this.#emit({
      type: "quarantine",
      worker: record.worker,
      by: record.by,
      model: record.model,
      reason: record.evidence.reason,
    });
    return record;
  }

  #createMetrics(defaultMetrics: boolean): HubMetrics {
    return new HubMetrics(
      {
        relay: this.relay,
        models: () => this.#models.size,
        workersKnown: () => this.#book.size,
        unlistedPauses: () => this.#pauses.unlisted().length,
        downloads: () => this.#downloads.size,
        connectionsRefused: () => this.#guard?.refused(),
        direct: () => this.#marketBook.direct.figures(),
        market: () => {
          const now = this.#marketBook.now();
          const served = this.#marketBook.servedSinceStart();
          return this.market.modelIds().map((model) => ({
            ...this.market.summary(model, now),
            tokensPerSecond: this.#marketBook.tokensPerSecond(model),
            expertTokensServed: served.get(model) ?? 0,
          }));
        },
      },
      { defaultMetrics },
    );
  }

  #createMarketBook(config: HubConfig): MarketBook {
    return new MarketBook({
      store: this.store,
      market: config.marketOptions,
      clock: config.clock,
      knownWorker: (id) => this.#book.has(id),
      statsStaleMs: config.statsStaleMs,
      trustReports: config.settings.trustReports,
      ticketed: (backbone, worker) => this.#directKeys.ticketed(backbone, worker),
      direct: { store: this.#directStore, pairs: this.#directKeys },
      onStoreError: (error) => this.#storeError(error),
      onLeaseEnd: (lease, why) => {
        this.metrics.leaseEnded(why);
        this.#emitLease(why, lease);
      },
    });
  }

  #routeContext(): RouteContext {
    const settings = this.#s;
    const directKeys = this.#directKeys;
    const marketHttp: MarketHttpContext = {
      book: this.#marketBook,
      metrics: this.metrics,
      authorize: (req, role) => {
        const claims = authorize(settings, req, role);
        // a quarantined worker id may not claim, renew or release
        if (
          claims.role === "worker" &&
          claims.id !== undefined &&
          this.#reputation.isQuarantined(claims.id)
        ) {
          throw bannedError(claims.id);
        }
        return claims;
      },
      checkRead: (req) => {
        if (!settings.publicReads) authorize(settings, req);
      },
      model: (id) => this.#models.marketModel(id),
      maxBodyBytes: settings.maxBodyBytes,
      maxStatsBytes: settings.maxStatsBytes,
      maxPollMs: settings.maxPollMs,
    };
    return {
      settings,
      store: this.store,
      metrics: this.metrics,
      relay: this.relay,
      models: this.#models,
      marketHttp,
      directKeys,
      downloads: this.#downloads,
      etags: new WeakMap<ExpertSlice, string>(),
      workers: () => this.workers(),
      status: (options) => this.status(options),
      // a direct link's requests never cross the relay: a ticket for the pair counts as a route
      forwardedTo: (backbone, worker) =>
        this.#marketBook.ledger.forwardedTo(backbone, worker) || directKeys.ticketed(backbone, worker),
      quarantine: (backbone, model, evidence) => this.#quarantine(backbone, model, evidence),
      reinstate: async (worker) => {
        const done = await this.#reputation.reinstate(worker);
        if (done) this.#emit({ type: "reinstate", worker });
        return done;
      },
      quarantines: () => this.#reputation.list(),
      enrol: (code, address) => this.#enrolment.redeem(code, address),
      issueEnrolCode: (o) => this.#enrolment.issue(o),
      emitLease: (action, lease) => this.#emitLease(action, lease),
      pauses: this.#pauses,
      workerOwner: async (id) => this.market.ownerOf(id) ?? (await this.#enrolment.ownerOf(id)),
    };
  }

  #storeError(error: unknown): void {
    this.metrics.storeError();
    this.#emit({ type: "store-error", error });
  }

  #emit(event: HubEvent): void {
    try {
      this.#s.onEvent?.(event);
    } catch {
      // the hook's problem, not the hub's
    }
  }

  #emitLease(
    action: LeaseAction,
    lease: {
      id: string;
      worker: string;
      model: string;
      layers: { start: number; end: number };
      experts: { start: number; end: number };
    },
  ): void {
    // a lease that ended (or was replaced by a new grant) may have been some registration's title
    if (action !== "renewed" && action !== "fulfilled") queueMicrotask(() => this.#reconcile(lease.worker));
    this.#emit({
      type: "lease",
      action,
      id: lease.id,
      worker: lease.worker,
      model: lease.model,
      layers: formatRange(lease.layers),
      experts: formatRange(lease.experts),
    });
  }

  async #load(configured: ReadonlyArray<{ id: string; path: string }>): Promise<void> {
    await this.#models.prepare();
    await this.#book.load();
    await this.#reputation.load();
    await this.#marketBook.load();
    await this.#pauses.load();
    await this.#pauses.sweep().catch((error) => this.#storeError(error));
    await this.#models.load(configured);
  }

  models(): ModelInfo[] {
    return this.#models.list();
  }

  workers(): HubWorkerInfo[] {
    return this.#book.list().map((w) => {
      const latency = this.#marketBook.latencyOf(w.id);
      const reported = this.#marketBook.reportedLatencyOf(w.id);
      const info: HubWorkerInfo = { ...w, credits: this.market.creditsOf(w.id) };
      const q = this.#reputation.get(w.id);
      if (q) info.quarantined = { at: q.at, by: q.by, model: q.model, reason: q.evidence.reason };
      const { hub, self } = this.#pauses.state(w.id);
      if (hub || self) info.paused = { ...(hub ? { hub } : {}), ...(self ? { self } : {}) };
      if (latency && latency.results > 0) info.latencyMs = latency.ms;
      if (reported !== undefined) info.reportedLatencyMs = reported;
      return info;
    });
  }

  status(options: { model?: string } = {}): HubStatus {
    const now = this.#marketBook.now();
    const ids = this.market.modelIds().filter((id) => options.model === undefined || id === options.model);
    const models = ids.map((id) => {
      const summary = this.market.summary(id, now);
      const { model: _m, layers, ...grid } = this.market.coverage(id, now);
      return {
        id,
        arch: this.#models.find(id)?.info.arch ?? null,
        layers,
        experts: Math.max(0, ...grid.nExpert),
        placementVersion: summary.version,
        cells: summary.cells,
        uncovered: summary.uncovered,
        belowTarget: summary.belowTarget,
        hot: summary.hot,
        leases: summary.leases,
        tokensPerSecond: this.#marketBook.tokensPerSecond(id),
        grid,
      };
    });
    const ranges = (values: readonly number[]) => toRanges(values).map(formatRange).join(",");
    const workers = this.workers().map((w) => {
      const out: HubStatus["workers"][number] = {
        id: w.id,
        live: w.live,
        draining: w.draining,
        slices: w.slices
          .filter((s) => options.model === undefined || s.model === options.model)
          .map((s) => ({ model: s.model, layers: ranges(s.layers), experts: ranges(s.experts) })),
        expertTokens: w.credits?.expertTokens ?? 0,
        quarantined: w.quarantined !== undefined,
      };
      const pause = w.paused?.hub ?? (w.paused?.self && { ...w.paused.self, by: "self" as const });
      if (pause) out.paused = pause;
      if (w.rttMs !== undefined) out.rttMs = w.rttMs;
      const latency = w.latencyMs ?? w.reportedLatencyMs;
      if (latency !== undefined) out.latencyMs = latency;
      if (w.inFlight !== undefined) out.inFlight = w.inFlight;
      return out;
    });
    return {
      time: now,
      tokensPerSecond: ids.reduce((sum, id) => sum + this.#marketBook.tokensPerSecond(id), 0),
      models,
      workers,
      leases: this.market.leases(options.model === undefined ? {} : { model: options.model }).map((l) => ({
        worker: l.worker,
        model: l.model,
        layers: formatRange(l.layers),
        experts: formatRange(l.experts),
        bytes: l.bytes,
        expiresAt: l.expiresAt,
      })),
      backbones: this.#marketBook.rates(options.model),
      unlistedPauses: this.#pauses.unlisted(),
    };
  }

  // --- HTTP -----------------------------------------------------------------------------------

  handleRequest(req: IncomingMessage, res: ServerResponse): boolean {
    return this.#handle(req, res, this.#s.dashboard === true);
  }

  #handle(req: IncomingMessage, res: ServerResponse, dashboard: boolean): boolean {
    const url = req.url ?? "/";
    const q = url.indexOf("?");
    const path = q < 0 ? url : url.slice(0, q);
    if (
      path !== "/metrics" &&
      path !== API_ROOT &&
      !path.startsWith(`${API_ROOT}/`) &&
      !(path === "/" && dashboard)
    ) {
      return false;
    }
    // #serve answers every failure itself; this catch is the last guard against a crash
    const task = this.#serve(req, res, path, q < 0 ? "" : url.slice(q + 1)).catch(() => {
      res.destroy();
    });
    this.#inflight.add(task);
    void task.finally(() => this.#inflight.delete(task));
    return true;
  }

  async #serve(req: IncomingMessage, res: ServerResponse, path: string, query: string): Promise<void> {
    const started = performance.now();
    const method = req.method ?? "GET";
    let route: RouteLabel = "other";
    try {
      if (this.#closing) throw new HubError("MOESWARM_HUB_INTERNAL", "the hub is shutting down");
      const match = matchRoute(path);
      route = match.label;
      // wait for the configured models (a failed load answers every request with its error)
      await this.ready;
      await serveRoute(this.#routes, match, req, res, query);
    } catch (error) {
      const status = sendError(res, error, method === "HEAD");
      if (status >= 500) {
        this.metrics.internalError(route);
        this.#emit({ type: "request-error", method, url: req.url ?? "", status, error });
      }
    } finally {
      this.metrics.request(route, method, res.statusCode, (performance.now() - started) / 1000);
    }
  }

  // --- server ---------------------------------------------------------------------------------

  async listen(port = 0, host = "127.0.0.1"): Promise<HubListener> {
    checkListenAddress(port, host);
    if (this.#server || this.#closing) {
      throw new InvalidArgumentError("this hub is already listening or closed");
    }
    const { server, guard } = createHubServer(
      this.#s.tls,
      this.relay,
      this.#s.limits,
      (req, res) => this.#handle(req, res, this.#s.dashboard !== false),
      this.#s.trustProxy,
    );
    this.#guard = guard;
    this.#server = server;
    await this.ready;
    this.listener = await bindServer(server, port, host, this.#s.tls !== undefined, this.relay.path);
    return this.listener;
  }

  close(): Promise<void> {
    this.#closing ??= (async () => {
      clearInterval(this.#persistTimer);
      this.#marketBook.stopWaiting();
      this.#models.abortLoads();
      const server = this.#server;
      const stopped = server?.listening
        ? new Promise<void>((done) => server.close(() => done()))
        : Promise.resolve();
      await this.relay.close();
      for (const download of this.#downloads) download.abort();
      server?.closeAllConnections();
      await Promise.allSettled([...this.#inflight, ...this.#models.pending()]);
      await this.ready.catch(noop);
      await this.#book.flush({ final: true });
      await this.#marketBook.close();
      await this.#directStore.close().catch(noop);
      await this.#models.closeAll();
      await this.#reputation.close().catch(noop);
      await this.#enrolment.close().catch(noop);
      await this.#pauses.close().catch(noop);
      if (this.#ownsStore) await this.store.close().catch(noop);
      await stopped;
    })();
    return this.#closing;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

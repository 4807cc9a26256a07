import { mkdir, realpath, stat } from "node:fs/promises";
import {
  createServer as createHttpServer,
  type Server as HttpServer,
  type IncomingMessage,
  type ServerResponse,
} from "node:http";
import { createServer as createHttpsServer, type Server as HttpsServer } from "node:https";
import type { AddressInfo } from "node:net";
import { isAbsolute, relative, resolve, sep } from "node:path";
import { pipeline } from "node:stream/promises";
import {
  formatRange,
  GgufError,
  HubError,
  InvalidArgumentError,
  isMoeswarmError,
  parseRange,
  toRanges,
} from "@moeswarm/core";
import type { ExpertSlice } from "@moeswarm/shard";
import { dashboardPage } from "./dashboard.js";
import { readJsonBody } from "./http-body.js";
import { badRequest, methodNotAllowed, notFound, publicError, sendError, sendJson } from "./http-errors.js";
import { ifRangeHolds, interpretRange, noneMatchHits } from "./http-range.js";
import type { CoverageGrid, CoverageMarket, MarketModel, MarketOptions } from "./market.js";
import { type BackboneRate, MarketBook } from "./market-book.js";
import {
  getDemand,
  getPlacement,
  leaseRoute,
  type MarketHttpContext,
  postClaim,
  postStats,
} from "./market-http.js";
import { HubMetrics, type RouteLabel } from "./metrics.js";
import { defaultModelId, type ModelInfo, ServedModel, sliceEtag } from "./model.js";
import { createRelay, type Relay, type RelayOptions, type RelayServerEvent } from "./relay.js";
import { createMemoryStore, type HubStore, isModelId } from "./store.js";
import { openSqliteStore } from "./store-sqlite.js";
import { checkSecret, type TokenClaims, type TokenRole, type TokenSecret, verifyToken } from "./token.js";
import { type HubWorkerInfo, WorkerBook } from "./worker-book.js";

export interface HubModelSource {
  /** The model id in URLs and frames (default: the file name without `.gguf`). */
  id?: string;
  /** The GGUF file. */
  path: string;
}

export interface HubOptions {
  /** HMAC secret(s) of the tokens: relay peers, and writes to the HTTP API (admin role). */
  secret: TokenSecret;
  /** Models served from the start (configuration: not written to the store). */
  models?: readonly HubModelSource[];
  /**
   * The directory `POST /api/models` may register files from (paths relative to it; nothing
   * outside it, symbolic links included). Without it the API takes no registrations.
   */
  modelDir?: string;
  /**
   * Where registered models and workers persist: a HubStore, or the path of a SQLite file
   * (`":memory:"` for none). Default: in this process's memory. A store passed in is the
   * caller's to close; one opened from a path is closed with the hub.
   */
  store?: HubStore | string;
  /** Options of the relay mounted on `/relay` (its secret is the hub's). */
  relay?: Omit<RelayOptions, "secret">;
  /** Serve https/wss with this certificate and key (PEM) from `listen()`. */
  tls?: { cert: string | Uint8Array; key: string | Uint8Array; ca?: string | Uint8Array };
  /** Reads (models, manifests, slices, workers, metrics) without a token (default true). */
  publicReads?: boolean;
  /** Where manifests are cached (default beside each model, `<file>.manifest.json`). */
  manifestDir?: string;
  /** Read size of slice streams (default 1 MiB). */
  chunkSize?: number;
  /** Slices kept planned per model (default 32). */
  sliceCacheSize?: number;
  /** A download whose client takes nothing for this long is cut (default 120000 ms). */
  idleTimeoutMs?: number;
  /** Largest request body (default 64 KiB). */
  maxBodyBytes?: number;
  /** How often workers' last-seen times are written (default 10000 ms). */
  persistIntervalMs?: number;
  /** Workers not seen for this long are forgotten (default 7 days). */
  forgetWorkersAfterMs?: number;
  /** Also export prom-client's process metrics (they live as long as the process; default false). */
  defaultMetrics?: boolean;
  /** The coverage market: demand decay, replica targets, values, leases (README "Demand"). */
  market?: HubMarketOptions;
  /**
   * The dashboard on `GET /`: the hub's own server (`listen()`) serves it unless this is false;
   * `handleRequest`/`createHubHandler` only when it is true (an embedder's `/` is its own).
   */
  dashboard?: boolean;
  /** Largest backbone stats report (default 4 MiB). */
  maxStatsBytes?: number;
  /** Longest wait of a placement long-poll (default 60000 ms). */
  maxPollMs?: number;
  /** The market's clock, unix ms (default Date.now; tests inject one). */
  clock?: () => number;
  /** Observability hook (logs); its exceptions are swallowed. */
  onEvent?: (event: HubEvent) => void;
}

export interface HubMarketOptions extends Omit<MarketOptions, "newId"> {
  /** A backbone report older than this no longer counts towards tokens/s (default 30000 ms). */
  statsStaleMs?: number;
}

/** What `GET /api/status` answers (the dashboard's data). */
export interface HubStatus {
  time: number;
  /** Tokens/s over all models, from fresh backbone reports. */
  tokensPerSecond: number;
  models: Array<{
    id: string;
    arch: string | null;
    layers: number[];
    experts: number;
    placementVersion: number;
    cells: number;
    uncovered: number;
    belowTarget: number;
    hot: number;
    leases: number;
    tokensPerSecond: number;
    grid: Omit<CoverageGrid, "model" | "layers">;
  }>;
  workers: Array<{
    id: string;
    live: boolean;
    draining: boolean;
    slices: Array<{ model: string; layers: string; experts: string }>;
    expertTokens: number;
    rttMs?: number;
    latencyMs?: number;
    inFlight?: number;
  }>;
  leases: Array<{
    worker: string;
    model: string;
    layers: string;
    experts: string;
    bytes: number;
    expiresAt: number;
  }>;
  backbones: BackboneRate[];
}

export type HubEvent =
  | { type: "model-loading"; id: string; path: string }
  | { type: "model-progress"; id: string; bytesDone: number; bytesTotal: number }
  | { type: "model-ready"; id: string; path: string; ms: number }
  | { type: "model-unavailable"; id: string; path: string; error: unknown }
  | { type: "model-removed"; id: string }
  | { type: "request-error"; method: string; url: string; status: number; error: unknown }
  | { type: "store-error"; error: unknown }
  | {
      type: "lease";
      action: "granted" | "renewed" | "released" | "expired" | "fulfilled";
      id: string;
      worker: string;
      model: string;
      layers: string;
      experts: string;
    }
  | { type: "relay"; event: RelayServerEvent };

export interface HubListener {
  readonly server: HttpServer | HttpsServer;
  readonly port: number;
  /** Base URL of the HTTP API, e.g. https://127.0.0.1:8443 */
  readonly url: string;
  /** The relay's URL, e.g. wss://127.0.0.1:8443/relay */
  readonly relayUrl: string;
}

export interface Hub extends AsyncDisposable {
  readonly relay: Relay;
  readonly store: HubStore;
  readonly metrics: HubMetrics;
  /** The coverage market (coverage, demand, leases, credits); the HTTP API is a thin layer over it. */
  readonly market: CoverageMarket;
  /** Resolves when the configured and stored models are loaded; rejects if a configured one fails. */
  readonly ready: Promise<void>;
  /** Set once `listen()` resolved. */
  readonly listener: HubListener | undefined;
  models(): ModelInfo[];
  workers(): HubWorkerInfo[];
  /** What the dashboard shows (`GET /api/status`). */
  status(options?: { model?: string }): HubStatus;
  /**
   * Answers a request to the hub's API (`/api/...`, `/metrics`, and `/` for the dashboard with
   * `dashboard: true`) and returns true, or returns false, touching nothing, for any other path
   * (the embedder's own routes).
   */
  handleRequest(req: IncomingMessage, res: ServerResponse): boolean;
  /** Takes the relay's WebSocket upgrade (`/relay`); false for any other path. */
  handleUpgrade: Relay["handleUpgrade"];
  /** One server for the API and the relay; plain http/ws, or https/wss with `tls`. */
  listen(port?: number, host?: string): Promise<HubListener>;
  /** Stops the server (when listening), the relay and downloads in flight, writes the store, closes files. */
  close(): Promise<void>;
}

/** `(req, res) => boolean`: the hub's HTTP API as a handler for an embedder's own server. */
export function createHubHandler(hub: Hub): (req: IncomingMessage, res: ServerResponse) => boolean {
  return (req, res) => hub.handleRequest(req, res);
}

function positiveInt(name: string, value: number | undefined, fallback: number, min = 1): number {
  const v = value ?? fallback;
  if (!Number.isSafeInteger(v) || v < min) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `hub option ${name} must be an integer >= ${min}`,
    );
  }
  return v;
}

/**
 * Creates the hub: the expert-shard HTTP API, the relay and the registry of models and workers.
 * Models load in the background (`ready`); `listen()` waits for them. Options are checked now
 * (InvalidArgumentError); a SQLite path that cannot be opened throws HubError MOESWARM_HUB_STORE.
 */
export function createHub(options: HubOptions): Hub {
  if (typeof options !== "object" || options === null) {
    throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "createHub needs an options object");
  }
  return new HubImpl(options);
}

interface Settings {
  secret: TokenSecret;
  publicReads: boolean;
  modelDir: string | undefined;
  manifestDir: string | undefined;
  chunkSize: number;
  sliceCacheSize: number;
  idleTimeoutMs: number;
  maxBodyBytes: number;
  tls: HubOptions["tls"];
  onEvent: HubOptions["onEvent"];
  dashboard: boolean | undefined;
  maxStatsBytes: number;
  maxPollMs: number;
}

const noop = () => {};
const API_ROOT = "/api";

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
  readonly #models = new Map<string, ServedModel>();
  /** Ids being loaded by POST /api/models (a second request for the same id waits for the first). */
  readonly #loading = new Map<string, Promise<ServedModel>>();
  readonly #book: WorkerBook;
  readonly #marketBook: MarketBook;
  readonly #marketHttp: MarketHttpContext;
  readonly #inflight = new Set<Promise<void>>();
  readonly #downloads = new Set<AbortController>();
  readonly #loadAbort = new AbortController();
  readonly #persistTimer: ReturnType<typeof setInterval>;
  readonly #etags = new WeakMap<ExpertSlice, string>();
  #server: HttpServer | HttpsServer | undefined;
  #closing: Promise<void> | undefined;

  constructor(options: HubOptions) {
    checkSecret(options.secret);
    const models = options.models ?? [];
    if (!Array.isArray(models)) {
      throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "hub option models must be an array");
    }
    const configured: Array<{ id: string; path: string }> = [];
    for (const m of models as readonly HubModelSource[]) {
      if (typeof m !== "object" || m === null || typeof m.path !== "string" || m.path.length === 0) {
        throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "each model needs a path");
      }
      const id = m.id ?? defaultModelId(m.path);
      if (!isModelId(id)) {
        throw new InvalidArgumentError(
          "MOESWARM_INVALID_ARGUMENT",
          `model id ${JSON.stringify(id)} is not a name of 1..128 characters [A-Za-z0-9._-] starting with a letter or digit`,
        );
      }
      if (configured.some((c) => c.id === id)) {
        throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", `model id ${id} is given twice`);
      }
      configured.push({ id, path: resolve(m.path) });
    }
    for (const dir of ["modelDir", "manifestDir"] as const) {
      const v = options[dir];
      if (v !== undefined && (typeof v !== "string" || v.length === 0)) {
        throw new InvalidArgumentError(
          "MOESWARM_INVALID_ARGUMENT",
          `hub option ${dir} must be a directory path`,
        );
      }
    }
    if (options.tls !== undefined && (!options.tls?.cert || !options.tls?.key)) {
      throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "hub option tls needs cert and key");
    }
    this.#s = {
      secret: options.secret,
      publicReads: options.publicReads ?? true,
      modelDir: options.modelDir === undefined ? undefined : resolve(options.modelDir),
      manifestDir: options.manifestDir === undefined ? undefined : resolve(options.manifestDir),
      chunkSize: positiveInt("chunkSize", options.chunkSize, 1 << 20),
      sliceCacheSize: positiveInt("sliceCacheSize", options.sliceCacheSize, 32),
      idleTimeoutMs: positiveInt("idleTimeoutMs", options.idleTimeoutMs, 120_000),
      maxBodyBytes: positiveInt("maxBodyBytes", options.maxBodyBytes, 64 * 1024),
      tls: options.tls,
      onEvent: options.onEvent,
      dashboard: options.dashboard,
      maxStatsBytes: positiveInt("maxStatsBytes", options.maxStatsBytes, 4 << 20),
      maxPollMs: positiveInt("maxPollMs", options.maxPollMs, 60_000, 0),
    };
    const clock = options.clock ?? Date.now;
    if (typeof clock !== "function") {
      throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "hub option clock must be a function");
    }
    const { statsStaleMs: staleOption, ...marketOptions } = options.market ?? {};
    const statsStaleMs = positiveInt("market.statsStaleMs", staleOption, 30_000);
    const persistMs = positiveInt("persistIntervalMs", options.persistIntervalMs, 10_000, 10);
    const forgetMs = positiveInt("forgetWorkersAfterMs", options.forgetWorkersAfterMs, 7 * 86_400_000);

    const userRelayEvent = options.relay?.onEvent;
    // the relay's hook: metrics, worker bookkeeping, then the embedder's own
    this.relay = createRelay({
      ...options.relay,
      secret: options.secret,
      onEvent: (event) => {
        for (const take of [
          () => this.metrics.relayEvent(event),
          () => this.#book.onRelayEvent(event),
          () => this.#marketBook.onRelayEvent(event),
          () => this.#emit({ type: "relay", event }),
          () => userRelayEvent?.(event),
        ]) {
          try {
            take();
          } catch {
            // one observer's failure must not keep the event from the others
          }
        }
      },
    });
    this.handleUpgrade = (req, socket, head) => this.relay.handleUpgrade(req, socket, head);

    try {
      if (options.store === undefined) {
        this.store = createMemoryStore();
        this.#ownsStore = true;
      } else if (typeof options.store === "string") {
        this.store = openSqliteStore(options.store);
        this.#ownsStore = true;
      } else if (typeof options.store === "object" && options.store !== null) {
        this.store = options.store;
        this.#ownsStore = false;
      } else {
        throw new InvalidArgumentError(
          "MOESWARM_INVALID_ARGUMENT",
          "hub option store must be a HubStore or a SQLite file path",
        );
      }
    } catch (error) {
      void this.relay.close();
      throw error;
    }

    this.metrics = new HubMetrics(
      {
        relay: this.relay,
        models: () => this.#models.size,
        workersKnown: () => this.#book.size,
        downloads: () => this.#downloads.size,
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
      { defaultMetrics: options.defaultMetrics === true },
    );
    this.#book = new WorkerBook({
      store: this.store,
      relay: () => this.relay,
      forgetAfterMs: forgetMs,
      onStoreError: (error) => {
        this.metrics.storeError();
        this.#emit({ type: "store-error", error });
      },
    });
    const onStoreError = (error: unknown) => {
      this.metrics.storeError();
      this.#emit({ type: "store-error", error });
    };
    try {
      this.#marketBook = new MarketBook({
        store: this.store,
        market: marketOptions,
        clock,
        knownWorker: (id) => this.#book.has(id),
        statsStaleMs,
        onStoreError,
        onLeaseEnd: (lease, why) => {
          this.metrics.leaseEnded(why);
          this.#emitLease(why, lease);
        },
      });
    } catch (error) {
      void this.relay.close();
      if (this.#ownsStore) void this.store.close();
      throw error;
    }
    this.market = this.#marketBook.market;
    this.#marketHttp = {
      book: this.#marketBook,
      metrics: this.metrics,
      authorize: (req, role) => this.#authorize(req, role),
      checkRead: (req) => {
        if (!this.#s.publicReads) this.#authorize(req);
      },
      model: (id) => this.#marketModel(id),
      maxBodyBytes: this.#s.maxBodyBytes,
      maxStatsBytes: this.#s.maxStatsBytes,
      maxPollMs: this.#s.maxPollMs,
    };
    this.#persistTimer = setInterval(() => {
      void this.#book.flush();
      void this.#marketBook.flush();
    }, persistMs);
    this.#persistTimer.unref?.();

    this.ready = this.#load(configured);
    this.ready.catch(noop); // observed by listen() or the embedder; never an unhandled rejection
  }

  #emit(event: HubEvent): void {
    try {
      this.#s.onEvent?.(event);
    } catch {
      // the hook's problem, not the hub's
    }
  }

  #emitLease(
    action: "granted" | "renewed" | "released" | "expired" | "fulfilled",
    lease: {
      id: string;
      worker: string;
      model: string;
      layers: { start: number; end: number };
      experts: { start: number; end: number };
    },
  ): void {
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

  // --- models ---------------------------------------------------------------------------------

  /** Serves a loaded model: the API lists it, the market tracks its coverage. */
  #serveModel(id: string, model: ServedModel): void {
    this.#models.set(id, model);
    this.#marketBook.addModel(marketModelOf(id, model));
  }

  #marketModel(id: string): MarketModel {
    const model = this.#model(id);
    return marketModelOf(model.id, model);
  }

  #openModel(id: string, path: string): Promise<ServedModel> {
    const started = performance.now();
    this.#emit({ type: "model-loading", id, path });
    return ServedModel.open(id, path, {
      signal: this.#loadAbort.signal,
      manifestPath:
        this.#s.manifestDir === undefined ? undefined : resolve(this.#s.manifestDir, `${id}.manifest.json`),
      chunkSize: this.#s.chunkSize,
      sliceCacheSize: this.#s.sliceCacheSize,
      onProgress: ({ bytesDone, bytesTotal }) =>
        this.#emit({ type: "model-progress", id, bytesDone, bytesTotal }),
    }).then((model) => {
      this.#emit({ type: "model-ready", id, path, ms: performance.now() - started });
      return model;
    });
  }

  async #load(configured: ReadonlyArray<{ id: string; path: string }>): Promise<void> {
    if (this.#s.manifestDir !== undefined) {
      try {
        await mkdir(this.#s.manifestDir, { recursive: true });
      } catch (error) {
        throw new HubError(
          "MOESWARM_HUB_INTERNAL",
          `cannot create the manifest directory: ${(error as Error).message}`,
          {
            cause: error,
          },
        );
      }
    }
    await this.#book.load();
    await this.#marketBook.load();
    // configured models fail the start; a stored one that no longer loads is reported and skipped
    for (const { id, path } of configured) {
      const model = await this.#openModel(id, path);
      if (this.#closing) {
        await model.close();
        return;
      }
      this.#serveModel(id, model);
    }
    for (const stored of await this.store.listModels()) {
      if (this.#models.has(stored.id) || !isModelId(stored.id)) continue;
      try {
        const model = await this.#openModel(stored.id, stored.path);
        if (this.#closing) {
          await model.close();
          return;
        }
        this.#serveModel(stored.id, model);
      } catch (error) {
        if (this.#closing) return;
        this.#emit({ type: "model-unavailable", id: stored.id, path: stored.path, error });
      }
    }
  }

  models(): ModelInfo[] {
    return [...this.#models.values()].map((m) => structuredClone(m.info));
  }

  workers(): HubWorkerInfo[] {
    return this.#book.list().map((w) => {
      const latency = this.#marketBook.latencyOf(w.id);
      const reported = this.#marketBook.reportedLatencyOf(w.id);
      const info: HubWorkerInfo = { ...w, credits: this.market.creditsOf(w.id) };
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
        arch: this.#models.get(id)?.info.arch ?? null,
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
      };
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
    const head = method === "HEAD";
    let route: RouteLabel = "other";
    try {
      if (this.#closing) throw new HubError("MOESWARM_HUB_INTERNAL", "the hub is shutting down");
      const segments = decodeSegments(path);
      route = routeOf(segments);
      await this.#route(req, res, method, segments, query, route);
    } catch (error) {
      const status = sendError(res, error, head);
      if (status >= 500) {
        this.metrics.internalError(route);
        this.#emit({ type: "request-error", method, url: req.url ?? "", status, error });
      }
    } finally {
      this.metrics.request(route, method, res.statusCode, (performance.now() - started) / 1000);
    }
  }

  async #route(
    req: IncomingMessage,
    res: ServerResponse,
    method: string,
    seg: readonly string[],
    query: string,
    route: RouteLabel,
  ): Promise<void> {
    const head = method === "HEAD";
    const read = () => {
      if (method !== "GET" && method !== "HEAD") throw methodNotAllowed(method, ["GET", "HEAD"]);
      if (!this.#s.publicReads) this.#authorize(req);
    };
    // wait for the configured models (a failed load answers every request with its error)
    await this.ready;
    switch (route) {
      case "/metrics": {
        read();
        const text = Buffer.from(await this.metrics.text());
        res.writeHead(200, {
          "content-type": this.metrics.contentType,
          "content-length": text.byteLength,
          "cache-control": "no-store",
        });
        res.end(head ? undefined : text);
        return;
      }
      case "/api/models":
        if (method === "POST") {
          this.#authorize(req, "admin");
          await this.#register(req, res);
          return;
        }
        if (method !== "GET" && method !== "HEAD") throw methodNotAllowed(method, ["GET", "HEAD", "POST"]);
        if (!this.#s.publicReads) this.#authorize(req);
        sendJson(res, 200, { models: this.models() }, {}, head);
        return;
      case "/api/models/:model": {
        if (method === "DELETE") {
          this.#authorize(req, "admin");
          await this.#unregister(res, seg[2] as string);
          return;
        }
        if (method !== "GET" && method !== "HEAD") throw methodNotAllowed(method, ["GET", "HEAD", "DELETE"]);
        if (!this.#s.publicReads) this.#authorize(req);
        sendJson(res, 200, structuredClone(this.#model(seg[2] as string).info), {}, head);
        return;
      }
      case "/api/models/:model/manifest": {
        read();
        const model = this.#model(seg[2] as string);
        const headers = { etag: model.manifestEtag, "cache-control": "no-cache" };
        if (noneMatchHits(headerOf(req, "if-none-match"), model.manifestEtag)) {
          res.writeHead(304, headers);
          res.end();
          return;
        }
        res.writeHead(200, {
          ...headers,
          "content-type": "application/json; charset=utf-8",
          "content-length": model.manifestJson.byteLength,
        });
        res.end(head ? undefined : model.manifestJson);
        this.metrics.bytes(route, head ? 0 : model.manifestJson.byteLength);
        return;
      }
      case "/api/models/:model/expert-shard": {
        read();
        const model = this.#model(seg[2] as string);
        if (!model.acquire()) throw notFound(`model ${JSON.stringify(model.id)} was removed`);
        try {
          await this.#expertShard(req, res, model, query, head);
        } finally {
          model.release();
        }
        return;
      }
      case "/api/workers":
        read();
        sendJson(res, 200, { workers: this.workers() }, {}, head);
        return;
      case "/api/workers/:id/drain":
        if (method !== "POST") throw methodNotAllowed(method, ["POST"]);
        this.#authorize(req, "admin");
        await this.#drainWorker(req, res, seg[2] as string);
        return;
      case "/": {
        if (method !== "GET" && method !== "HEAD") throw methodNotAllowed(method, ["GET", "HEAD"]);
        const { html, csp } = dashboardPage();
        res.writeHead(200, {
          "content-type": "text/html; charset=utf-8",
          "content-length": html.byteLength,
          "cache-control": "no-cache",
          "content-security-policy": csp,
          "x-content-type-options": "nosniff",
          "referrer-policy": "no-referrer",
        });
        res.end(head ? undefined : html);
        return;
      }
      case "/api/status": {
        read();
        const model = new URLSearchParams(query).get("model") ?? undefined;
        if (model !== undefined) this.#model(model);
        sendJson(res, 200, this.status(model === undefined ? {} : { model }), {}, head);
        return;
      }
      case "/api/demand":
        read();
        getDemand(this.#marketHttp, req, res, query);
        return;
      case "/api/models/:model/placement":
        read();
        await getPlacement(this.#marketHttp, req, res, seg[2] as string, query);
        return;
      case "/api/models/:model/stats":
        if (method !== "POST") throw methodNotAllowed(method, ["POST"]);
        await postStats(this.#marketHttp, req, res, seg[2] as string);
        return;
      case "/api/claims":
      case "/api/claims/auto": {
        if (method !== "POST") throw methodNotAllowed(method, ["POST"]);
        this.#emitLease("granted", await postClaim(this.#marketHttp, req, res, route === "/api/claims/auto"));
        return;
      }
      case "/api/claims/:id":
      case "/api/claims/:id/renew": {
        const done = await leaseRoute(
          this.#marketHttp,
          req,
          res,
          method,
          seg[2] as string,
          route === "/api/claims/:id/renew",
        );
        if (done) this.#emitLease(done.action, done.lease);
        return;
      }
      default:
        throw notFound(`no such resource: ${req.url ?? ""}`);
    }
  }

  #model(id: string): ServedModel {
    const model = isModelId(id) ? this.#models.get(id) : undefined;
    if (!model) throw notFound(`no model ${JSON.stringify(id)} on this hub`);
    return model;
  }

  /** Verifies the request's bearer token (any role for reads, `role` for writes). */
  #authorize(req: IncomingMessage, role?: TokenRole): TokenClaims {
    const header = headerOf(req, "authorization");
    const m = header === undefined ? null : /^Bearer[ ]+(\S+)\s*$/i.exec(header);
    return verifyToken(m ? m[1] : header === undefined ? undefined : "?", this.#s.secret, { role });
  }

  async #expertShard(
    req: IncomingMessage,
    res: ServerResponse,
    model: ServedModel,
    query: string,
    head: boolean,
  ): Promise<void> {
    const params = new URLSearchParams(query);
    const one = (name: string): string => {
      const all = params.getAll(name);
      if (all.length === 0) throw badRequest(`the query needs ${name}=a:b (a half-open range)`);
      if (all.length > 1) throw badRequest(`${name} is given ${all.length} times`);
      return all[0] as string;
    };
    const layers = parseRange(one("layers"), { max: model.layerCount });
    const experts = parseRange(one("experts"), { max: model.expertCount });
    for (let l = layers.start; l < layers.end; l++) {
      // said here rather than by the slicer, whose message names the file on the hub's disk
      if (!model.manifest.layers.some((x) => x.layer === l)) {
        throw new GgufError("MOESWARM_GGUF_NOT_MOE", `layer ${l} of ${model.id} has no routed experts`, {
          details: { layer: l, moeLayers: model.info.moeLayers },
        });
      }
    }
    const normalised = `layers=${formatRange(layers)}&experts=${formatRange(experts)}`;
    const slice = await model.slice(layers, experts);
    let etag = this.#etags.get(slice);
    if (etag === undefined) {
      etag = sliceEtag(model.manifest.source.headerSha256, normalised, slice);
      this.#etags.set(slice, etag);
    }
    const headers: Record<string, string | number> = {
      etag,
      "accept-ranges": "bytes",
      "cache-control": "no-cache",
      "x-moeswarm-source-sha256": model.manifest.source.headerSha256,
    };
    if (noneMatchHits(headerOf(req, "if-none-match"), etag)) {
      res.writeHead(304, headers);
      res.end();
      return;
    }
    const range = headerOf(req, "range");
    const answer =
      range !== undefined && ifRangeHolds(headerOf(req, "if-range"), etag)
        ? interpretRange(range, slice.length)
        : ({ kind: "full" } as const);
    const [start, end] = answer.kind === "full" ? [0, slice.length] : [answer.start, answer.end];
    const file = `${model.id}.layers-${layers.start}-${layers.end}.experts-${experts.start}-${experts.end}.gguf`;
    Object.assign(headers, {
      "content-type": "application/octet-stream",
      "content-length": end - start,
      "content-disposition": `attachment; filename="${file}"`,
    });
    if (answer.kind === "partial") headers["content-range"] = `bytes ${start}-${end - 1}/${slice.length}`;
    const status = answer.kind === "partial" ? 206 : 200;
    if (head) {
      res.writeHead(status, headers);
      res.end();
      return;
    }

    const abort = new AbortController();
    // the client went away (or the hub closes): stop reading the file at once
    const onClose = () => abort.abort(new HubError("MOESWARM_HUB_INTERNAL", "the download was cut"));
    res.once("close", onClose);
    this.#downloads.add(abort);
    res.setTimeout(this.#s.idleTimeoutMs, () => res.destroy());
    const metrics = this.metrics;
    async function* counted(chunks: AsyncIterable<Uint8Array>): AsyncGenerator<Uint8Array> {
      for await (const chunk of chunks) {
        yield chunk;
        metrics.bytes("/api/models/:model/expert-shard", chunk.byteLength);
      }
    }
    try {
      res.writeHead(status, headers);
      await pipeline(counted(slice.range(start, end, { signal: abort.signal })), res);
    } catch (error) {
      res.destroy();
      // a client that left is not a failure of the hub; a read that failed is
      if (clientLeft(error, abort.signal)) return;
      throw error;
    } finally {
      res.off("close", onClose);
      this.#downloads.delete(abort);
    }
  }

  /** POST /api/workers/:id/drain: the relay sends the worker `drain` and routes it nothing new. */
  async #drainWorker(req: IncomingMessage, res: ServerResponse, id: string): Promise<void> {
    const body = await readJsonBody(req, res, this.#s.maxBodyBytes);
    if (body !== undefined && (typeof body !== "object" || body === null || Array.isArray(body))) {
      throw badRequest('the body must be empty or a JSON object {"reason"?: "<text>"}');
    }
    const reason = (body as { reason?: unknown } | undefined)?.reason;
    if (reason !== undefined && (typeof reason !== "string" || Buffer.byteLength(reason) > 1024)) {
      throw badRequest('"reason" must be a string of at most 1024 bytes');
    }
    if (!this.relay.drainWorker(id, reason)) {
      throw notFound(`no worker ${JSON.stringify(id)} is connected to this hub's relay`);
    }
    const live = this.relay.workers().find((w) => w.id === id);
    sendJson(res, 200, { worker: id, draining: true, inFlight: live?.inFlight ?? 0 });
  }

  async #register(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const dir = this.#s.modelDir;
    if (dir === undefined) {
      throw badRequest("this hub registers no models at run time (it was started without a model directory)");
    }
    const body = await readJsonBody(req, res, this.#s.maxBodyBytes);
    if (typeof body !== "object" || body === null || Array.isArray(body)) {
      throw badRequest(
        'the body must be a JSON object {"path": "<file in the model directory>", "id"?: "<name>"}',
      );
    }
    const { path, id: wanted } = body as Record<string, unknown>;
    if (typeof path !== "string" || path.length === 0 || path.length > 4096 || path.includes("\0")) {
      throw badRequest('"path" must name a file in the model directory');
    }
    if (wanted !== undefined && !isModelId(wanted)) {
      throw badRequest('"id" must be 1..128 characters [A-Za-z0-9._-] starting with a letter or digit');
    }
    const file = await resolveInside(dir, path);
    const id = (wanted as string | undefined) ?? defaultModelId(file);
    const existing = this.#models.get(id);
    if (existing) {
      if (existing.path !== file) {
        throw new HubError("MOESWARM_HUB_CONFLICT", `model id ${id} is taken by another file`, {
          details: { id },
        });
      }
      sendJson(res, 200, structuredClone(existing.info));
      return;
    }
    let loading = this.#loading.get(id);
    if (!loading) {
      loading = this.#openModel(id, file);
      this.#loading.set(id, loading);
      void loading.catch(noop).finally(() => {
        if (this.#loading.get(id) === loading) this.#loading.delete(id);
      });
    }
    let model: ServedModel;
    try {
      model = await loading;
    } catch (error) {
      if (isMoeswarmError(error) && error instanceof GgufError && error.code !== "MOESWARM_GGUF_IO") {
        throw badRequest(`${path} cannot be served: ${error.message}`, { cause: error.code });
      }
      throw error;
    }
    if (this.#models.get(id) === model) {
      sendJson(res, 200, structuredClone(model.info));
      return;
    }
    if (this.#models.has(id) || this.#closing) {
      await model.close();
      throw new HubError("MOESWARM_HUB_CONFLICT", `model id ${id} was registered meanwhile`, {
        details: { id },
      });
    }
    try {
      await this.store.putModel({ id, path: file, addedAt: Date.now() });
    } catch (error) {
      await model.close();
      this.metrics.storeError();
      throw isMoeswarmError(error)
        ? error
        : new HubError("MOESWARM_HUB_STORE", String(error), { cause: error });
    }
    this.#serveModel(id, model);
    sendJson(res, 201, structuredClone(model.info), {
      location: model.info.links.manifest.replace(/\/manifest$/, ""),
    });
  }

  async #unregister(res: ServerResponse, id: string): Promise<void> {
    const model = this.#model(id);
    await this.store.deleteModel(id);
    this.#models.delete(id);
    this.#marketBook.removeModel(id);
    await model.retire();
    this.#emit({ type: "model-removed", id });
    sendJson(res, 200, { removed: id });
  }

  // --- server ---------------------------------------------------------------------------------

  async listen(port = 0, host = "127.0.0.1"): Promise<HubListener> {
    if (!Number.isInteger(port) || port < 0 || port > 65535) {
      throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "port must be an integer in 0..65535");
    }
    if (typeof host !== "string" || host.length === 0) {
      throw new InvalidArgumentError(
        "MOESWARM_INVALID_ARGUMENT",
        "host must be an interface address or name",
      );
    }
    if (this.#server || this.#closing) {
      throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "this hub is already listening or closed");
    }
    const tls = this.#s.tls;
    const server: HttpServer | HttpsServer = tls
      ? createHttpsServer({ cert: pem(tls.cert), key: pem(tls.key), ca: tls.ca && pem(tls.ca) })
      : createHttpServer();
    this.#server = server;
    server.on("request", (req: IncomingMessage, res: ServerResponse) => {
      if (this.#handle(req, res, this.#s.dashboard !== false)) return;
      const upgrade = (req.url ?? "").split("?")[0] === this.relay.path;
      const { body } = publicError(
        upgrade
          ? badRequest(`${this.relay.path} is the relay: open a WebSocket`)
          : notFound(`no such resource: ${req.url ?? ""}`),
      );
      sendJson(
        res,
        upgrade ? 426 : 404,
        body,
        upgrade ? { upgrade: "websocket" } : {},
        req.method === "HEAD",
      );
    });
    this.relay.attach(server);
    await this.ready;
    await new Promise<void>((resolveListen, reject) => {
      server.once("error", reject);
      server.listen(port, host, () => {
        server.off("error", reject);
        resolveListen();
      });
    });
    const bound = (server.address() as AddressInfo).port;
    const hostPart = host.includes(":") ? `[${host}]` : host;
    const url = `${tls ? "https" : "http"}://${hostPart}:${bound}`;
    this.listener = {
      server,
      port: bound,
      url,
      relayUrl: `${tls ? "wss" : "ws"}://${hostPart}:${bound}${this.relay.path}`,
    };
    return this.listener;
  }

  close(): Promise<void> {
    this.#closing ??= (async () => {
      clearInterval(this.#persistTimer);
      this.#marketBook.stopWaiting();
      this.#loadAbort.abort(new HubError("MOESWARM_HUB_NOT_FOUND", "the hub is shutting down"));
      const server = this.#server;
      const stopped = server?.listening
        ? new Promise<void>((done) => server.close(() => done()))
        : Promise.resolve();
      await this.relay.close();
      for (const download of this.#downloads) download.abort();
      server?.closeAllConnections();
      await Promise.allSettled([...this.#inflight, ...this.#loading.values()]);
      await this.ready.catch(noop);
      await this.#book.flush({ final: true });
      await this.#marketBook.close();
      await Promise.allSettled([...this.#models.values()].map((m) => m.close()));
      this.#models.clear();
      if (this.#ownsStore) await this.store.close().catch(noop);
      await stopped;
    })();
    return this.#closing;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

/** The market's view of a served model: its MoE layers with their expert count and size. */
function marketModelOf(id: string, model: ServedModel): MarketModel {
  return {
    id,
    layers: [...model.manifest.layers]
      .sort((a, b) => a.layer - b.layer)
      .map((l) => ({ layer: l.layer, nExpert: l.nExpert, bytesPerExpert: l.bytesPerExpert })),
  };
}

function pem(value: string | Uint8Array): string | Buffer {
  return typeof value === "string" ? value : Buffer.from(value);
}

function headerOf(req: IncomingMessage, name: string): string | undefined {
  const v = req.headers[name];
  return Array.isArray(v) ? v.join(", ") : v;
}

/** The path's segments, percent-decoded (a model id is matched against names, never used as a path). */
function decodeSegments(path: string): string[] {
  return path
    .split("/")
    .slice(1)
    .map((s) => {
      try {
        return decodeURIComponent(s);
      } catch {
        throw badRequest("the path has malformed percent-encoding");
      }
    });
}

function routeOf(seg: readonly string[]): RouteLabel {
  if (seg.length === 1 && seg[0] === "metrics") return "/metrics";
  if (seg.length === 1 && seg[0] === "") return "/";
  if (seg[0] !== "api") return "other";
  if (seg.length === 2 && seg[1] === "workers") return "/api/workers";
  if (seg.length === 4 && seg[1] === "workers" && seg[3] === "drain") return "/api/workers/:id/drain";
  if (seg.length === 2 && seg[1] === "status") return "/api/status";
  if (seg.length === 2 && seg[1] === "demand") return "/api/demand";
  if (seg[1] === "claims") {
    if (seg.length === 2) return "/api/claims";
    if (seg.length === 3) return seg[2] === "auto" ? "/api/claims/auto" : "/api/claims/:id";
    if (seg.length === 4 && seg[3] === "renew") return "/api/claims/:id/renew";
    return "other";
  }
  if (seg[1] !== "models") return "other";
  if (seg.length === 2) return "/api/models";
  if (seg.length === 3) return "/api/models/:model";
  if (seg.length === 4 && seg[3] === "manifest") return "/api/models/:model/manifest";
  if (seg.length === 4 && seg[3] === "expert-shard") return "/api/models/:model/expert-shard";
  if (seg.length === 4 && seg[3] === "placement") return "/api/models/:model/placement";
  if (seg.length === 4 && seg[3] === "stats") return "/api/models/:model/stats";
  return "other";
}

const CLIENT_GONE = new Set([
  "ERR_STREAM_PREMATURE_CLOSE",
  "ERR_STREAM_DESTROYED",
  "ERR_STREAM_WRITE_AFTER_END",
  "EPIPE",
  "ECONNRESET",
  "ABORT_ERR",
]);

function clientLeft(error: unknown, signal: AbortSignal): boolean {
  if (signal.aborted && error === signal.reason) return true;
  if (isMoeswarmError(error)) return error.code === "MOESWARM_ABORTED";
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" && CLIENT_GONE.has(code);
}

/**
 * The real path of `path` (relative to `dir`, or absolute), refused unless it is a regular file
 * inside `dir` once every symbolic link is resolved.
 */
async function resolveInside(dir: string, path: string): Promise<string> {
  const outside = () => badRequest(`"path" must name a file inside the model directory`, { path });
  let root: string;
  try {
    root = await realpath(dir);
  } catch (error) {
    throw new HubError("MOESWARM_HUB_INTERNAL", `the model directory is not readable`, { cause: error });
  }
  let real: string;
  try {
    real = await realpath(resolve(root, path));
  } catch {
    // does not exist: say so only for paths that would have been inside
    const rel = relative(root, resolve(root, path));
    if (rel.startsWith("..") || isAbsolute(rel)) throw outside();
    throw notFound(`no file ${JSON.stringify(path)} in the model directory`);
  }
  const rel = relative(root, real);
  if (rel === "" || rel.startsWith(`..${sep}`) || rel === ".." || isAbsolute(rel)) throw outside();
  const st = await stat(real);
  if (!st.isFile()) throw badRequest(`${JSON.stringify(path)} is not a file`);
  return real;
}

// The hub's public shapes: its options, the events it reports, what `status()` answers and the
// `Hub` handle itself (the implementation lives in hub.ts).
import type { Server as HttpServer, IncomingMessage, ServerResponse } from "node:http";
import type { Server as HttpsServer } from "node:https";
import type { WorkerPauseBy, WorkerPauseJson } from "@moeswarm/core";
import type { ConnectionLimits } from "./connection-guard.js";
import type { EnrolmentLimits } from "./enrolment.js";
import type { CoverageGrid, CoverageMarket, MarketOptions } from "./market.js";
import type { BackboneRate } from "./market-book.js";
import type { HubMetrics } from "./metrics.js";
import type { ModelInfo } from "./model.js";
import type { Relay, RelayOptions, RelayServerEvent } from "./relay.js";
import type { SqliteDriverName } from "./sqlite-driver.js";
import type { HubStore } from "./store.js";
import type { TokenSecret } from "./token.js";
import type { HubWorkerInfo } from "./worker-book.js";

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
  /**
   * The SQLite driver for a `store` path: "auto" (default: better-sqlite3, else node:sqlite,
   * else node-sqlite3-wasm) or one of them by name. With none loadable a path other than
   * `":memory:"` is refused (HubError MOESWARM_HUB_NO_SQLITE): persistence is never dropped.
   */
  sqliteDriver?: "auto" | SqliteDriverName;
  /**
   * Addresses of reverse proxies in front of the hub (IP addresses or CIDR blocks, e.g.
   * "127.0.0.1", "10.0.0.0/8"): a connection from one of them is counted, for the per-address
   * limits, under the client address its X-Forwarded-For names (docs/deploy.md). Default none.
   */
  trustProxy?: readonly string[];
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
  /** Connection caps and timeouts against idle and abusive clients (README "Limits"). */
  limits?: ConnectionLimits;
  /**
   * How often one client address may try an enrolment code at `POST /api/enrol` (README
   * "Limits"): `burst` tries at once (default 10), then `perMinute` a minute (default 10).
   */
  enrolment?: EnrolmentLimits;
  /** Largest request body (default 64 KiB). */
  maxBodyBytes?: number;
  /** How often workers' last-seen times are written (default 10000 ms). */
  persistIntervalMs?: number;
  /** Workers not seen for this long are forgotten (default 7 days). */
  forgetWorkersAfterMs?: number;
  /**
   * A paused worker the hub has not seen for this long loses its pause (default 30 days, counted
   * from the later of the pause and its last sighting); a quarantine drops it at once.
   */
  pauseRetentionMs?: number;
  /** Also export prom-client's process metrics (they live as long as the process; default false). */
  defaultMetrics?: boolean;
  /** The coverage market: demand decay, replica targets, values, leases (README "Demand"). */
  market?: HubMarketOptions;
  /**
   * The dashboard on `GET /`: the hub's own server (`listen()`) serves it unless this is false;
   * `handleRequest`/`createHubHandler` only when it is true (an embedder's `/` is its own).
   */
  dashboard?: boolean;
  /**
   * Accept worker and backbone tokens not bound to a peer id (`sub`), on hello and on HTTP writes.
   * Off by default: such a token's holder could act as any worker or backbone (take over its
   * id, cancel its leases, report for it). For a private swarm whose token holders are all
   * trusted (CLI --allow-unbound-tokens).
   */
  allowUnboundTokens?: boolean;
  /**
   * Accept a worker's `register` only for a slice a live lease of that worker covers (default
   * true; MOESWARM_HUB_NO_LEASE otherwise), and withdraw it when that lease ends. false: any
   * registration enters placement (a private swarm, or tests that fake workers).
   */
  requireLeases?: boolean;
  /**
   * Take backbones' stats reports as they come (default false: credits, counts and tokens are
   * bounded by what this hub's relay forwarded from the backbone, README "Backbone stats"). true:
   * a private swarm whose backbones are all trusted, or tests whose backbones do not dispatch
   * through this hub.
   */
  trustReports?: boolean;
  /**
   * Distinct workers each expert needs before the market counts it covered (default 2: two
   * independent owners per part, so a backbone can compare their answers; 1: one copy). Wins over
   * `market.replicas`. CLI --replicas.
   */
  replicas?: number;
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
    /** A backbone reported it answering wrong; it serves nothing until an admin reinstates it. */
    quarantined: boolean;
    /**
     * Set while it is paused (left out of placements): by whom, since when (unix ms), and why when
     * they said. The hub's pause (owner or operator) is shown when both it and its own hold.
     */
    paused?: { by: WorkerPauseBy; at: number; reason?: string };
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
  /**
   * Pauses of workers the hub no longer lists in `workers` (it forgot them, or never saw them):
   * when each was last seen and when its pause is dropped unless it comes back or is resumed.
   */
  unlistedPauses: WorkerPauseJson[];
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
      action: "granted" | "renewed" | "released" | "expired" | "fulfilled" | "revoked";
      id: string;
      worker: string;
      model: string;
      layers: string;
      experts: string;
    }
  /** A backbone's report quarantined a worker (`by`: the backbone), or an admin reinstated it. */
  | { type: "quarantine"; worker: string; by: string; model: string; reason: string }
  | { type: "reinstate"; worker: string }
  /** A worker was paused or resumed (`paused`: whether any pause is still in force). */
  | {
      type: "pause";
      worker: string;
      paused: boolean;
      by: WorkerPauseBy;
      reason?: string;
      /** Set when the pause was dropped, not lifted: its worker unseen past the retention, or revoked. */
      dropped?: "retention" | "revoked";
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

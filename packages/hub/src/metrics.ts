import { isErrorCode } from "@moeswarm/core";
import { Counter, collectDefaultMetrics, Gauge, Histogram, Registry } from "prom-client";
import type { DirectPendingFigures } from "./direct-credit.js";
import type { Relay, RelayServerEvent } from "./relay.js";

/** Route labels are the route templates, so a crawler cannot grow the label set. */
export type RouteLabel =
  | "/api/models"
  | "/api/models/:model"
  | "/api/models/:model/manifest"
  | "/api/models/:model/expert-shard"
  | "/api/models/:model/placement"
  | "/api/models/:model/stats"
  | "/api/workers"
  | "/api/workers/:id/drain"
  | "/api/workers/:id/reinstate"
  | "/api/workers/:id/pause"
  | "/api/workers/:id/resume"
  | "/api/workers/:id/direct"
  | "/api/workers/:id/direct/served"
  | "/api/direct/key"
  | "/api/direct/tickets"
  | "/api/pauses"
  | "/api/quarantines"
  | "/api/enrol"
  | "/api/enrol-codes"
  | "/api/models/:model/reports/quarantine"
  | "/api/status"
  | "/api/health"
  | "/api/demand"
  | "/api/claims"
  | "/api/claims/auto"
  | "/api/claims/:id"
  | "/api/claims/:id/renew"
  | "/"
  | "/metrics"
  | "other";

/** The market's figures per model, read at each scrape. */
export interface MarketFigures {
  model: string;
  cells: number;
  uncovered: number;
  belowTarget: number;
  hot: number;
  leases: number;
  tokensPerSecond: number;
  /** Expert-tokens credited since this hub started. */
  expertTokensServed: number;
}

export interface HubMetricsSources {
  relay: Relay;
  models: () => number;
  workersKnown: () => number;
  /** Pauses of workers the hub no longer lists (forgotten or never seen), read at each scrape. */
  unlistedPauses?: () => number;
  downloads: () => number;
  /** Connections the connection guard refused or closed, by reason (undefined before listen). */
  connectionsRefused?: () => Record<string, number> | undefined;
  market?: () => MarketFigures[];
  /** Direct credits' unmatched halves (direct-credit.ts), read at each scrape. */
  direct?: () => DirectPendingFigures;
}

const METHODS = new Set(["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]);

/**
 * The hub's Prometheus metrics, in a registry of its own (never prom-client's global one), so
 * two hubs in one process, or the embedder's own metrics, never collide.
 */
export class HubMetrics {
  readonly registry = new Registry();
  readonly #requests: Counter<"route" | "method" | "status">;
  readonly #duration: Histogram<"route">;
  readonly #bytes: Counter<"route">;
  readonly #connects: Counter<"role">;
  readonly #routeSeconds: Histogram<"outcome">;
  readonly #storeErrors: Counter;
  readonly #pausesDropped: Counter<"reason">;
  readonly #handlerErrors: Counter<"route">;
  readonly #claims: Counter<"outcome">;
  readonly #leasesEnded: Counter<"reason">;
  readonly #reports: Counter<"outcome">;

  constructor(sources: HubMetricsSources, options: { defaultMetrics?: boolean } = {}) {
    // registered in this order, which is the order of the exposition
    const registers = [this.registry];
    const http = httpFamilies(registers);
    this.#requests = http.requests;
    this.#duration = http.duration;
    this.#bytes = http.bytes;
    this.#handlerErrors = http.handlerErrors;
    const relay = relayFamilies(registers, sources.relay);
    this.#connects = relay.connects;
    this.#routeSeconds = relay.routeSeconds;
    this.#storeErrors = hubFamilies(registers, sources);
    this.#pausesDropped = pauseFamilies(registers, sources);
    const market = marketFamilies(registers, sources.market ?? (() => []));
    this.#claims = market.claims;
    this.#leasesEnded = market.leasesEnded;
    this.#reports = market.reports;
    if (sources.direct) directFamilies(registers, sources.direct);
    if (options.defaultMetrics) {
      // process and event-loop metrics: they install observers that live as long as the
      // process, so only a hub that owns its process (the bin) turns them on
      collectDefaultMetrics({ register: this.registry });
    }
  }

  request(route: RouteLabel, method: string | undefined, status: number, seconds: number): void {
    const m = method && METHODS.has(method) ? method : "other";
    this.#requests.inc({ route, method: m, status: String(status) });
    this.#duration.observe({ route }, seconds);
  }

  bytes(route: RouteLabel, n: number): void {
    this.#bytes.inc({ route }, n);
  }

  internalError(route: RouteLabel): void {
    this.#handlerErrors.inc({ route });
  }

  storeError(): void {
    this.#storeErrors.inc();
  }

  pauseDropped(reason: "retention" | "revoked"): void {
    this.#pausesDropped.inc({ reason });
  }

  claim(outcome: string): void {
    const known = ["granted", "capacity", "held", "covered", "leased"];
    this.#claims.inc({ outcome: known.includes(outcome) ? outcome : "invalid" });
  }

  leaseEnded(reason: "fulfilled" | "expired" | "released" | "revoked"): void {
    this.#leasesEnded.inc({ reason });
  }

  statsReport(outcome: "accepted" | "duplicate" | "rejected"): void {
    this.#reports.inc({ outcome });
  }

  relayEvent(event: RelayServerEvent): void {
    if (event.type === "connect") this.#connects.inc({ role: event.role });
    else if (event.type === "routed") {
      // a worker's error code is its own string: only known codes become label values
      const outcome =
        event.outcome === "result" ? "result" : isErrorCode(event.outcome) ? event.outcome : "other";
      this.#routeSeconds.observe({ outcome }, event.ms / 1000);
    }
  }

  text(): Promise<string> {
    return this.registry.metrics();
  }

  get contentType(): string {
    return this.registry.contentType;
  }
}

type Registers = Registry[];

/** The HTTP API's requests, durations, bytes and internal errors. */
function httpFamilies(registers: Registers) {
  const requests = new Counter({
    name: "moeswarm_http_requests_total",
    help: "HTTP requests answered, by route template, method and status",
    labelNames: ["route", "method", "status"],
    registers,
  });
  const duration = new Histogram({
    name: "moeswarm_http_request_duration_seconds",
    help: "Time from a request's arrival to the end of its answer (downloads included)",
    labelNames: ["route"],
    buckets: [0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10, 60, 300],
    registers,
  });
  const bytes = new Counter({
    name: "moeswarm_http_bytes_served_total",
    help: "Body bytes handed to the network, by route template",
    labelNames: ["route"],
    registers,
  });
  const handlerErrors = new Counter({
    name: "moeswarm_http_internal_errors_total",
    help: "Requests that failed on the hub's side (answered 5xx or cut)",
    labelNames: ["route"],
    registers,
  });
  return { requests, duration, bytes, handlerErrors };
}

/** The relay's connections and traffic (mirrored from its own counters at each scrape) and route times. */
function relayFamilies(registers: Registers, relay: Relay) {
  new Gauge({
    name: "moeswarm_relay_connections",
    help: "Open relay connections that said hello, by role",
    labelNames: ["role"],
    registers,
    collect() {
      const s = relay.stats();
      this.set({ role: "worker" }, s.workers);
      this.set({ role: "backbone" }, s.backbones);
      this.set({ role: "pending" }, Math.max(0, s.connections - s.workers - s.backbones));
    },
  });
  const connects = new Counter({
    name: "moeswarm_relay_connects_total",
    help: "Relay connections accepted (hello verified), by role",
    labelNames: ["role"],
    registers,
  });
  // The relay counts these itself; the counters mirror its totals at every scrape.
  new Counter({
    name: "moeswarm_relay_frames_total",
    help: "Frames through the relay, by direction",
    labelNames: ["direction"],
    registers,
    collect() {
      const s = relay.stats();
      this.reset();
      this.inc({ direction: "in" }, s.framesIn);
      this.inc({ direction: "out" }, s.framesOut);
    },
  });
  new Counter({
    name: "moeswarm_relay_bytes_total",
    help: "Frame bytes through the relay, by direction",
    labelNames: ["direction"],
    registers,
    collect() {
      const s = relay.stats();
      this.reset();
      this.inc({ direction: "in" }, s.bytesIn);
      this.inc({ direction: "out" }, s.bytesOut);
    },
  });
  new Counter({
    name: "moeswarm_relay_dispatches_total",
    help: "Dispatch frames: routed to a worker, or refused by the relay (unknown peer, limits, lost worker)",
    labelNames: ["outcome"],
    registers,
    collect() {
      const s = relay.stats();
      this.reset();
      this.inc({ outcome: "routed" }, s.routed);
      this.inc({ outcome: "refused" }, s.refused);
    },
  });
  new Counter({
    name: "moeswarm_relay_copied_frames_total",
    help: "Dispatches and results the relay forwarded through a copy (their sender left no room to rewrite them in place)",
    registers,
    collect() {
      this.reset();
      this.inc(relay.stats().copied);
    },
  });
  new Counter({
    name: "moeswarm_relay_violations_total",
    help: "Protocol violations by peers (bad frames, wrong role)",
    registers,
    collect() {
      this.reset();
      this.inc(relay.stats().violations);
    },
  });
  const routeSeconds = new Histogram({
    name: "moeswarm_relay_route_seconds",
    help: "Relay-side round trip of a routed dispatch (in from the backbone to the answer out), by outcome",
    labelNames: ["outcome"],
    buckets: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
    registers,
  });
  return { connects, routeSeconds };
}

/** The hub's own gauges (downloads, models, workers) and its store's failures. */
function hubFamilies(registers: Registers, sources: HubMetricsSources): Counter {
  new Gauge({
    name: "moeswarm_http_downloads_in_flight",
    help: "Expert-shard downloads being streamed now",
    registers,
    collect() {
      this.set(sources.downloads());
    },
  });
  new Gauge({
    name: "moeswarm_hub_models",
    help: "Models the hub serves",
    registers,
    collect() {
      this.set(sources.models());
    },
  });
  new Gauge({
    name: "moeswarm_hub_workers_known",
    help: "Workers the hub remembers (live or not)",
    registers,
    collect() {
      this.set(sources.workersKnown());
    },
  });
  new Counter({
    name: "moeswarm_hub_connections_refused_total",
    help: "Connections refused or closed by the hub's limits, by reason (global-cap, address-cap, idle, request-timeout, tls-handshake, unauthenticated-cap)",
    labelNames: ["reason"],
    registers,
    collect() {
      this.reset();
      for (const [reason, n] of Object.entries(sources.connectionsRefused?.() ?? {})) this.inc({ reason }, n);
    },
  });
  const storeErrors = new Counter({
    name: "moeswarm_hub_store_errors_total",
    help: "Failed writes to the hub's persistent store",
    registers,
  });
  return storeErrors;
}

/** Pauses kept for workers the hub no longer lists, and pauses dropped without a resume. */
function pauseFamilies(registers: Registers, sources: HubMetricsSources): Counter<"reason"> {
  new Gauge({
    name: "moeswarm_hub_pauses_unlisted",
    help: "Pauses of workers the hub no longer lists (forgotten or never seen), kept until their retention ends",
    registers,
    collect() {
      this.set(sources.unlistedPauses?.() ?? 0);
    },
  });
  return new Counter({
    name: "moeswarm_hub_pauses_dropped_total",
    help: "Pauses dropped without a resume: retention (the worker unseen for --pause-retention), revoked (quarantined)",
    labelNames: ["reason"],
    registers,
  });
}

/** The market's figures per model (read at each scrape), claims, lease ends and stats reports. */
function marketFamilies(registers: Registers, market: () => MarketFigures[]) {
  new Gauge({
    name: "moeswarm_hub_cells",
    help: "(layer, expert) cells of each model: all, without a live replica, below their replica target, hot (target above 1)",
    labelNames: ["model", "state"],
    registers,
    collect() {
      this.reset();
      for (const m of market()) {
        this.set({ model: m.model, state: "total" }, m.cells);
        this.set({ model: m.model, state: "uncovered" }, m.uncovered);
        this.set({ model: m.model, state: "below_target" }, m.belowTarget);
        this.set({ model: m.model, state: "hot" }, m.hot);
      }
    },
  });
  new Gauge({
    name: "moeswarm_hub_leases",
    help: "Active leases (claims granted, not yet registered), by model",
    labelNames: ["model"],
    registers,
    collect() {
      this.reset();
      for (const m of market()) this.set({ model: m.model }, m.leases);
    },
  });
  new Gauge({
    name: "moeswarm_hub_tokens_per_second",
    help: "Tokens per second the backbones reported (fresh reports only), by model",
    labelNames: ["model"],
    registers,
    collect() {
      this.reset();
      for (const m of market()) this.set({ model: m.model }, m.tokensPerSecond);
    },
  });
  new Counter({
    name: "moeswarm_hub_expert_tokens_served_total",
    help: "Expert-tokens workers served, from the backbones' receipts (credits), by model",
    labelNames: ["model"],
    registers,
    collect() {
      this.reset();
      for (const m of market()) this.inc({ model: m.model }, m.expertTokensServed);
    },
  });
  const claims = new Counter({
    name: "moeswarm_hub_claims_total",
    help: "Claims answered: granted, or refused by reason (capacity, held, covered, leased, invalid)",
    labelNames: ["outcome"],
    registers,
  });
  const leasesEnded = new Counter({
    name: "moeswarm_hub_leases_ended_total",
    help: "Leases that ended: fulfilled (the worker registered the slice), expired, released",
    labelNames: ["reason"],
    registers,
  });
  const reports = new Counter({
    name: "moeswarm_hub_stats_reports_total",
    help: "Backbone stats reports: accepted, duplicate (a retried seq), rejected",
    labelNames: ["outcome"],
    registers,
  });
  return { claims, leasesEnded, reports };
}

/**
 * Direct credits waiting for their other half (read at each scrape): a worker's half the backbone's
 * receipts have not confirmed yet, or the reverse. A growing count or age says one side stopped
 * reporting (or lies); the lapsed counter says how much never matched.
 */
function directFamilies(registers: Registers, direct: () => DirectPendingFigures): void {
  const sides = ["worker", "backbone"] as const;
  new Gauge({
    name: "moeswarm_hub_direct_pending_halves",
    help: "Direct-traffic halves waiting for the other side's report: (backbone, worker, model) pairs, by the side that reported",
    labelNames: ["side"],
    registers,
    collect() {
      const f = direct();
      for (const side of sides) this.set({ side }, f.halves[side]);
    },
  });
  new Gauge({
    name: "moeswarm_hub_direct_pending_expert_tokens",
    help: "Expert-tokens in direct-traffic halves waiting for the other side's report, by the side that reported",
    labelNames: ["side"],
    registers,
    collect() {
      const f = direct();
      for (const side of sides) this.set({ side }, f.expertTokens[side]);
    },
  });
  new Gauge({
    name: "moeswarm_hub_direct_pending_oldest_seconds",
    help: "Age of the oldest unmatched direct-traffic half (since the last report on its pair; it lapses at 900 s), by side",
    labelNames: ["side"],
    registers,
    collect() {
      const f = direct();
      for (const side of sides) this.set({ side }, f.oldestMs[side] / 1000);
    },
  });
  new Counter({
    name: "moeswarm_hub_direct_lapsed_expert_tokens_total",
    help: "Expert-tokens of direct-traffic halves dropped unmatched, by side and reason (expired: past the window; evicted: past the bound)",
    labelNames: ["side", "reason"],
    registers,
    collect() {
      const f = direct();
      this.reset();
      for (const side of sides) {
        this.inc({ side, reason: "expired" }, f.lapsed.expired[side]);
        this.inc({ side, reason: "evicted" }, f.lapsed.evicted[side]);
      }
    },
  });
}

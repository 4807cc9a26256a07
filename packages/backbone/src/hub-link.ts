import {
  AbortError,
  abortReason,
  type DirectTicketJson,
  InvalidArgumentError,
  onAbort,
  parseQuarantinesJson,
  QUARANTINES_PATH,
  throwIfAborted,
} from "@moeswarm/core";
import type { Placement, VerificationEvent } from "@moeswarm/dispatch";
import {
  connectRelay,
  DirectTransport,
  type DirectTransportCounters,
  type RelayConnection,
  type RelayState,
  RelayTransport,
} from "@moeswarm/relay-client";
import { asError, type Emit, emitter, type HubLinkError, type StatsOutcome, stamp } from "./hub-events.js";
import { HubHttp } from "./hub-http.js";
import { checkHubOptions, type HubLinkOptions, type HubSettings, hubSettings } from "./hub-options.js";
import { type HubPlacement, missingCount, PlacementFollower, REQUEST_TIMEOUT_MS } from "./hub-placement.js";
import { type QuarantineReportCounters, QuarantineReporter } from "./hub-reports.js";
import { StatsReporter } from "./hub-stats.js";
import type { StatsSource } from "./stats-report.js";

// The backbone's link to a hub, put together from its parts: the options (hub-options), the live
// placement (hub-placement), the reports (hub-stats) and the relay connection (relay-client).

/** The link's counters: a plain object (JSON-safe). */
export interface HubLinkMetrics extends QuarantineReportCounters {
  model: string;
  id: string;
  relay: RelayState;
  placementVersion: number;
  /** Versions applied after the first. */
  placementUpdates: number;
  workers: number;
  missingExperts: number;
  /** Long-polls answered (200 or 304), and failed. */
  polls: number;
  pollErrors: number;
  lastPollError?: HubLinkError;
  /** Reports the hub accepted, answered as duplicates, that failed (each try), and given up. */
  statsAccepted: number;
  statsDuplicates: number;
  statsErrors: number;
  statsDropped: number;
  /** The last report the hub answered (epoch ms). */
  lastStatsAt?: number;
  lastStatsError?: HubLinkError;
  /** Ban-list reads (`GET /api/quarantines`) answered, and failed (the last list read is kept). */
  banRefreshes: number;
  banRefreshErrors: number;
  lastBanRefreshError?: HubLinkError;
  /** Requests over direct links and over the relay, retries of dead links, dials (absent with `direct: false`). */
  direct?: DirectTransportCounters;
}

export interface HubLink extends AsyncDisposable {
  /** The hub's base URL. */
  readonly url: string;
  readonly model: string;
  readonly id: string;
  /** The backbone's relay connection (reconnects by itself). */
  readonly relay: RelayConnection;
  /**
   * `dispatchExperts`' transport: direct links to the workers that advertise endpoints, the relay
   * for the rest (a RelayTransport with `direct: false`). The placement's worker ids are relay ids.
   */
  readonly transport: DirectTransport | RelayTransport;
  /** The transport over the relay alone. */
  readonly relayTransport: RelayTransport;
  /** The current placement: a new object per hub version; requests keep the one they started with. */
  placement(): Placement;
  current(): HubPlacement;
  /** Resolves with the first version (the current one included) for which `predicate` holds. */
  waitForPlacement(
    predicate: (placement: HubPlacement) => boolean,
    options?: { signal?: AbortSignal },
  ): Promise<HubPlacement>;
  /** Where reports come from from now on (the bridge sets itself); undefined stops reporting. */
  reportStatsFrom(source: StatsSource | undefined): void;
  /**
   * Sends what the source has now (after a report in flight, and a failed one first) and resolves
   * with the hub's answer; undefined without a source.
   */
  reportStats(options?: { signal?: AbortSignal }): Promise<StatsOutcome | undefined>;
  /**
   * Reports a quarantine this backbone proved (`POST .../reports/quarantine`) in the background;
   * resolves when the hub answered (never rejects: a failure is counted and emitted; a hub without
   * the endpoint, 404, is not asked again).
   */
  reportQuarantine(event: VerificationEvent): Promise<void>;
  /**
   * The workers quarantined on the hub (`GET /api/quarantines`), to seed this backbone's own
   * quarantine: a liar another backbone caught is never trusted here, even by a fresh process.
   * An older hub without the list answers none. A read that fails after one succeeded resolves
   * with the last list read (a ban is not lifted because the hub could not be asked), emits an
   * `error` event with source "bans" and a hint, and counts it in `metrics()`; with no list read
   * yet it rejects (the bridge's start fails rather than trust workers it cannot check).
   */
  quarantined(options?: { signal?: AbortSignal }): Promise<string[]>;
  metrics(): HubLinkMetrics;
  /**
   * A ticket admitting this backbone to `worker` (`POST /api/direct/tickets`) and its expiry (unix
   * ms): the native plane hands it to the plugin, which says hello with it to the worker itself.
   */
  directTicket(worker: string, options?: { signal?: AbortSignal }): Promise<DirectTicketJson>;
  /** Stops the poller and the reporter, sends a final report, closes the relay connection. */
  close(): Promise<void>;
}

/**
 * Connects a backbone to a hub: the relay as role "backbone" (with the transport the dispatcher
 * uses), the model's live placement (`GET /api/models/:model/placement`, then long-polled with
 * `?since=<version>&wait=<s>`: each new version replaces the placement atomically, requests in
 * flight keep theirs), and periodic stats reports (`POST /api/models/:model/stats`, `seq`
 * increasing) from a source such as the bridge. Resolves once the first placement arrived and the
 * relay accepted the hello; a hub that cannot be reached, refuses the token or does not serve the
 * model rejects here. After that, failures of the poller and the reporter are retried with backoff
 * and counted in `metrics()`, never thrown.
 */
export async function connectHub(options: HubLinkOptions): Promise<HubLink> {
  checkHubOptions(options);
  throwIfAborted(options.signal);
  const { model, token, ca, signal } = options;
  const settings = await hubSettings(options);
  throwIfAborted(signal);
  const stop = new AbortController();
  const emit = emitter(options.onEvent);
  const http = new HubHttp({ base: settings.base, token, ca });
  const follower = new PlacementFollower({ http, model, settings, emit, stop: stop.signal });
  const reporter = new StatsReporter({
    http,
    settings,
    emit,
    nExpert: () => follower.current.nExpert,
    stop: stop.signal,
  });
  const quarantines = new QuarantineReporter({ http, settings, emit, stop: stop.signal });
  const bans = new BanList(http, emit);
  let relay: RelayConnection | undefined;
  let linkTransport: DirectTransport | RelayTransport | undefined;
  const loops: Promise<void>[] = [];
  let closing: Promise<void> | undefined;
  const close = (): Promise<void> => {
    closing ??= (async () => {
      closeOnAbort[Symbol.dispose]();
      // a proven lie in flight reaches the hub before the link goes (each has its own timeout)
      if (!signal?.aborted) await quarantines.settled();
      stop.abort(signal?.aborted ? abortReason(signal) : new AbortError("the hub link is closing"));
      follower.wake();
      for (const loop of loops) await loop;
      await reporter.final();
      if (linkTransport instanceof DirectTransport) await linkTransport.close();
      await relay?.close().catch(() => {});
      await http.close();
    })();
    return closing;
  };
  const closeOnAbort = onAbort(signal, () => void close());

  try {
    await follower.first();
    relay = await connectRelay(settings.relayUrl, {
      role: "backbone",
      id: settings.id,
      token,
      ...(ca !== undefined ? { ca } : {}),
      signal: stop.signal,
    });
  } catch (error) {
    await close();
    if (signal?.aborted) throw abortReason(signal);
    throw error;
  }
  const relayTransport = new RelayTransport(relay);
  const transport =
    options.direct === false
      ? relayTransport
      : directTransport(relayTransport, http, settings, emit, options);
  if (transport instanceof DirectTransport) {
    follower.onApply = (p) => transport.update(p.direct);
    transport.update(follower.current.direct);
  }
  relay.on((e) => {
    if (e.type !== "state" || stop.signal.aborted) return;
    emit({ type: "relay", state: e.state, ...(e.error ? { error: asError(e.error) } : {}) });
  });
  linkTransport = transport;
  loops.push(follower.run());
  if (settings.statsIntervalMs > 0) loops.push(reporter.run());
  return linkHandle({
    http,
    model,
    settings,
    relay,
    transport,
    relayTransport,
    follower,
    reporter,
    quarantines,
    bans,
    close,
  });
}

/** The direct-links transport over the relay one: tickets from the hub, events to the link's. */
function directTransport(
  fallback: RelayTransport,
  http: HubHttp,
  settings: HubSettings,
  emit: Emit,
  options: HubLinkOptions,
): DirectTransport {
  return new DirectTransport({
    fallback,
    id: settings.id,
    ...(options.directBackoff ? { backoff: options.directBackoff } : {}),
    ticket: async (worker, signal) => (await mintTicket(http, settings, worker, signal)).ticket,
    onEvent(e) {
      emit({
        type: "direct",
        worker: e.worker,
        state: e.type,
        ...(e.type === "linked" ? { url: e.url } : { retryInMs: e.retryInMs }),
        ...(e.type !== "linked" && e.error ? { error: e.error } : {}),
      });
    },
  });
}

/** A direct-link ticket for `worker` from the hub (`POST /api/direct/tickets`), with its expiry. */
async function mintTicket(
  http: HubHttp,
  settings: HubSettings,
  worker: string,
  signal: AbortSignal | undefined,
): Promise<DirectTicketJson> {
  const r = await http.request("api/direct/tickets", {
    method: "POST",
    body: { worker, backbone: settings.id },
    ...(signal ? { signal } : {}),
    headersTimeoutMs: REQUEST_TIMEOUT_MS,
    maxBodyBytes: 16 * 1024,
  });
  const j = r.json as { ticket?: unknown; exp?: unknown } | undefined;
  if (typeof j?.ticket !== "string") throw new InvalidArgumentError("the hub answered no ticket");
  // a hub older than `exp` in the answer: the ticket's own claim says when it expires
  const exp = typeof j.exp === "number" ? j.exp : ticketExpiry(j.ticket);
  return { ticket: j.ticket, exp };
}

/** The `exp` claim of a ticket (read, not verified: the worker verifies), else 0. */
function ticketExpiry(ticket: string): number {
  try {
    const claims = JSON.parse(Buffer.from(ticket.split(".")[1] ?? "", "base64url").toString("utf8")) as {
      exp?: unknown;
    };
    return typeof claims.exp === "number" ? claims.exp : 0;
  } catch {
    return 0;
  }
}

interface LinkParts {
  http: HubHttp;
  model: string;
  settings: HubSettings;
  relay: RelayConnection;
  transport: DirectTransport | RelayTransport;
  relayTransport: RelayTransport;
  follower: PlacementFollower;
  reporter: StatsReporter;
  quarantines: QuarantineReporter;
  bans: BanList;
  close(): Promise<void>;
}

/** The HubLink its owner holds: views of the parts, and their counters as one object. */
function linkHandle(parts: LinkParts): HubLink {
  const { model, settings, relay, follower, reporter, quarantines, close } = parts;
  return {
    url: settings.base.href,
    model,
    id: settings.id,
    relay,
    transport: parts.transport,
    relayTransport: parts.relayTransport,
    placement: () => follower.current.placement,
    current: () => follower.current,
    waitForPlacement: (predicate, opts = {}) => follower.waitFor(predicate, opts.signal),
    reportStatsFrom(next) {
      if (next !== undefined && typeof next?.takeStatsReport !== "function") {
        throw new InvalidArgumentError("reportStatsFrom needs an object with takeStatsReport()");
      }
      reporter.source = next;
    },
    async reportStats(opts = {}) {
      throwIfAborted(opts.signal);
      return reporter.report(opts.signal);
    },
    reportQuarantine: (event) => quarantines.report(event),
    directTicket: (worker, opts = {}) => mintTicket(parts.http, settings, worker, opts.signal),
    quarantined: (opts = {}) => parts.bans.read(opts.signal),
    metrics(): HubLinkMetrics {
      const current = follower.current;
      const p = follower.counters;
      const s = reporter.counters;
      return {
        model,
        id: settings.id,
        relay: relay.state,
        placementVersion: current.version,
        workers: current.workers.length,
        missingExperts: missingCount(current),
        placementUpdates: p.placementUpdates,
        polls: p.polls,
        pollErrors: p.pollErrors,
        statsAccepted: s.statsAccepted,
        statsDuplicates: s.statsDuplicates,
        statsErrors: s.statsErrors,
        statsDropped: s.statsDropped,
        ...quarantines.counters,
        banRefreshes: parts.bans.refreshes,
        banRefreshErrors: parts.bans.errors,
        ...(parts.transport instanceof DirectTransport ? { direct: parts.transport.counters() } : {}),
        ...(parts.bans.lastError ? { lastBanRefreshError: { ...parts.bans.lastError } } : {}),
        ...(p.lastPollError ? { lastPollError: { ...p.lastPollError } } : {}),
        ...(s.lastStatsAt !== undefined ? { lastStatsAt: s.lastStatsAt } : {}),
        ...(s.lastStatsError ? { lastStatsError: { ...s.lastStatsError } } : {}),
      };
    },
    close,
    [Symbol.asyncDispose]: close,
  };
}

/**
 * The hub's ban list as last read: a failed refresh keeps it (the bans stay in force), says so
 * (event, counter) and says what to do; it is read again at the next placement version.
 */
class BanList {
  refreshes = 0;
  errors = 0;
  lastError: HubLinkError | undefined;
  #last: string[] | undefined;

  constructor(
    private readonly http: HubHttp,
    private readonly emit: Emit,
  ) {}

  async read(signal: AbortSignal | undefined): Promise<string[]> {
    try {
      const list = await fetchQuarantined(this.http, signal);
      this.refreshes++;
      this.#last = list;
      return [...list];
    } catch (failure) {
      if (this.#last === undefined || signal?.aborted) throw failure;
      const error = asError(failure);
      this.errors++;
      this.lastError = stamp(error);
      this.emit({
        type: "error",
        source: "bans",
        error,
        hint:
          `could not refresh the hub's ban list (GET ${QUARANTINES_PATH}); keeping the last one ` +
          `(${this.#last.length} worker(s) banned). It is read again at the next placement change; ` +
          "if this repeats, check that the hub is reachable and that the backbone's token is still valid",
      });
      return [...this.#last];
    }
  }
}

/** The hub's ban list (ids only); none from a hub that has no list (404). */
async function fetchQuarantined(http: HubHttp, signal: AbortSignal | undefined): Promise<string[]> {
  try {
    const r = await http.request(QUARANTINES_PATH, {
      ...(signal ? { signal } : {}),
      headersTimeoutMs: REQUEST_TIMEOUT_MS,
      maxBodyBytes: 16 * 1024 * 1024,
    });
    return parseQuarantinesJson(r.json).quarantined.map((q) => q.worker);
  } catch (error) {
    if ((asError(error).details as { status?: unknown } | undefined)?.status === 404) return [];
    throw error;
  }
}

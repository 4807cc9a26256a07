import {
  type ActivationQuantizer,
  abortReason,
  DEFAULT_MAX_FRAME_BYTES,
  type ExpertHandler,
  type ExpertTransport,
  InvalidArgumentError,
  onAbort,
  throwIfAborted,
} from "@moeswarm/core";
import {
  DispatchMetrics,
  Liveness,
  type Placement,
  type QuantizingTransport,
  type QuarantineEvent,
  quantizingTransport,
  SpotCheck,
  type SpotCheckOptions,
  Verification,
  type VerificationEvent,
  type VerificationOptions,
} from "@moeswarm/dispatch";
import { BridgeCounters, type BridgeMetrics, type BridgeRequestStats } from "./bridge-metrics.js";
import { BridgeRequests } from "./bridge-requests.js";
import { connectHub, type HubLink } from "./hub-link.js";
import { checkHubOptions, type HubLinkOptions } from "./hub-options.js";
import {
  type BridgeNativeOptions,
  checkNativeOption,
  NativePlane,
  nativeDeadlineMs,
  nativeHedge,
  nativeOffReason,
} from "./native-bridge.js";
import { type BridgeSocket, PluginServer } from "./plugin-socket.js";
import { type RoutingCount, RoutingStats } from "./routing-stats.js";
import type { BridgeStatsReport } from "./stats-report.js";

/** The bridge's hub: its URL, a backbone token and the model id (see {@link HubLinkOptions}). */
export type BackboneHubOptions = Omit<HubLinkOptions, "signal">;

export interface BackboneBridgeOptions {
  socket: BridgeSocket;
  /**
   * The model id the plugin sends (`MOESWARM_MODEL`); default `hub.model`, else `placement.model`.
   * Others are refused.
   */
  model?: string;
  /**
   * Who serves which expert, with `transport`: a Placement, or a function asked at each request
   * (a live placement, such as `connectHub(...).placement`). Exclusive with `hub`.
   */
  placement?: Placement | (() => Placement);
  transport?: ExpertTransport;
  /**
   * Instead of `placement` + `transport`: the bridge connects to the hub (`connectHub`), follows
   * its live placement, sends the experts over its relay and reports routing statistics and
   * receipts to it; closing the bridge closes that link (after a final report).
   */
  hub?: BackboneHubOptions;
  /**
   * Activations to the workers in their vec_dot_type (q8_0 / q8_K: ~3.7x fewer bytes out, the same
   * result bits) where a layer allows it: `await loadActivationQuantizer(modelPath)` from
   * @moeswarm/worker-native (moeswarm-dispatcher does it unless `--wire-dtype f32`). Workers that
   * advertise the dtype (the placement's `dtypes`, from their hello) get it from the first request,
   * those that advertise others get f32; one that said nothing and cannot take them refuses once
   * and gets f32 from then on; the fallback and audits stay f32. Absent: f32.
   */
  wire?: ActivationQuantizer;
  /** Serves experts no live worker can (e.g. `createLocalFallback(modelPath).compute`). */
  fallback?: ExpertHandler;
  /** How long each worker request may take before failover (dispatch's default: 30 s). */
  deadlineMs?: number;
  /** Largest frame accepted from the plugin (default 64 MiB). */
  maxFrameBytes?: number;
  /** Closes the bridge when aborted. */
  signal?: AbortSignal;
  /** Called after every answered or failed request (for logs, the hub's statistics). */
  onStats?: (stats: BridgeRequestStats) => void;
  /**
   * Result spot-checking (dispatch's `SpotCheck`): this share of the workers' answers is
   * re-computed by `fallback` (else by another owner) before the combine; a worker that disagrees
   * is quarantined (`bridge.spotCheck.release(id)` lets it back). `SpotCheckOptions` without
   * `reference`: the fallback is the reference. Off by default.
   */
  spotCheck?: Omit<SpotCheckOptions, "reference">;
  /**
   * Hedged requests (dispatch's `hedgeMs`): a worker silent for this long gets a twin request to
   * a replica; the first answer wins. Off by default.
   */
  hedgeMs?: number;
  /**
   * Who the workers are (dispatch's `trust`). Default: "verify" when the transport is not
   * `trusted` (the hub's relay: strangers' devices): every part is answered by two owners and
   * compared, `fallback` is the third opinion on a mismatch, a liar is quarantined at once and
   * reported to the hub (with `hub`). "own": answers taken as they come, for a swarm of your own
   * devices only.
   */
  trust?: "verify" | "own";
  /** Called once per worker quarantined by verification (after it is reported to the hub, with `hub`). */
  onQuarantine?: (event: VerificationEvent) => void;
  /**
   * Trust "verify"'s audit of agreed answers against the fallback (dispatch's `Verification`):
   * each worker's first `probation` answers (default 8) and a sampled `auditRate` (default 0.02)
   * afterwards are re-computed locally before they are used. `{ probation: 0, auditRate: 0 }`
   * turns it off (redundancy alone, which two colluding owners of a part defeat).
   */
  verification?: Pick<VerificationOptions, "probation" | "auditRate" | "seed">;
  /**
   * The native data plane (default on): a plugin that says `native-hello` gets a table of the
   * remote layers it may send straight to a worker's native listener (TLS, the worker's pinned
   * certificate, a hub ticket), skipping the bridge, the relay and the hub; any failure there
   * sends that split down the bridge path, which computes the same bits. It acts only with `hub`,
   * under trust "own" and without spot checks, and only for layers one worker holds whole (see
   * docs/architecture.md section 4); the plugin's receipts are credited as the bridge's own.
   * false: never; an object tunes the plugin's deadline and the backoff.
   */
  native?: boolean | BridgeNativeOptions;
}

export interface BackboneBridge extends AsyncDisposable {
  /** What the plugin's `MOESWARM_BRIDGE` takes: `unix:/path` or `tcp:host:port`. */
  readonly address: string;
  /** With `hub`: the link to the hub (its live placement, relay connection and reporter). */
  readonly hub: HubLink | undefined;
  /** With `spotCheck`: the checker shared by every request (`quarantined()`, `release(id)`). */
  readonly spotCheck: SpotCheck | undefined;
  /**
   * Trust "verify"'s state, shared by every request: `stats()` (parts verified, disagreements,
   * third opinions, quarantines, cost), `quarantined()`, `release(id)`. Unused under trust "own".
   */
  readonly verification: Verification;
  /** Adaptive deadlines and circuit breaker (an untrusted transport only). */
  readonly liveness: Liveness | undefined;
  metrics(): BridgeMetrics;
  /** Routing counts since the start or the last report, by layer then expert. */
  routingCounts(): IterableIterator<RoutingCount>;
  /**
   * The counts since the previous report for the hub's coverage market, and starts a new span.
   * `nExpert`: the routed experts per layer (the length of each counts array).
   */
  takeStatsReport(options: { nExpert: number }): BridgeStatsReport;
  close(): Promise<void>;
}

function checkOptions(o: BackboneBridgeOptions): void {
  if (typeof o !== "object" || o === null)
    throw new InvalidArgumentError("serveBackboneBridge needs options");
  const s = o.socket;
  if (typeof s === "string") {
    if (s.length === 0 || Buffer.byteLength(s) > 107)
      throw new InvalidArgumentError("socket path must be 1..107 bytes (sun_path)");
  } else if (
    typeof s !== "object" ||
    s === null ||
    !Number.isInteger(s.port) ||
    s.port < 0 ||
    s.port > 65535
  ) {
    throw new InvalidArgumentError("socket must be a Unix socket path or {host, port}");
  }
  if (o.hub !== undefined) {
    if (o.placement !== undefined || o.transport !== undefined) {
      throw new InvalidArgumentError("give either hub or placement + transport, not both");
    }
    checkHubOptions(o.hub);
    if (o.model !== undefined && o.model !== o.hub.model) {
      throw new InvalidArgumentError(
        `model ${JSON.stringify(o.model)} differs from hub.model ${JSON.stringify(o.hub.model)}`,
      );
    }
  } else {
    const p = o.placement;
    if (!p || (typeof p !== "function" && typeof p.choose !== "function")) {
      throw new InvalidArgumentError(
        "placement must be a Placement or a function returning one (or give hub)",
      );
    }
    if (!o.transport || typeof o.transport.request !== "function")
      throw new InvalidArgumentError("transport must have request() (or give hub)");
  }
  if (o.fallback !== undefined && typeof o.fallback !== "function")
    throw new InvalidArgumentError("fallback must be a function");
  if (o.model !== undefined && (typeof o.model !== "string" || o.model.length === 0)) {
    throw new InvalidArgumentError("model must be a non-empty string");
  }
  const sc = o.spotCheck;
  if (sc !== undefined && (typeof sc !== "object" || sc === null || "reference" in sc)) {
    throw new InvalidArgumentError(
      "spotCheck must be { fraction, minCosine?, seed?, ... } (the fallback is its reference)",
    );
  }
  if (o.trust !== undefined && o.trust !== "verify" && o.trust !== "own") {
    throw new InvalidArgumentError(`trust must be "verify" or "own", got ${String(o.trust)}`);
  }
  if (o.onQuarantine !== undefined && typeof o.onQuarantine !== "function")
    throw new InvalidArgumentError("onQuarantine must be a function");
  const h = o.hedgeMs;
  if (h !== undefined && !(typeof h === "number" && Number.isFinite(h) && h >= 0)) {
    throw new InvalidArgumentError("hedgeMs must be a finite number >= 0");
  }
  checkNativeOption(o.native);
  const max = o.maxFrameBytes;
  if (max !== undefined && (!Number.isInteger(max) || max < 1024 || max > 0xffff_ffff)) {
    throw new InvalidArgumentError("maxFrameBytes must be an integer in 1024..2^32-1");
  }
}

/** Who serves which expert: the hub link's live placement, or the caller's (fixed or a function). */
function placementSource(options: BackboneBridgeOptions, link: HubLink | undefined): () => Placement {
  if (link) return link.placement;
  const given = options.placement;
  return typeof given === "function" ? given : () => given as Placement;
}

/**
 * Answers the `libggml-moeswarm` plugin: reads length-prefixed `dispatch` frames (one per remote
 * MoE layer and ubatch: the normed hidden rows, the top-k ids, the router weights) from each
 * connection, runs `dispatchExperts` in mode "each" (the combine in the router's slot order, as
 * llama.cpp adds its experts) and writes the combined output back as a `result` frame (mode
 * "sum"). A dispatch failure becomes an `error` frame, which makes that `llama_decode` fail.
 */
export async function serveBackboneBridge(options: BackboneBridgeOptions): Promise<BackboneBridge> {
  checkOptions(options);
  // SpotCheck validates the rest (InvalidArgumentError), before anything connects
  // a spot check's quarantine goes to the hub like verification's (assigned once the link exists)
  let reportSpot: ((event: QuarantineEvent) => void) | undefined;
  const verify = spotCheckOf(options, (event) => reportSpot?.(event));
  throwIfAborted(options.signal);
  const { signal } = options;
  // the hub first: a hub that refuses us must not leave a socket listening
  let refreshBans: (() => void) | undefined;
  let native: NativePlane | undefined;
  const userHubEvent = options.hub?.onEvent;
  const link = options.hub
    ? await connectHub({
        ...options.hub,
        ...(signal ? { signal } : {}),
        // each new placement may follow a ban by another backbone: the ban list is read again
        onEvent: (event) => {
          if (event.type === "placement") {
            refreshBans?.();
            native?.refresh();
          }
          userHubEvent?.(event);
        },
      })
    : undefined;
  if (link) reportSpot = (event) => void reportSpotQuarantine(link, event);
  const placement = placementSource(options, link);
  const model = options.model ?? link?.model ?? placement().model;
  const maxFrameBytes = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
  const controller = new AbortController();
  const counters = new BridgeCounters();
  const routing = new RoutingStats();
  const dispatchMetrics = new DispatchMetrics();
  const { transport, wire } = transportOf(options, link, placement);
  const onQuarantine = options.onQuarantine;
  // the fallback is the third opinion (dispatch uses it); every proven lie goes to the hub
  const verification = new Verification({
    ...options.verification,
    onQuarantine: (event) => {
      void link?.reportQuarantine(event);
      native?.refresh();
      onQuarantine?.(event);
    },
  });
  // the hub's quarantines apply here from the start: a fresh process never trusts a known liar
  // a ban read later also takes its worker off the native table
  if (link) refreshBans = await HubBans.seed(link, verification, controller.signal, () => native?.refresh());
  const liveness = transport.trusted === true ? undefined : new Liveness();
  const excluded = () => excludedNow(verification, liveness, verify);
  const parts = { link, transport, routing, excluded, liveness };
  native = nativePlaneOf(options, { ...parts, signal: controller.signal });
  const requests = new BridgeRequests({
    model,
    placement,
    transport,
    fallback: options.fallback,
    verify,
    verification,
    liveness,
    trust: options.trust,
    hedgeMs: options.hedgeMs,
    deadlineMs: options.deadlineMs,
    maxFrameBytes,
    signal: controller.signal,
    metrics: dispatchMetrics,
    counters,
    routing,
    onStats: options.onStats,
    native,
  });
  const plugins = new PluginServer({
    maxFrameBytes,
    counters,
    onPayload: (payload, conn) => requests.onPayload(payload, conn),
  });
  const address = await listenOrClose(plugins, options.socket, link);

  let closing: Promise<void> | undefined;
  const close = (): Promise<void> => {
    closing ??= (async () => {
      closeOnAbort[Symbol.dispose]();
      controller.abort(signal?.aborted ? abortReason(signal) : new Error("the bridge is closing"));
      await plugins.close();
      // after the last answer: the final report holds everything the bridge did
      await link?.close();
    })();
    return closing;
  };
  const closeOnAbort = onAbort(signal, () => void close());
  if (signal?.aborted) {
    await close();
    throw abortReason(signal);
  }

  const bridge: BackboneBridge = {
    address,
    hub: link,
    spotCheck: verify,
    verification,
    liveness,
    metrics: () =>
      counters.snapshot({
        connections: plugins.connections,
        dispatch: dispatchMetrics.snapshot(),
        spotCheck: verify?.snapshot(),
        verification: verification.stats(),
        liveness: liveness?.snapshot(),
        hub: link?.metrics(),
        wire: wire?.metrics(),
        native: native.metrics(),
      }),
    routingCounts: () => routing.counts(),
    takeStatsReport: ({ nExpert }: { nExpert: number }): BridgeStatsReport => routing.takeReport(nExpert),
    close,
    [Symbol.asyncDispose]: close,
  };
  link?.reportStatsFrom(bridge);
  // tickets before the plugin's hello: its first splits can go native
  native.refresh();
  return bridge;
}

/** The plugin socket's address; a socket that cannot listen closes the hub link first. */
async function listenOrClose(
  plugins: PluginServer,
  socket: BridgeSocket,
  link: HubLink | undefined,
): Promise<string> {
  try {
    return await plugins.listen(socket);
  } catch (failure) {
    await link?.close();
    throw failure;
  }
}

/** The bridge's SpotCheck (with `spotCheck`): the fallback its reference, quarantines reported. */
function spotCheckOf(
  options: BackboneBridgeOptions,
  report: (event: QuarantineEvent) => void,
): SpotCheck | undefined {
  if (!options.spotCheck) return undefined;
  const userSpot = options.spotCheck.onQuarantine;
  return new SpotCheck({
    ...options.spotCheck,
    ...(options.fallback ? { reference: options.fallback } : {}),
    onQuarantine: (event) => {
      report(event);
      userSpot?.(event);
    },
  });
}

/** Workers the bridge sends nothing to now: quarantined (verification, spot checks), circuit open. */
function excludedNow(
  verification: Verification,
  liveness: Liveness | undefined,
  spot: SpotCheck | undefined,
): Set<string> {
  const out = new Set(verification.excluded());
  for (const more of [liveness?.excluded(), spot?.excluded()]) if (more) for (const id of more) out.add(id);
  return out;
}

/** The native plane: on under trust "own" with a hub and no spot checks, else one that says why not. */
function nativePlaneOf(
  options: BackboneBridgeOptions,
  parts: {
    link: HubLink | undefined;
    transport: ExpertTransport;
    routing: RoutingStats;
    signal: AbortSignal;
    excluded: () => Set<string>;
    /** Dispatch's adaptive deadlines and hedge: the plugin hedges with the same rule. */
    liveness: Liveness | undefined;
  },
): NativePlane {
  const { link } = parts;
  const trust = options.trust ?? (parts.transport.trusted === true ? "own" : "verify");
  const off = nativeOffReason({
    native: options.native,
    hub: link !== undefined,
    trust,
    spotCheck: options.spotCheck !== undefined && options.spotCheck.fraction > 0,
  });
  const deadlineMs = nativeDeadlineMs(options.native, options.hedgeMs);
  const backoff = typeof options.native === "object" ? options.native.backoff : undefined;
  return new NativePlane({
    // an off plane's (empty) table still names someone: the plugin refuses a table without a backbone
    backbone: link?.id ?? "local",
    deadlineMs,
    routing: parts.routing,
    off,
    table:
      off === undefined && link
        ? {
            backbone: link.id,
            deadlineMs,
            // the plugin hedges a silent primary to its alt as dispatch hedges to a replica
            ...nativeHedge(options.hedgeMs, deadlineMs, parts.liveness),
            view: () => link.current(),
            exclude: parts.excluded,
            ticket: (worker, signal) => link.directTicket(worker, { signal }),
            signal: parts.signal,
            ...(backoff ? { backoff } : {}),
          }
        : undefined,
  });
}

/** The workers' transport: with `wire`, wrapped so that activations travel as q8 where exact. */
function transportOf(
  options: BackboneBridgeOptions,
  link: HubLink | undefined,
  placement: () => Placement,
): { transport: ExpertTransport; wire: QuantizingTransport | undefined } {
  const plain = link?.transport ?? (options.transport as ExpertTransport);
  // the fallback and audits call no transport: they stay f32; the dtypes each worker advertised
  // come with the placement (the hub's, from their hello)
  const wire = options.wire
    ? quantizingTransport(plain, options.wire, { dtypes: (owner) => placement().dtypes(owner) })
    : undefined;
  return { transport: wire ?? plain, wire };
}

/** A spot check's quarantine, reported to the hub with its evidence (one without it is not sent). */
function reportSpotQuarantine(link: HubLink, e: QuarantineEvent): Promise<void> | undefined {
  if (e.requestDigest === undefined || e.expected === undefined || e.got === undefined) return undefined;
  return link.reportQuarantine({
    worker: e.worker,
    layer: e.layer,
    experts: e.experts,
    reason: e.reason,
    requestDigest: e.requestDigest,
    expected: e.expected,
    got: e.got,
    decidedBy: e.decidedBy ?? "the reference",
    at: Math.floor(Date.now()),
  });
}

/**
 * The hub's ban list applied to the bridge's Verification: at start and after each new placement
 * (one read at a time). A ban the admin lifted ends here too; quarantines this bridge proved
 * itself stay.
 */
class HubBans {
  readonly #fromHub = new Set<string>();
  #running: Promise<void> | undefined;
  #again = false;

  constructor(
    private readonly link: HubLink,
    private readonly verification: Verification,
    private readonly signal: AbortSignal,
    private readonly onApplied: () => void,
  ) {}

  /** Applies the hub's list now (closing the link when it cannot be read); returns the refresh. */
  static async seed(
    link: HubLink,
    verification: Verification,
    signal: AbortSignal,
    onApplied: () => void,
  ): Promise<() => void> {
    const bans = new HubBans(link, verification, signal, onApplied);
    try {
      await bans.refresh();
    } catch (failure) {
      await link.close();
      throw failure;
    }
    return () => void bans.refresh().catch(() => {});
  }

  refresh(): Promise<void> {
    if (this.#running) {
      this.#again = true;
      return this.#running;
    }
    this.#running = (async () => {
      try {
        do {
          this.#again = false;
          if (this.signal.aborted) return;
          this.#apply(await this.link.quarantined({ signal: this.signal }));
          this.onApplied();
        } while (this.#again);
      } finally {
        this.#running = undefined;
      }
    })();
    return this.#running;
  }

  #apply(banned: readonly string[]): void {
    const now = new Set(banned);
    for (const id of now) {
      if (this.verification.isQuarantined(id)) continue;
      this.verification.quarantine(id);
      this.#fromHub.add(id);
    }
    for (const id of [...this.#fromHub]) {
      if (now.has(id)) continue;
      this.#fromHub.delete(id);
      this.verification.release(id);
    }
  }
}

import { randomBytes } from "node:crypto";
import { hostname } from "node:os";
import {
  AbortError,
  abortReason,
  HubError,
  InvalidArgumentError,
  isMoeswarmError,
  type MoeswarmError,
  throwIfAborted,
} from "@moeswarm/core";
import { type MissingExperts, Placement } from "@moeswarm/dispatch";
import {
  backoffDelay,
  connectRelay,
  type RelayConnection,
  type RelayState,
  RelayTransport,
} from "@moeswarm/relay-client";
import { type HubCa, HubHttp, type HubToken, isTransient, tokenValue } from "./hub-http.js";
import type { BridgeStatsReport, StatsSource } from "./stats-report.js";

export type { HubCa, HubToken } from "./hub-http.js";

/** What a backbone needs of the hub: its URL, a backbone token and the model id. */
export interface HubLinkOptions {
  /** The hub's base URL (`https://hub.example`, `http://127.0.0.1:8080`, or one with a path prefix). */
  url: string | URL;
  /** A backbone token (or a function asked before every request and relay connect, to refresh it). */
  token: HubToken;
  /** The model id on the hub (`GET /api/models`). */
  model: string;
  /** PEM CA certificate(s) to trust for a self-hosted hub (https and wss). */
  ca?: HubCa;
  /**
   * This backbone's relay id and the `backbone` of its reports (1..128 bytes). Default: the id the
   * token is bound to, else `<hostname>-<pid>-<random>`.
   */
  id?: string;
  /** The relay's URL (default: the hub's URL + `relay`, with ws/wss). */
  relayUrl?: string | URL;
  /** How often routing statistics and receipts go to the hub, ms (default 10000; 0: only on demand and at close). */
  statsIntervalMs?: number;
  /** How long one placement long-poll may wait at the hub, s (default 30; the hub caps it, 60 by default). */
  pollWaitS?: number;
  /** Backoff of the poller and the reporter after a failure, ms (default 500 doubling up to 30000). */
  retryMinMs?: number;
  retryMaxMs?: number;
  /** How long close() waits for the final report, ms (default 5000). */
  closeTimeoutMs?: number;
  /** Placement changes, reports and (retried) errors, for logs. Exceptions thrown here are ignored. */
  onEvent?: (event: HubLinkEvent) => void;
  /** Aborting it closes the link (and rejects connectHub while it is connecting). */
  signal?: AbortSignal;
}

/** One version of the hub's live placement, as the link uses it. Never changed once published. */
export interface HubPlacement {
  /** The hub's placement version (it only grows). */
  readonly version: number;
  readonly placement: Placement;
  /** The model's MoE layers. */
  readonly layers: readonly number[];
  /** Routed experts per layer. */
  readonly nExpert: number;
  /** Live, non-draining workers with a slice of the model. */
  readonly workers: readonly string[];
  /** Experts nobody serves (they go to the local fallback, or fail the decode without one). */
  readonly missing: readonly MissingExperts[];
  /** When this version arrived (epoch ms). */
  readonly receivedAt: number;
}

/** The hub's answer to a report. */
export interface StatsOutcome {
  seq: number;
  /** false: the hub had this seq already (a retry whose first try arrived); nothing counted twice. */
  accepted: boolean;
  /** Workers credited with their receipts, and receipts for workers the hub does not know. */
  credited: string[];
  ignored: string[];
}

export type HubLinkEvent =
  | { type: "placement"; version: number; workers: string[]; missing: number }
  | ({ type: "stats" } & StatsOutcome)
  /** The relay connection changed state (it reconnects by itself after a drop). */
  | { type: "relay"; state: RelayState; error?: MoeswarmError }
  /** A poll or a report failed; it is retried after `retryInMs` (a report the hub refused as invalid is dropped). */
  | { type: "error"; source: "poll" | "stats"; error: MoeswarmError; retryInMs?: number; dropped?: boolean };

export interface HubLinkError {
  code: string;
  message: string;
  /** Epoch ms. */
  at: number;
}

/** The link's counters: a plain object (JSON-safe). */
export interface HubLinkMetrics {
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
}

export interface HubLink extends AsyncDisposable {
  /** The hub's base URL. */
  readonly url: string;
  readonly model: string;
  readonly id: string;
  /** The backbone's relay connection (reconnects by itself). */
  readonly relay: RelayConnection;
  /** `dispatchExperts`' transport over the relay: the placement's worker ids are relay ids. */
  readonly transport: RelayTransport;
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
  metrics(): HubLinkMetrics;
  /** Stops the poller and the reporter, sends a final report, closes the relay connection. */
  close(): Promise<void>;
}

const MODEL_ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
const U32_MAX = 0xffff_ffff;
const MAX_PLACEMENT_BYTES = 64 * 1024 * 1024;
const MAX_ANSWER_BYTES = 1024 * 1024;
const REQUEST_TIMEOUT_MS = 30_000;

function invalid(message: string): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", message);
}

function optionalMs(name: string, v: unknown, min: number, max: number): void {
  if (v !== undefined && (typeof v !== "number" || !Number.isFinite(v) || v < min || v > max)) {
    throw invalid(`hub.${name} must be a number in ${min}..${max}`);
  }
}

function httpBase(url: string | URL): URL {
  let u: URL;
  try {
    u = new URL(url);
  } catch (error) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `hub.url ${JSON.stringify(String(url))} is not a URL`,
      {
        cause: error,
      },
    );
  }
  if (u.protocol !== "http:" && u.protocol !== "https:") throw invalid("hub.url must be an http(s) URL");
  if (u.username || u.password) throw invalid("hub.url must not carry credentials (use hub.token)");
  u.search = "";
  u.hash = "";
  if (!u.pathname.endsWith("/")) u.pathname += "/";
  return u;
}

/** Checks the options synchronously (a typed error before anything connects). */
export function checkHubOptions(o: Omit<HubLinkOptions, "signal" | "onEvent"> | undefined): void {
  if (typeof o !== "object" || o === null) throw invalid("hub must be {url, token, model}");
  httpBase(o.url);
  if (o.relayUrl !== undefined) {
    let r: URL;
    try {
      r = new URL(o.relayUrl);
    } catch {
      throw invalid("hub.relayUrl is not a URL");
    }
    if (r.protocol !== "ws:" && r.protocol !== "wss:") throw invalid("hub.relayUrl must be a ws(s) URL");
  }
  if (!((typeof o.token === "string" && o.token.length > 0) || typeof o.token === "function")) {
    throw invalid("hub.token must be a non-empty string or a function");
  }
  if (typeof o.model !== "string" || !MODEL_ID.test(o.model)) {
    throw invalid("hub.model must be a model id ([A-Za-z0-9][A-Za-z0-9._-]{0,127})");
  }
  if (
    o.id !== undefined &&
    (typeof o.id !== "string" || o.id.length === 0 || Buffer.byteLength(o.id) > 128)
  ) {
    throw invalid("hub.id must be a string of 1..128 bytes");
  }
  const ca = o.ca;
  const caItem = (v: unknown) => typeof v === "string" || v instanceof Uint8Array;
  if (ca !== undefined && !caItem(ca) && !(Array.isArray(ca) && ca.every(caItem))) {
    throw invalid("hub.ca must be PEM text or bytes, or an array of them");
  }
  optionalMs("statsIntervalMs", o.statsIntervalMs, 0, 86_400_000);
  optionalMs("pollWaitS", o.pollWaitS, 0, 3600);
  if (o.pollWaitS !== undefined && !Number.isInteger(o.pollWaitS))
    throw invalid("hub.pollWaitS must be whole seconds");
  optionalMs("retryMinMs", o.retryMinMs, 1, 3_600_000);
  optionalMs("retryMaxMs", o.retryMaxMs, 1, 3_600_000);
  optionalMs("closeTimeoutMs", o.closeTimeoutMs, 0, 600_000);
}

/** The id a token is bound to (`sub`), read without verifying it (the hub verifies). */
function boundId(token: string): string | undefined {
  const parts = token.split(".");
  if (parts.length !== 3 || parts[0] !== "msw1") return undefined;
  try {
    const claims = JSON.parse(Buffer.from(parts[1]!, "base64url").toString("utf8")) as { sub?: unknown };
    return typeof claims.sub === "string" && claims.sub.length > 0 ? claims.sub : undefined;
  } catch {
    return undefined;
  }
}

function asError(error: unknown): MoeswarmError {
  if (isMoeswarmError(error)) return error;
  return new HubError("MOESWARM_HUB_INTERNAL", error instanceof Error ? error.message : String(error), {
    cause: error,
  });
}

function badAnswer(message: string, cause?: unknown): HubError {
  return new HubError("MOESWARM_HUB_INTERNAL", `the hub's placement: ${message}`, { cause });
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** Checks the hub's placement JSON and builds the dispatcher's Placement from it. */
export function parseHubPlacement(json: unknown, model: string, receivedAt = Date.now()): HubPlacement {
  if (!isObject(json)) throw badAnswer("not a JSON object");
  if (json.model !== model)
    throw badAnswer(`model ${JSON.stringify(json.model)}, expected ${JSON.stringify(model)}`);
  const version = json.version;
  if (!Number.isSafeInteger(version) || (version as number) < 0) throw badAnswer("version is not an integer");
  const layers = json.layers;
  if (!Array.isArray(layers) || !layers.every((l) => Number.isInteger(l) && l >= 0 && l <= 0x7fff_ffff)) {
    throw badAnswer("layers is not a list of layer indices");
  }
  const nExpert = json.experts;
  if (!Number.isInteger(nExpert) || (nExpert as number) < 1 || (nExpert as number) > 65_536) {
    throw badAnswer("experts is not an expert count in 1..65536");
  }
  if (!Array.isArray(json.registrations)) throw badAnswer("registrations is not a list");
  let placement: Placement;
  try {
    placement = Placement.fromRegistrations(json.registrations as never[], { model });
  } catch (error) {
    throw badAnswer((error as Error).message, error);
  }
  return {
    version: version as number,
    placement,
    layers: [...(layers as number[])],
    nExpert: nExpert as number,
    workers: placement.workers(),
    missing: placement.missing({ layers: layers as number[], nExpert: nExpert as number }),
    receivedAt,
  };
}

/** Waits `ms`; resolves false (never rejects) when the signal aborts first. */
function sleep(ms: number, signal: AbortSignal): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal.aborted) {
      resolve(false);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      resolve(false);
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve(true);
    }, ms);
    signal.addEventListener("abort", onAbort, { once: true });
  });
}

/** Aborted when either is (or after `ms`); `dispose` removes the listeners and the timer. */
function combine(
  a: AbortSignal | undefined,
  b: AbortSignal | undefined,
  ms?: number,
): { signal: AbortSignal; dispose(): void } {
  const controller = new AbortController();
  const onA = () => controller.abort(a!.reason);
  const onB = () => controller.abort(b!.reason);
  if (a?.aborted) onA();
  else if (b?.aborted) onB();
  a?.addEventListener("abort", onA, { once: true });
  b?.addEventListener("abort", onB, { once: true });
  const timer =
    ms === undefined
      ? undefined
      : setTimeout(() => controller.abort(new AbortError("MOESWARM_ABORTED", `gave up after ${ms} ms`)), ms);
  return {
    signal: controller.signal,
    dispose() {
      clearTimeout(timer);
      a?.removeEventListener("abort", onA);
      b?.removeEventListener("abort", onB);
    },
  };
}

const clampU32 = (v: number) => Math.min(U32_MAX, Math.max(0, Math.round(v)));

/** The hub's stats body, bounded to what it accepts. */
function reportBody(seq: number, backbone: string, r: BridgeStatsReport): Record<string, unknown> {
  const counts: Record<string, number[]> = {};
  for (const [layer, row] of Object.entries(r.counts)) counts[layer] = row.map(clampU32);
  const receipts: Record<string, { expertTokens: number; ms?: number }> = {};
  for (const [id, rec] of Object.entries(r.receipts)) {
    receipts[id] = {
      expertTokens: clampU32(rec.expertTokens),
      ...(rec.ms !== undefined && Number.isFinite(rec.ms)
        ? { ms: Math.min(3_600_000, Math.max(0, rec.ms)) }
        : {}),
    };
  }
  return {
    seq,
    backbone,
    tokens: clampU32(r.tokens),
    ms: Math.min(86_400_000, Math.max(0.001, r.ms)),
    counts,
    receipts,
  };
}

function isIdle(r: BridgeStatsReport): boolean {
  return r.tokens === 0 && Object.keys(r.counts).length === 0 && Object.keys(r.receipts).length === 0;
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
  const { model, token, ca, signal, onEvent } = options;
  const base = httpBase(options.url);
  const relayUrl =
    options.relayUrl !== undefined
      ? new URL(options.relayUrl).href
      : new URL("relay", `${base.protocol === "https:" ? "wss" : "ws"}://${base.host}${base.pathname}`).href;
  const id =
    options.id ??
    boundId(typeof token === "string" ? token : await tokenValue(token)) ??
    `${hostname().slice(0, 80)}-${process.pid}-${randomBytes(3).toString("hex")}`;
  throwIfAborted(signal);
  const statsIntervalMs = options.statsIntervalMs ?? 10_000;
  const pollWaitS = options.pollWaitS ?? 30;
  const closeTimeoutMs = options.closeTimeoutMs ?? 5000;
  const retryMin = options.retryMinMs ?? 500;
  const retry = {
    initialDelayMs: retryMin,
    maxDelayMs: Math.max(retryMin, options.retryMaxMs ?? 30_000),
    factor: 2,
    jitter: 0.5,
    maxAttempts: Number.POSITIVE_INFINITY,
  };
  const modelPath = `api/models/${encodeURIComponent(model)}`;

  const stop = new AbortController();
  const onAbort = () => void close();
  signal?.addEventListener("abort", onAbort, { once: true });
  const http = new HubHttp({ base, token, ca });
  let relay: RelayConnection | undefined;

  const emit = (event: HubLinkEvent) => {
    try {
      onEvent?.(event);
    } catch {
      // a logger's failure is not the link's
    }
  };

  let current: HubPlacement;
  const waiters = new Set<() => void>();
  const m = {
    placementUpdates: 0,
    polls: 0,
    pollErrors: 0,
    lastPollError: undefined as HubLinkError | undefined,
    statsAccepted: 0,
    statsDuplicates: 0,
    statsErrors: 0,
    statsDropped: 0,
    lastStatsAt: undefined as number | undefined,
    lastStatsError: undefined as HubLinkError | undefined,
  };
  const stamp = (e: MoeswarmError): HubLinkError => ({ code: e.code, message: e.message, at: Date.now() });

  const apply = (next: HubPlacement, first: boolean) => {
    current = next;
    if (!first) m.placementUpdates++;
    for (const w of [...waiters]) w();
    emit({
      type: "placement",
      version: next.version,
      workers: [...next.workers],
      missing: missingCount(next),
    });
  };

  const fetchPlacement = async (since: number | undefined, requestSignal: AbortSignal) => {
    const query = since === undefined ? "" : `?since=${since}&wait=${pollWaitS}`;
    const r = await http.request(`${modelPath}/placement${query}`, {
      signal: requestSignal,
      headersTimeoutMs: (since === undefined ? 0 : pollWaitS * 1000) + REQUEST_TIMEOUT_MS,
      maxBodyBytes: MAX_PLACEMENT_BYTES,
    });
    return r.status === 304 ? undefined : parseHubPlacement(r.json, model);
  };

  let closed = false;
  let closing: Promise<void> | undefined;
  let pollLoop: Promise<void> = Promise.resolve();
  let reportLoop: Promise<void> = Promise.resolve();
  const close = (): Promise<void> => {
    closing ??= (async () => {
      closed = true;
      signal?.removeEventListener("abort", onAbort);
      stop.abort(
        signal?.aborted ? abortReason(signal) : new AbortError("MOESWARM_ABORTED", "the hub link is closing"),
      );
      for (const w of [...waiters]) w();
      await pollLoop;
      await reportLoop;
      if (source) {
        const bounded = combine(undefined, undefined, closeTimeoutMs);
        try {
          await serialize(() => flush(bounded.signal, true));
        } catch {
          // counted in the metrics; a hub that is gone must not hold the backbone's shutdown
        } finally {
          bounded.dispose();
        }
      }
      await relay?.close().catch(() => {});
      await http.close();
    })();
    return closing;
  };

  // --- stats --------------------------------------------------------------------------------------
  let source: StatsSource | undefined;
  let lastSeq = 0;
  let pending: { seq: number; body: Record<string, unknown> } | undefined;
  let lastSentIdle = true;
  let chain: Promise<unknown> = Promise.resolve();
  const serialize = <T>(op: () => Promise<T>): Promise<T> => {
    const run = chain.then(op, op);
    chain = run.catch(() => {});
    return run;
  };

  // The wall clock in ms (or one more than the last): a restarted backbone with the same id
  // continues above the seq its previous process reached, so the hub does not take its first
  // reports for retries.
  const take = (skipIdle: boolean): boolean => {
    if (!source) return false;
    let r: BridgeStatsReport;
    try {
      r = source.takeStatsReport({ nExpert: current.nExpert });
    } catch (error) {
      const e = asError(error);
      m.statsErrors++;
      m.statsDropped++;
      m.lastStatsError = stamp(e);
      emit({ type: "error", source: "stats", error: e, dropped: true });
      throw e;
    }
    const idle = isIdle(r);
    // one idle report brings the hub's tokens/s to 0; more of them would say nothing new
    if (skipIdle && idle && lastSentIdle) return false;
    lastSeq = Math.max(lastSeq + 1, Date.now());
    pending = { seq: lastSeq, body: reportBody(lastSeq, id, r) };
    lastSentIdle = idle;
    return true;
  };

  /** Sends the pending report; throws (leaving it pending when worth retrying) on failure. */
  const send = async (requestSignal: AbortSignal): Promise<StatsOutcome> => {
    const p = pending!;
    try {
      const r = await http.request(`${modelPath}/stats`, {
        method: "POST",
        body: p.body,
        signal: requestSignal,
        headersTimeoutMs: REQUEST_TIMEOUT_MS,
        maxBodyBytes: MAX_ANSWER_BYTES,
      });
      const a = (isObject(r.json) ? r.json : {}) as {
        accepted?: unknown;
        credited?: unknown;
        ignored?: unknown;
      };
      const outcome: StatsOutcome = {
        seq: p.seq,
        accepted: a.accepted !== false,
        credited: Array.isArray(a.credited)
          ? a.credited.filter((x): x is string => typeof x === "string")
          : [],
        ignored: Array.isArray(a.ignored) ? a.ignored.filter((x): x is string => typeof x === "string") : [],
      };
      pending = undefined;
      if (outcome.accepted) m.statsAccepted++;
      else m.statsDuplicates++;
      m.lastStatsAt = Date.now();
      emit({ type: "stats", ...outcome });
      return outcome;
    } catch (error) {
      // an abort is no failure of the hub: the report stays pending, and a later try (the final
      // report at close) sends it again with the same seq, so the hub never counts it twice
      if (requestSignal.aborted) throw abortReason(requestSignal);
      const e = asError(error);
      m.statsErrors++;
      m.lastStatsError = stamp(e);
      const dropped = !isTransient(e) && !e.code.startsWith("MOESWARM_AUTH_");
      if (dropped) {
        m.statsDropped++;
        pending = undefined;
      }
      emit({ type: "error", source: "stats", error: e, ...(dropped ? { dropped } : {}) });
      throw e;
    }
  };

  /** The pending report (a failed one), then what the source has now. */
  const flush = async (requestSignal: AbortSignal, skipIdle: boolean): Promise<StatsOutcome | undefined> => {
    if (!source) return undefined;
    let outcome: StatsOutcome | undefined;
    if (pending) outcome = await send(requestSignal);
    if (take(skipIdle)) outcome = await send(requestSignal);
    return outcome;
  };

  const runReports = async () => {
    let attempt = 0;
    while (!closed) {
      const delay = attempt === 0 ? statsIntervalMs : backoffDelay(attempt, retry);
      if (!(await sleep(delay, stop.signal))) return;
      try {
        await serialize(async () => {
          if (!pending && !take(true)) return;
          await send(stop.signal);
        });
        attempt = 0;
      } catch {
        if (closed) return;
        attempt = pending ? attempt + 1 : 0;
      }
    }
  };

  // --- placement ------------------------------------------------------------------------------------
  const runPolls = async () => {
    let attempt = 0;
    while (!closed) {
      try {
        const next = await fetchPlacement(current.version, stop.signal);
        m.polls++;
        attempt = 0;
        if (next && next.version !== current.version) apply(next, false);
        else if (next && !(await sleep(1000, stop.signal))) return; // a hub that does not long-poll
      } catch (error) {
        if (closed) return;
        const e = asError(error);
        m.pollErrors++;
        m.lastPollError = stamp(e);
        attempt++;
        const retryInMs = backoffDelay(attempt, retry);
        emit({ type: "error", source: "poll", error: e, retryInMs });
        if (!(await sleep(retryInMs, stop.signal))) return;
      }
    }
  };

  try {
    const first = await fetchPlacement(undefined, stop.signal);
    if (!first) throw badAnswer("304 without a version asked for");
    apply(first, true);
    relay = await connectRelay(relayUrl, {
      role: "backbone",
      id,
      token,
      ...(ca !== undefined ? { ca } : {}),
      signal: stop.signal,
    });
  } catch (error) {
    await close();
    if (signal?.aborted) throw abortReason(signal);
    throw error;
  }
  const transport = new RelayTransport(relay);
  relay.on((e) => {
    if (e.type !== "state" || closed) return;
    emit({ type: "relay", state: e.state, ...(e.error ? { error: asError(e.error) } : {}) });
  });
  pollLoop = runPolls();
  if (statsIntervalMs > 0) reportLoop = runReports();
  const conn = relay;

  return {
    url: base.href,
    model,
    id,
    relay: conn,
    transport,
    placement: () => current.placement,
    current: () => current,
    waitForPlacement(predicate, opts = {}) {
      return new Promise<HubPlacement>((resolve, reject) => {
        const s = opts.signal;
        const done = (error?: unknown) => {
          waiters.delete(check);
          s?.removeEventListener("abort", onAbortWait);
          if (error !== undefined) reject(error);
          else resolve(current);
        };
        const onAbortWait = () => done(abortReason(s!));
        const check = () => {
          if (closed) done(new AbortError("MOESWARM_ABORTED", "the hub link is closed"));
          else {
            try {
              if (predicate(current)) done();
            } catch (error) {
              done(error);
            }
          }
        };
        if (s?.aborted) {
          reject(abortReason(s));
          return;
        }
        s?.addEventListener("abort", onAbortWait, { once: true });
        waiters.add(check);
        check();
      });
    },
    reportStatsFrom(next) {
      if (next !== undefined && typeof next?.takeStatsReport !== "function") {
        throw invalid("reportStatsFrom needs an object with takeStatsReport()");
      }
      source = next;
    },
    async reportStats(opts = {}) {
      throwIfAborted(opts.signal);
      if (closed) throw new AbortError("MOESWARM_ABORTED", "the hub link is closed");
      const linked = combine(opts.signal, stop.signal);
      try {
        return await serialize(() => flush(linked.signal, false));
      } finally {
        linked.dispose();
      }
    },
    metrics(): HubLinkMetrics {
      return {
        model,
        id,
        relay: conn.state,
        placementVersion: current.version,
        workers: current.workers.length,
        missingExperts: missingCount(current),
        placementUpdates: m.placementUpdates,
        polls: m.polls,
        pollErrors: m.pollErrors,
        statsAccepted: m.statsAccepted,
        statsDuplicates: m.statsDuplicates,
        statsErrors: m.statsErrors,
        statsDropped: m.statsDropped,
        ...(m.lastPollError ? { lastPollError: { ...m.lastPollError } } : {}),
        ...(m.lastStatsAt !== undefined ? { lastStatsAt: m.lastStatsAt } : {}),
        ...(m.lastStatsError ? { lastStatsError: { ...m.lastStatsError } } : {}),
      };
    },
    close,
    [Symbol.asyncDispose]: close,
  };
}

function missingCount(p: HubPlacement): number {
  return p.missing.reduce((s, x) => s + x.count, 0);
}

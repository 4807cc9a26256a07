import { randomBytes } from "node:crypto";
import { hostname } from "node:os";
import { InvalidArgumentError } from "@moeswarm/core";
import type { ReconnectOptions } from "@moeswarm/relay-client";
import type { HubLinkEvent } from "./hub-events.js";
import { type HubCa, type HubToken, tokenValue } from "./hub-http.js";

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
  /**
   * Direct links (default true): requests to a worker that advertises endpoints go straight to
   * it (its certificate pinned by the hub's fingerprint, a hub-signed ticket as the hello), the
   * relay carrying the rest and whatever a direct link cannot. false: everything over the relay.
   */
  direct?: boolean;
  /** Back-off between dials to one worker's direct endpoint after a failure (default 1 s doubling to 60 s). */
  directBackoff?: ReconnectOptions;
  /** Placement changes, reports and (retried) errors, for logs. Exceptions thrown here are ignored. */
  onEvent?: (event: HubLinkEvent) => void;
  /** Aborting it closes the link (and rejects connectHub while it is connecting). */
  signal?: AbortSignal;
}

/** The options with their defaults applied, as the link's parts use them. */
export interface HubSettings {
  /** The hub's base URL, ending in `/`. */
  base: URL;
  relayUrl: string;
  id: string;
  /** `api/models/<model>`, relative to `base`. */
  modelPath: string;
  statsIntervalMs: number;
  pollWaitS: number;
  closeTimeoutMs: number;
  /** The backoff of the poller and the reporter (relay-client's, never giving up). */
  retry: Required<ReconnectOptions>;
}

const MODEL_ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

function optionalMs(name: string, v: unknown, min: number, max: number): void {
  if (v !== undefined && (typeof v !== "number" || !Number.isFinite(v) || v < min || v > max)) {
    throw new InvalidArgumentError(`hub.${name} must be a number in ${min}..${max}`);
  }
}

function httpBase(url: string | URL): URL {
  let u: URL;
  try {
    u = new URL(url);
  } catch (error) {
    throw new InvalidArgumentError(`hub.url ${JSON.stringify(String(url))} is not a URL`, { cause: error });
  }
  if (u.protocol !== "http:" && u.protocol !== "https:") {
    throw new InvalidArgumentError("hub.url must be an http(s) URL");
  }
  if (u.username || u.password) {
    throw new InvalidArgumentError("hub.url must not carry credentials (use hub.token)");
  }
  u.search = "";
  u.hash = "";
  if (!u.pathname.endsWith("/")) u.pathname += "/";
  return u;
}

function checkRelayUrl(relayUrl: string | URL | undefined): void {
  if (relayUrl === undefined) return;
  let r: URL;
  try {
    r = new URL(relayUrl);
  } catch {
    throw new InvalidArgumentError("hub.relayUrl is not a URL");
  }
  if (r.protocol !== "ws:" && r.protocol !== "wss:") {
    throw new InvalidArgumentError("hub.relayUrl must be a ws(s) URL");
  }
}

/** Checks the options synchronously (a typed error before anything connects). */
export function checkHubOptions(o: Omit<HubLinkOptions, "signal" | "onEvent"> | undefined): void {
  if (typeof o !== "object" || o === null) throw new InvalidArgumentError("hub must be {url, token, model}");
  httpBase(o.url);
  checkRelayUrl(o.relayUrl);
  if (!((typeof o.token === "string" && o.token.length > 0) || typeof o.token === "function")) {
    throw new InvalidArgumentError("hub.token must be a non-empty string or a function");
  }
  if (typeof o.model !== "string" || !MODEL_ID.test(o.model)) {
    throw new InvalidArgumentError("hub.model must be a model id ([A-Za-z0-9][A-Za-z0-9._-]{0,127})");
  }
  if (o.direct !== undefined && typeof o.direct !== "boolean") {
    throw new InvalidArgumentError("hub.direct must be true or false");
  }
  if (
    o.id !== undefined &&
    (typeof o.id !== "string" || o.id.length === 0 || Buffer.byteLength(o.id) > 128)
  ) {
    throw new InvalidArgumentError("hub.id must be a string of 1..128 bytes");
  }
  const ca = o.ca;
  const caItem = (v: unknown) => typeof v === "string" || v instanceof Uint8Array;
  if (ca !== undefined && !caItem(ca) && !(Array.isArray(ca) && ca.every(caItem))) {
    throw new InvalidArgumentError("hub.ca must be PEM text or bytes, or an array of them");
  }
  optionalMs("statsIntervalMs", o.statsIntervalMs, 0, 86_400_000);
  optionalMs("pollWaitS", o.pollWaitS, 0, 3600);
  if (o.pollWaitS !== undefined && !Number.isInteger(o.pollWaitS)) {
    throw new InvalidArgumentError("hub.pollWaitS must be whole seconds");
  }
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

/** The checked options' defaults (the id may ask the token function once). */
export async function hubSettings(options: HubLinkOptions): Promise<HubSettings> {
  const base = httpBase(options.url);
  const { token } = options;
  const relayUrl =
    options.relayUrl !== undefined
      ? new URL(options.relayUrl).href
      : new URL("relay", `${base.protocol === "https:" ? "wss" : "ws"}://${base.host}${base.pathname}`).href;
  const id =
    options.id ??
    boundId(typeof token === "string" ? token : await tokenValue(token)) ??
    `${hostname().slice(0, 80)}-${process.pid}-${randomBytes(3).toString("hex")}`;
  const retryMin = options.retryMinMs ?? 500;
  return {
    base,
    relayUrl,
    id,
    modelPath: `api/models/${encodeURIComponent(options.model)}`,
    statsIntervalMs: options.statsIntervalMs ?? 10_000,
    pollWaitS: options.pollWaitS ?? 30,
    closeTimeoutMs: options.closeTimeoutMs ?? 5000,
    retry: {
      initialDelayMs: retryMin,
      maxDelayMs: Math.max(retryMin, options.retryMaxMs ?? 30_000),
      factor: 2,
      jitter: 0.5,
      maxAttempts: Number.POSITIVE_INFINITY,
    },
  };
}

import type { Readable } from "node:stream";
import {
  type AutoClaimRequestJson,
  abortReason,
  type ClaimRequestJson,
  type DemandJson,
  errorFromCode,
  HubError,
  InvalidArgumentError,
  isMoeswarmError,
  type LeaseJson,
  type MoeswarmError,
  parseDemandJson,
  parseLeaseJson,
  TransportError,
} from "@moeswarm/core";
import { Agent, type Dispatcher, request } from "undici";

/*
 * The one HTTP client of a hub's API, for the worker runtime and the backbone's hub link alike.
 * undici 7 (the version @moeswarm/shard already uses) rather than node:http or fetch: one Agent per
 * client keeps long-polls, reports, claims and downloads on kept-alive connections (one TLS
 * handshake, not one per request), takes a self-hosted hub's CA as `connect.ca`, has header and body
 * timeouts of its own, and `close()` ends every socket.
 */

/** PEM CA certificate(s) to trust for a self-hosted hub (https and wss). */
export type HubCa = string | Uint8Array | ReadonlyArray<string | Uint8Array>;

/** The bearer token, or a function asked before every request (and relay connect), to refresh it. */
export type HubToken = string | (() => string | Promise<string>);

export interface HubClientOptions {
  /** The hub's base URL (http or https); request paths are relative to it. */
  base: string | URL;
  /** Sent as `Authorization: Bearer`; none for a client of public endpoints (downloads with own headers). */
  token?: HubToken | undefined;
  ca?: HubCa | undefined;
  /** A body that delivers nothing for this long fails (default 60 s). */
  bodyTimeoutMs?: number;
}

export interface HubRequestOptions {
  method?: "GET" | "POST" | "PUT" | "DELETE";
  /** A JSON body. */
  body?: unknown;
  signal?: AbortSignal | undefined;
  /** Time until the response headers arrive (default 30 s). */
  headersTimeoutMs?: number;
  /** Largest body read (default 16 MiB). */
  maxBodyBytes?: number;
}

export interface HubResponse {
  status: number;
  /** The parsed JSON body (undefined for 304 and empty bodies). */
  json: unknown;
}

/** A response whose body the caller streams (downloads). */
export interface HubStream {
  status: number;
  headers: Record<string, string | string[] | undefined>;
  body: Readable;
}

export interface HubOpenOptions {
  headers?: Record<string, string>;
  signal?: AbortSignal | undefined;
  /** Time until the response headers arrive (default 30 s). */
  headersTimeoutMs?: number;
}

const JSON_LIMIT = 16 * 1024 * 1024;
const HEADERS_TIMEOUT_MS = 30_000;

function toCa(ca: HubCa | undefined): string | Buffer | Array<string | Buffer> | undefined {
  if (ca === undefined) return undefined;
  const one = (v: string | Uint8Array) =>
    typeof v === "string" ? v : Buffer.from(v.buffer, v.byteOffset, v.byteLength);
  return typeof ca === "string" || ca instanceof Uint8Array ? one(ca) : ca.map(one);
}

/** Destroys a body nobody reads; undici then emits an abort error that nobody else listens for. */
export function discardBody(body: Readable): void {
  body.on("error", () => undefined);
  body.destroy();
}

/** Resolves the token option to its current value. */
export async function tokenValue(token: HubToken): Promise<string> {
  const t = typeof token === "function" ? await token() : token;
  if (typeof t !== "string" || t.length === 0) {
    throw new InvalidArgumentError("the hub token must be a non-empty string");
  }
  return t;
}

/**
 * A failure worth retrying after a pause. Network failures (refused, reset, TLS, timeouts: any
 * TransportError) and a hub in trouble: 408 and 429 (it asks to come back later), 5xx. Except 501:
 * "not implemented" is this hub's version lacking the endpoint, which no retry changes. A hub
 * error without a status (an answer that is not JSON, the store failing) counts as 5xx. Anything
 * that is not a MoeswarmError is a bug here, not a condition that passes.
 */
export function isTransient(error: unknown): boolean {
  if (!isMoeswarmError(error)) return false;
  if (error instanceof TransportError) return true;
  const status = (error.details as { status?: unknown } | undefined)?.status;
  if (typeof status === "number") {
    return status === 408 || status === 429 || (status >= 500 && status !== 501);
  }
  return error.code === "MOESWARM_HUB_INTERNAL" || error.code === "MOESWARM_HUB_STORE";
}

/** The hub's `{"error": {code, message, details}}` answer as the typed error of its code; else by status. */
export function hubAnswerError(status: number, json: unknown, text: string, where: string): MoeswarmError {
  const err = (json as { error?: { code?: unknown; message?: unknown; details?: unknown } } | undefined)
    ?.error;
  if (err && typeof err.code === "string" && typeof err.message === "string") {
    const details =
      typeof err.details === "object" && err.details !== null ? (err.details as Record<string, unknown>) : {};
    return errorFromCode(err.code, `${where}: ${err.message}`, { details: { ...details, status } });
  }
  const shown = text.slice(0, 200).trim();
  return new HubError(
    status >= 500 ? "MOESWARM_HUB_INTERNAL" : "MOESWARM_HUB_BAD_REQUEST",
    `${where} answered ${status}${shown ? `: ${shown}` : ""}`,
    { details: { status } },
  );
}

/** A network failure (refused, reset, TLS, timeout) as a TransportError; MoeswarmErrors pass. */
export function networkError(error: unknown, url: URL, where: string): MoeswarmError {
  if (isMoeswarmError(error)) return error;
  const e = error as { code?: unknown; message?: unknown; cause?: { code?: unknown; message?: unknown } };
  const code = typeof e?.code === "string" ? e.code : undefined;
  const causeCode = typeof e?.cause?.code === "string" ? e.cause.code : undefined;
  const message = error instanceof Error ? error.message : String(error);
  const cause =
    typeof e?.cause?.message === "string" && e.cause.message !== message ? ` (${e.cause.message})` : "";
  const timeout =
    code === "UND_ERR_HEADERS_TIMEOUT" ||
    code === "UND_ERR_BODY_TIMEOUT" ||
    code === "UND_ERR_CONNECT_TIMEOUT";
  const closed =
    code === "UND_ERR_SOCKET" ||
    code === "ECONNRESET" ||
    causeCode === "ECONNRESET" ||
    code === "ERR_STREAM_PREMATURE_CLOSE" ||
    message === "terminated";
  return new TransportError(
    timeout
      ? "MOESWARM_TRANSPORT_TIMEOUT"
      : closed
        ? "MOESWARM_TRANSPORT_CLOSED"
        : "MOESWARM_TRANSPORT_CONNECT",
    `${where} at ${url.origin}: ${message}${cause}`,
    {
      cause: error,
      details: {
        url: `${url.origin}${url.pathname}`,
        ...((causeCode ?? code) ? { errno: causeCode ?? code } : {}),
      },
    },
  );
}

/** Reads a whole (small) body; more than `limit` bytes is a TransportError, never an allocation. */
async function readText(
  stream: Readable,
  headers: HubStream["headers"],
  limit: number,
  where: string,
): Promise<string> {
  const declared = Number(headers["content-length"]);
  if (Number.isFinite(declared) && declared > limit) {
    discardBody(stream);
    throw new TransportError(
      "MOESWARM_TRANSPORT_LIMIT",
      `${where} answered ${declared} bytes (limit ${limit})`,
    );
  }
  const parts: Buffer[] = [];
  let size = 0;
  for await (const chunk of stream) {
    size += (chunk as Buffer).byteLength;
    if (size > limit) {
      discardBody(stream);
      throw new TransportError("MOESWARM_TRANSPORT_LIMIT", `${where} answered more than ${limit} bytes`);
    }
    parts.push(chunk as Buffer);
  }
  return Buffer.concat(parts).toString("utf8");
}

/** A hub's HTTP API: auth, JSON, typed errors, timeouts, AbortSignal; the market's calls typed. */
export class HubClient {
  readonly base: URL;
  readonly #token: HubToken | undefined;
  readonly #ca: HubCa | undefined;
  readonly #agent: Agent;

  constructor(options: HubClientOptions) {
    let base: URL;
    try {
      base = new URL(String(options.base));
    } catch {
      throw new InvalidArgumentError(`hub ${JSON.stringify(String(options.base))} is not a URL`);
    }
    if (base.protocol !== "http:" && base.protocol !== "https:") {
      throw new InvalidArgumentError(`hub must be an http(s) URL, got ${base.href}`);
    }
    this.base = base;
    this.#token = options.token;
    this.#ca = options.ca;
    const ca = toCa(options.ca);
    this.#agent = new Agent({
      ...(ca !== undefined ? { connect: { ca } } : {}),
      // a long-poll answers within its `wait`; a body stalls only when the hub is in trouble
      bodyTimeout: options.bodyTimeoutMs ?? 60_000,
      keepAliveTimeout: 30_000,
    });
  }

  /** The CA this client trusts (for the relay's wss connection). */
  get ca(): HubCa | undefined {
    return this.#ca;
  }

  /** An absolute URL for a path relative to the hub's base (or one the hub answered). */
  resolve(path: string): URL {
    return new URL(path, this.base);
  }

  /** The relay's URL on this hub: ws(s)://host/relay. */
  relayUrl(): string {
    const u = new URL("/relay", this.base);
    u.protocol = this.base.protocol === "https:" ? "wss:" : "ws:";
    return u.href;
  }

  /** The Authorization header of the current token (none without a token). */
  async authHeader(): Promise<Record<string, string>> {
    return this.#token === undefined ? {} : { authorization: `Bearer ${await tokenValue(this.#token)}` };
  }

  /**
   * Sends a request and resolves once the headers arrived; the caller reads (or `discardBody`s)
   * the body. Any status resolves; network failures reject as TransportErrors.
   */
  async open(
    url: string | URL,
    options: HubOpenOptions & { method?: string; body?: string } = {},
  ): Promise<HubStream> {
    const { signal } = options;
    if (signal?.aborted) throw abortReason(signal);
    const target = url instanceof URL ? url : this.resolve(url);
    const method = options.method ?? "GET";
    let response: Dispatcher.ResponseData;
    try {
      response = await request(target, {
        dispatcher: this.#agent,
        method: method as Dispatcher.HttpMethod,
        headers: {
          ...(options.body !== undefined ? { "content-type": "application/json" } : {}),
          ...options.headers,
        },
        ...(options.body !== undefined ? { body: options.body } : {}),
        signal: signal ?? null,
        headersTimeout: options.headersTimeoutMs ?? HEADERS_TIMEOUT_MS,
      });
    } catch (error) {
      if (signal?.aborted) throw abortReason(signal);
      throw networkError(error, target, `${method} ${target.pathname}`);
    }
    return { status: response.statusCode, headers: response.headers, body: response.body };
  }

  /** `path` is relative to the hub's base URL (`api/models/m/placement`). 4xx/5xx reject typed. */
  async request(path: string, options: HubRequestOptions = {}): Promise<HubResponse> {
    const { signal } = options;
    if (signal?.aborted) throw abortReason(signal);
    const url = this.resolve(path);
    const where = `${options.method ?? "GET"} ${url.pathname}`;
    const res = await this.open(url, {
      method: options.method ?? "GET",
      headers: { accept: "application/json", ...(await this.authHeader()) },
      ...(options.body !== undefined ? { body: JSON.stringify(options.body) } : {}),
      signal,
      headersTimeoutMs: options.headersTimeoutMs ?? HEADERS_TIMEOUT_MS,
    });
    if (res.status === 304) {
      discardBody(res.body);
      return { status: res.status, json: undefined };
    }
    let text: string;
    try {
      text = await readText(res.body, res.headers, options.maxBodyBytes ?? JSON_LIMIT, where);
    } catch (error) {
      if (signal?.aborted) throw abortReason(signal);
      throw networkError(error, url, `${where} (reading the answer)`);
    }
    let json: unknown;
    if (text.length > 0) {
      try {
        json = JSON.parse(text);
      } catch {
        if (res.status < 400) {
          throw new HubError(
            "MOESWARM_HUB_INTERNAL",
            `${where} answered ${res.status} with a body that is not JSON`,
            {
              details: { status: res.status },
            },
          );
        }
      }
    }
    if (res.status >= 400) throw hubAnswerError(res.status, json, text, where);
    return { status: res.status, json };
  }

  /** `GET /api/demand`: the under-covered ranges. */
  async demand(
    options: { model?: string | undefined; signal?: AbortSignal | undefined } = {},
  ): Promise<DemandJson> {
    const q = options.model === undefined ? "" : `?model=${encodeURIComponent(options.model)}`;
    return parseDemandJson((await this.request(`/api/demand${q}`, { signal: options.signal })).json);
  }

  /** `POST /api/claims`. */
  async claim(body: ClaimRequestJson, signal?: AbortSignal): Promise<LeaseJson> {
    return parseLeaseJson((await this.request("/api/claims", { method: "POST", body, signal })).json);
  }

  /** `POST /api/claims/auto`: the hub picks what fits the capacity. */
  async claimAuto(body: AutoClaimRequestJson, signal?: AbortSignal): Promise<LeaseJson> {
    return parseLeaseJson((await this.request("/api/claims/auto", { method: "POST", body, signal })).json);
  }

  /** `POST /api/claims/:id/renew`. */
  async renew(leaseId: string, ttlMs: number | undefined, signal?: AbortSignal): Promise<LeaseJson> {
    const path = `/api/claims/${encodeURIComponent(leaseId)}/renew`;
    const body = ttlMs === undefined ? {} : { ttlMs };
    return parseLeaseJson((await this.request(path, { method: "POST", body, signal })).json);
  }

  /** `DELETE /api/claims/:id`. */
  async release(leaseId: string, signal?: AbortSignal): Promise<void> {
    await this.request(`/api/claims/${encodeURIComponent(leaseId)}`, { method: "DELETE", signal });
  }

  /** Ends every connection (requests in flight fail). */
  async close(): Promise<void> {
    await this.#agent.destroy().catch(() => {});
  }
}

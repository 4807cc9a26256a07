import {
  abortReason,
  errorFromCode,
  HubError,
  InvalidArgumentError,
  isMoeswarmError,
  type MoeswarmError,
  TransportError,
} from "@moeswarm/core";
import { Agent, type Dispatcher, request } from "undici";

/*
 * The hub's HTTP API through undici 7 (the version @moeswarm/shard already uses): one Agent per
 * link keeps the long-poll and the stats reports on kept-alive connections (one TLS handshake,
 * not one per poll), takes a self-hosted hub's CA as `connect.ca`, has header and body timeouts of
 * its own, and `destroy()` ends every socket at close.
 */

/** PEM CA certificate(s) to trust for a self-hosted hub (https and wss). */
export type HubCa = string | Uint8Array | ReadonlyArray<string | Uint8Array>;

/** The bearer token, or a function asked before every request (and relay connect), to refresh it. */
export type HubToken = string | (() => string | Promise<string>);

export interface HubHttpOptions {
  base: URL;
  token: HubToken;
  ca?: HubCa | undefined;
}

export interface HubRequestOptions {
  method?: "GET" | "POST";
  /** A JSON body. */
  body?: unknown;
  signal?: AbortSignal | undefined;
  /** Time until the response headers arrive. */
  headersTimeoutMs: number;
  /** Largest body read. */
  maxBodyBytes: number;
}

export interface HubResponse {
  status: number;
  /** The parsed JSON body (undefined for 304 and empty bodies). */
  json: unknown;
}

function toCa(ca: HubCa | undefined): string | Buffer | Array<string | Buffer> | undefined {
  if (ca === undefined) return undefined;
  const one = (v: string | Uint8Array) =>
    typeof v === "string" ? v : Buffer.from(v.buffer, v.byteOffset, v.byteLength);
  return typeof ca === "string" || ca instanceof Uint8Array ? one(ca) : ca.map(one);
}

// Destroying an unread undici body makes it emit an abort error; nobody else listens for it.
function discard(body: Dispatcher.ResponseData["body"]): void {
  body.on("error", () => undefined);
  body.destroy();
}

/** Resolves the token option to its current value. */
export async function tokenValue(token: HubToken): Promise<string> {
  const t = typeof token === "function" ? await token() : token;
  if (typeof t !== "string" || t.length === 0) {
    throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "the hub token must be a non-empty string");
  }
  return t;
}

/** A transient failure worth retrying: the network, a timeout, a hub in trouble (5xx, 429). */
export function isTransient(error: unknown): boolean {
  if (!isMoeswarmError(error)) return true;
  if (error instanceof TransportError) return true;
  const status = (error.details as { status?: unknown } | undefined)?.status;
  if (status === 408 || status === 429) return true;
  return error.code === "MOESWARM_HUB_INTERNAL" || error.code === "MOESWARM_HUB_STORE";
}

export class HubHttp {
  readonly base: URL;
  readonly #token: HubToken;
  readonly #agent: Agent;

  constructor(options: HubHttpOptions) {
    this.base = options.base;
    this.#token = options.token;
    const ca = toCa(options.ca);
    this.#agent = new Agent({
      ...(ca !== undefined ? { connect: { ca } } : {}),
      // a long-poll answers within its `wait`; a body stalls only when the hub is in trouble
      bodyTimeout: 60_000,
      keepAliveTimeout: 30_000,
    });
  }

  /** `path` is relative to the hub's base URL (`api/models/m/placement`). */
  async request(path: string, options: HubRequestOptions): Promise<HubResponse> {
    const { signal } = options;
    if (signal?.aborted) throw abortReason(signal);
    const url = new URL(path, this.base);
    const where = `${options.method ?? "GET"} ${url.pathname}`;
    const token = await tokenValue(this.#token);
    const body = options.body === undefined ? undefined : JSON.stringify(options.body);
    let response: Dispatcher.ResponseData;
    try {
      response = await request(url, {
        dispatcher: this.#agent,
        method: options.method ?? "GET",
        headers: {
          authorization: `Bearer ${token}`,
          accept: "application/json",
          ...(body !== undefined ? { "content-type": "application/json" } : {}),
        },
        ...(body !== undefined ? { body } : {}),
        signal: signal ?? null,
        headersTimeout: options.headersTimeoutMs,
      });
    } catch (error) {
      if (signal?.aborted) throw abortReason(signal);
      throw networkError(error, url, where);
    }
    const { statusCode, headers, body: stream } = response;
    if (statusCode === 304) {
      discard(stream);
      return { status: statusCode, json: undefined };
    }
    const declared = Number(headers["content-length"]);
    if (Number.isFinite(declared) && declared > options.maxBodyBytes) {
      discard(stream);
      throw new TransportError(
        "MOESWARM_TRANSPORT_LIMIT",
        `${where} answered ${declared} bytes (limit ${options.maxBodyBytes})`,
      );
    }
    const parts: Buffer[] = [];
    let size = 0;
    try {
      for await (const chunk of stream) {
        size += (chunk as Buffer).byteLength;
        if (size > options.maxBodyBytes) {
          discard(stream);
          throw new TransportError(
            "MOESWARM_TRANSPORT_LIMIT",
            `${where} answered more than ${options.maxBodyBytes} bytes`,
          );
        }
        parts.push(chunk as Buffer);
      }
    } catch (error) {
      if (signal?.aborted) throw abortReason(signal);
      throw networkError(error, url, `${where} (reading the answer)`);
    }
    const text = Buffer.concat(parts).toString("utf8");
    let json: unknown;
    if (text.length > 0) {
      try {
        json = JSON.parse(text);
      } catch {
        if (statusCode < 400) {
          throw new HubError(
            "MOESWARM_HUB_INTERNAL",
            `${where} answered ${statusCode} with a body that is not JSON`,
            {
              details: { status: statusCode },
            },
          );
        }
      }
    }
    if (statusCode >= 400) throw httpError(statusCode, json, text, where);
    return { status: statusCode, json };
  }

  /** Ends every connection (requests in flight fail). */
  async close(): Promise<void> {
    await this.#agent.destroy().catch(() => {});
  }
}

/** The hub's JSON error body as the typed error of its code; anything else by status. */
function httpError(status: number, json: unknown, text: string, where: string): MoeswarmError {
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
function networkError(error: unknown, url: URL, where: string): MoeswarmError {
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
  const closed = code === "UND_ERR_SOCKET" || code === "ECONNRESET" || causeCode === "ECONNRESET";
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

import { type ClientRequest, request as httpRequest, type IncomingMessage } from "node:http";
import { request as httpsRequest } from "node:https";
import {
  abortReason,
  errorFromCode,
  HubError,
  InvalidArgumentError,
  isMoeswarmError,
  type MoeswarmError,
  TransportError,
} from "@moeswarm/core";

/*
 * HTTP with node:http/https rather than fetch: a self-hosted hub's CA is one `ca` option here
 * (fetch needs an undici dispatcher of a matching version), a cut body surfaces as a stream error
 * we can resume from, and no dependency is needed on Node 20.
 */

/** PEM CA certificate(s) to trust for a self-hosted hub. */
export type CaOption = string | Uint8Array | ReadonlyArray<string | Uint8Array>;

export interface HttpOptions {
  method?: string;
  headers?: Record<string, string>;
  body?: string;
  ca?: CaOption | undefined;
  signal?: AbortSignal | undefined;
  /** Time until the response headers arrive (default 30 s). */
  timeoutMs?: number;
}

function toCa(ca: CaOption | undefined): string | Buffer | Array<string | Buffer> | undefined {
  if (ca === undefined) return undefined;
  const one = (v: string | Uint8Array) =>
    typeof v === "string" ? v : Buffer.from(v.buffer, v.byteOffset, v.byteLength);
  return typeof ca === "string" || ca instanceof Uint8Array ? one(ca) : ca.map(one);
}

/** A network failure (refused, reset, TLS, timeout) as a TransportError; MoeswarmErrors pass. */
export function networkError(error: unknown, url: URL, what: string): MoeswarmError {
  if (isMoeswarmError(error)) return error;
  const e = error as NodeJS.ErrnoException;
  const code = typeof e?.code === "string" ? e.code : undefined;
  const message = e instanceof Error ? e.message : String(error);
  return new TransportError(
    code === "ECONNRESET" || message === "aborted"
      ? "MOESWARM_TRANSPORT_CLOSED"
      : "MOESWARM_TRANSPORT_CONNECT",
    `${what} ${url.origin}${url.pathname}: ${message}${code && !message.includes(code) ? ` (${code})` : ""}`,
    { cause: error, details: { url: url.href, ...(code ? { errno: code } : {}) } },
  );
}

/**
 * Sends one request and resolves with the response once its headers arrived; the caller reads
 * (or discards) the body. The signal and the header timeout destroy the request.
 */
export function openRequest(url: URL, options: HttpOptions = {}): Promise<IncomingMessage> {
  const { signal } = options;
  if (signal?.aborted) return Promise.reject(abortReason(signal));
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    return Promise.reject(
      new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", `${url.href} is not an http(s) URL`),
    );
  }
  const send = url.protocol === "https:" ? httpsRequest : httpRequest;
  const timeoutMs = options.timeoutMs ?? 30_000;
  return new Promise<IncomingMessage>((resolve, reject) => {
    let req: ClientRequest | undefined;
    let settled = false;
    const finish = (error: unknown, res?: IncomingMessage) => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", onAbort);
      if (settled) return;
      settled = true;
      if (res) resolve(res);
      else reject(error);
    };
    const onAbort = () => {
      finish(abortReason(signal as AbortSignal));
      req?.destroy();
    };
    const timer = setTimeout(() => {
      finish(
        new TransportError(
          "MOESWARM_TRANSPORT_TIMEOUT",
          `${url.origin}${url.pathname} did not answer within ${timeoutMs} ms`,
          {
            details: { url: url.href, timeoutMs },
          },
        ),
      );
      req?.destroy();
    }, timeoutMs);
    signal?.addEventListener("abort", onAbort, { once: true });
    try {
      const body = options.body === undefined ? undefined : Buffer.from(options.body, "utf8");
      req = send(
        url,
        {
          method: options.method ?? "GET",
          headers: {
            ...(body
              ? { "content-type": "application/json", "content-length": String(body.byteLength) }
              : {}),
            ...options.headers,
          },
          ca: toCa(options.ca),
        },
        (res) => finish(undefined, res),
      );
      req.setNoDelay(true);
      req.on("error", (error) => finish(networkError(error, url, `${options.method ?? "GET"}`)));
      req.end(body);
    } catch (error) {
      finish(networkError(error, url, `${options.method ?? "GET"}`));
    }
  });
}

/** Reads a whole (small) body; more than `limit` bytes is a TransportError, never an allocation. */
export async function readBody(res: IncomingMessage, limit: number, url: URL): Promise<Buffer> {
  const parts: Buffer[] = [];
  let size = 0;
  const declared = Number(res.headers["content-length"]);
  if (Number.isFinite(declared) && declared > limit) {
    res.destroy();
    throw new TransportError(
      "MOESWARM_TRANSPORT_LIMIT",
      `${url.pathname} answered ${declared} bytes (limit ${limit})`,
    );
  }
  try {
    for await (const chunk of res) {
      size += (chunk as Buffer).byteLength;
      if (size > limit) {
        res.destroy();
        throw new TransportError(
          "MOESWARM_TRANSPORT_LIMIT",
          `${url.pathname} answered more than ${limit} bytes`,
        );
      }
      parts.push(chunk as Buffer);
    }
  } catch (error) {
    throw networkError(error, url, "reading");
  }
  return Buffer.concat(parts);
}

/** The error a hub's non-2xx answer stands for: its `{"error": {code, message, details}}` body, or the status. */
export function hubAnswerError(status: number, body: Buffer, url: URL): MoeswarmError {
  let parsed: unknown;
  try {
    parsed = JSON.parse(body.toString("utf8"));
  } catch {
    parsed = undefined;
  }
  const err = (parsed as { error?: { code?: unknown; message?: unknown; details?: unknown } } | undefined)
    ?.error;
  if (err && typeof err.code === "string" && typeof err.message === "string") {
    const details =
      typeof err.details === "object" && err.details !== null ? (err.details as Record<string, unknown>) : {};
    return errorFromCode(err.code, err.message, { details: { ...details, status } });
  }
  const text = body.toString("utf8", 0, Math.min(body.byteLength, 200)).trim();
  return new HubError(
    status >= 500 ? "MOESWARM_HUB_INTERNAL" : "MOESWARM_HUB_BAD_REQUEST",
    `${url.pathname} answered ${status}${text ? `: ${text}` : ""}`,
    { details: { status } },
  );
}

/** Transient failures worth retrying after a pause: the network, a hub in trouble (5xx). */
export function isTransient(error: unknown): boolean {
  if (!isMoeswarmError(error)) return false;
  if (error instanceof TransportError) return true;
  return error.code === "MOESWARM_HUB_INTERNAL" || error.code === "MOESWARM_HUB_STORE";
}

/** Waits `ms`; resolves false (never rejects) when the signal aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal?.aborted) {
      resolve(false);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      resolve(false);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve(true);
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

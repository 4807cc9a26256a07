import { createWriteStream } from "node:fs";
import { readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import type { IncomingMessage } from "node:http";
import { pipeline } from "node:stream/promises";
import {
  abortReason,
  InvalidArgumentError,
  type MoeswarmError,
  TransportError,
  throwIfAborted,
} from "@moeswarm/core";
import { backoffDelay } from "@moeswarm/relay-client";
import { type CaOption, hubAnswerError, networkError, openRequest, readBody, sleep } from "./http.js";

export interface DownloadProgress {
  /** Bytes of the file on disk so far. */
  received: number;
  /** The whole file's size, once known. */
  total: number | undefined;
}

export interface DownloadRetry {
  /** 1-based count of consecutive failures. */
  attempt: number;
  error: MoeswarmError;
  delayMs: number;
  /** Bytes kept: the next request resumes from here. */
  received: number;
}

export interface DownloadOptions {
  signal?: AbortSignal | undefined;
  ca?: CaOption | undefined;
  /** Extra request headers (Authorization...). */
  headers?: Record<string, string>;
  /** Consecutive failed attempts (without new bytes) before giving up (default 6). */
  maxAttempts?: number;
  /** Backoff between attempts (defaults: 250 ms doubling up to 10 s, 50% jitter). */
  initialDelayMs?: number;
  maxDelayMs?: number;
  /** A body that delivers nothing for this long is cut and resumed (default 30 s). */
  idleTimeoutMs?: number;
  /** Time until response headers arrive (default 30 s). */
  headersTimeoutMs?: number;
  onProgress?: (progress: DownloadProgress) => void;
  onRetry?: (retry: DownloadRetry) => void;
  /** Told of every response: the status and the first byte it carries (tests, logs). */
  onResponse?: (info: { status: number; offset: number; total: number | undefined }) => void;
}

export interface DownloadResult {
  path: string;
  bytes: number;
  /** Bytes that were already on disk from an earlier, interrupted run. */
  reusedBytes: number;
  /** Requests sent (1 when nothing went wrong). */
  requests: number;
  /** Times a request continued a partial file with Range. */
  resumes: number;
  etag: string | undefined;
  ms: number;
}

interface PartState {
  url: string;
  etag: string;
  total: number;
}

const CONTENT_RANGE = /^bytes (\d+)-(\d+)\/(\d+)$/;

async function readPartState(statePath: string): Promise<PartState | undefined> {
  try {
    const v = JSON.parse(await readFile(statePath, "utf8")) as Partial<PartState>;
    if (typeof v.url === "string" && typeof v.etag === "string" && Number.isSafeInteger(v.total)) {
      return v as PartState;
    }
  } catch {
    // absent or unreadable: start over
  }
  return undefined;
}

async function sizeOf(path: string): Promise<number> {
  try {
    return (await stat(path)).size;
  } catch {
    return 0;
  }
}

/**
 * Downloads `url` to `dest` through `dest.part`, resuming after cut connections: each retry asks
 * for the rest with `Range: bytes=<have>-` and `If-Range: <etag>`, so a file that changed on the
 * server meanwhile comes back whole (200) instead of being spliced. The ETag of a partial file is
 * kept beside it (`dest.part.json`), so a later run resumes too. Consecutive failures without new
 * bytes back off exponentially and give up after `maxAttempts`. The finished file replaces `dest`
 * in one rename.
 */
export async function downloadResumable(
  url: string | URL,
  dest: string,
  options: DownloadOptions = {},
): Promise<DownloadResult> {
  const { signal } = options;
  throwIfAborted(signal);
  const target = new URL(String(url));
  const maxAttempts = options.maxAttempts ?? 6;
  if (!Number.isInteger(maxAttempts) || maxAttempts < 1) {
    throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "maxAttempts must be an integer >= 1");
  }
  const backoff = {
    initialDelayMs: options.initialDelayMs ?? 250,
    maxDelayMs: options.maxDelayMs ?? 10_000,
    factor: 2,
    jitter: 0.5,
    maxAttempts,
  };
  const idleTimeoutMs = options.idleTimeoutMs ?? 30_000;
  const part = `${dest}.part`;
  const statePath = `${part}.json`;
  const t0 = performance.now();

  let state = await readPartState(statePath);
  let have = await sizeOf(part);
  if (!state || state.url !== target.href || have > state.total) {
    state = undefined;
    have = 0;
  }
  const reusedBytes = have;
  let requests = 0;
  let resumes = 0;
  let failures = 0;
  let total = state?.total;
  let etag = state?.etag;

  for (;;) {
    throwIfAborted(signal);
    const before = have;
    try {
      const done = await attempt();
      if (done) break;
    } catch (error) {
      if (signal?.aborted) throw abortReason(signal);
      const e = networkError(error, target, "downloading");
      if (!retriable(e)) throw e;
      failures = have > before ? 1 : failures + 1;
      if (failures >= maxAttempts) {
        throw new TransportError(
          "MOESWARM_TRANSPORT_CLOSED",
          `download of ${target.pathname} failed ${failures} times in a row: ${e.message}`,
          { cause: e, details: { url: target.href, received: have, total } },
        );
      }
      const delayMs = backoffDelay(failures, backoff);
      options.onRetry?.({ attempt: failures, error: e, delayMs, received: have });
      if (!(await sleep(delayMs, signal))) throw abortReason(signal as AbortSignal);
    }
  }
  await rename(part, dest);
  await rm(statePath, { force: true });
  return {
    path: dest,
    bytes: have,
    reusedBytes,
    requests,
    resumes,
    etag,
    ms: performance.now() - t0,
  };

  /** One request; true when the file is complete. */
  async function attempt(): Promise<boolean> {
    const headers: Record<string, string> = { ...options.headers };
    const resuming = have > 0 && etag !== undefined;
    if (resuming) {
      headers.range = `bytes=${have}-`;
      headers["if-range"] = etag as string;
    }
    requests++;
    const res = await openRequest(target, {
      headers,
      ca: options.ca,
      signal,
      timeoutMs: options.headersTimeoutMs ?? 30_000,
    });
    const status = res.statusCode ?? 0;
    if (status === 416 && resuming) {
      // we hold at least the whole file: complete if the sizes agree, else start over
      const m = /^bytes \*\/(\d+)$/.exec(String(res.headers["content-range"] ?? ""));
      res.resume();
      if (m && Number(m[1]) === have && have === total) return true;
      await restart();
      throw new TransportError("MOESWARM_TRANSPORT_CLOSED", `the server refused the range from ${have}`);
    }
    let offset: number;
    if (status === 206) {
      const m = CONTENT_RANGE.exec(String(res.headers["content-range"] ?? ""));
      if (!resuming || !m || Number(m[1]) !== have || Number(m[2]) + 1 !== Number(m[3])) {
        res.destroy();
        await restart();
        throw new TransportError(
          "MOESWARM_TRANSPORT_CLOSED",
          "the server answered a range this download did not ask for",
        );
      }
      total = Number(m[3]);
      offset = have;
      resumes++;
    } else if (status === 200) {
      // a first request, or the file changed (If-Range failed): take it whole
      const length = Number(res.headers["content-length"]);
      total = Number.isSafeInteger(length) ? length : undefined;
      offset = 0;
      have = 0;
    } else {
      const body = await readBody(res, 64 * 1024, target).catch(() => Buffer.alloc(0));
      throw hubAnswerError(status, body, target);
    }
    options.onResponse?.({ status, offset, total });
    const newTag = res.headers.etag;
    etag = typeof newTag === "string" && !newTag.startsWith("W/") ? newTag : undefined;
    if (etag !== undefined && total !== undefined) {
      await writeFile(statePath, JSON.stringify({ url: target.href, etag, total } satisfies PartState));
    } else {
      await rm(statePath, { force: true });
    }
    await receive(res, offset);
    if (total !== undefined && have !== total) {
      throw new TransportError("MOESWARM_TRANSPORT_CLOSED", `the body ended after ${have} of ${total} bytes`);
    }
    if (total === undefined) total = have;
    return true;
  }

  async function restart(): Promise<void> {
    have = 0;
    etag = undefined;
    await rm(part, { force: true });
    await rm(statePath, { force: true });
  }

  async function receive(res: IncomingMessage, offset: number): Promise<void> {
    let idle: ReturnType<typeof setTimeout> | undefined;
    const arm = () => {
      clearTimeout(idle);
      idle = setTimeout(() => {
        res.destroy(
          new TransportError("MOESWARM_TRANSPORT_TIMEOUT", `no bytes for ${idleTimeoutMs} ms`, {
            details: { received: have },
          }),
        );
      }, idleTimeoutMs);
    };
    let lastReport = 0;
    const report = (force: boolean) => {
      const now = performance.now();
      if (!force && now - lastReport < 100) return;
      lastReport = now;
      options.onProgress?.({ received: have, total });
    };
    const onAbort = () => res.destroy(abortReason(signal as AbortSignal) as Error);
    signal?.addEventListener("abort", onAbort, { once: true });
    arm();
    try {
      await pipeline(
        res,
        async function* count(source: AsyncIterable<Buffer>) {
          for await (const chunk of source) {
            arm();
            have += chunk.byteLength;
            if (total !== undefined && have > total) {
              throw new TransportError(
                "MOESWARM_TRANSPORT_CLOSED",
                `the body is longer than its ${total} bytes`,
              );
            }
            yield chunk;
            report(false);
          }
        },
        createWriteStream(part, { flags: offset > 0 ? "a" : "w" }),
      );
      report(true);
    } finally {
      clearTimeout(idle);
      signal?.removeEventListener("abort", onAbort);
      // bytes counted but not yet written when the pipe broke are not on disk: trust the file
      have = await sizeOf(part);
    }
  }
}

function retriable(error: MoeswarmError): boolean {
  if (error.code === "MOESWARM_HUB_INTERNAL" || error.code === "MOESWARM_HUB_STORE") return true;
  return error instanceof TransportError && error.code !== "MOESWARM_TRANSPORT_LIMIT";
}

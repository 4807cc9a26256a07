import { open, readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import type { Readable } from "node:stream";
import {
  abortReason,
  InvalidArgumentError,
  type MoeswarmError,
  sleep,
  TransportError,
  throwIfAborted,
} from "@moeswarm/core";
import {
  backoffDelay,
  discardBody,
  type HubCa,
  HubClient,
  type HubStream,
  hubAnswerError,
  isTransient,
  networkError,
} from "@moeswarm/relay-client";

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
  /** The hub's client to download through (its connections and CA); one is made when absent. */
  client?: HubClient | undefined;
  /** PEM CA(s) to trust (without `client`). */
  ca?: HubCa | undefined;
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
    throw new InvalidArgumentError("maxAttempts must be an integer >= 1");
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
  const client = options.client ?? new HubClient({ base: target, ca: options.ca });
  try {
    await download();
  } finally {
    if (client !== options.client) await client.close();
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

  /** Attempts until the file is complete, backing off after failures. */
  async function download(): Promise<void> {
    for (;;) {
      throwIfAborted(signal);
      const before = have;
      try {
        const done = await attempt();
        if (done) break;
      } catch (error) {
        if (signal?.aborted) throw abortReason(signal);
        const e = networkError(error, target, "downloading");
        // an error answer larger than the limit is not a hub in trouble
        if (!isTransient(e) || e.code === "MOESWARM_TRANSPORT_LIMIT") throw e;
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
        await sleep(delayMs, signal);
      }
    }
  }

  /** One request; true when the file is complete. */
  async function attempt(): Promise<boolean> {
    const headers: Record<string, string> = { ...options.headers };
    const resuming = have > 0 && etag !== undefined;
    if (resuming) {
      headers.range = `bytes=${have}-`;
      headers["if-range"] = etag as string;
    }
    requests++;
    const res = await client.open(target, {
      headers,
      signal,
      headersTimeoutMs: options.headersTimeoutMs ?? 30_000,
    });
    const { status } = res;
    if (status === 416 && resuming) {
      // we hold at least the whole file: complete if the sizes agree, else start over
      const m = /^bytes \*\/(\d+)$/.exec(String(res.headers["content-range"] ?? ""));
      discardBody(res.body);
      if (m && Number(m[1]) === have && have === total) return true;
      await restart();
      throw new TransportError("MOESWARM_TRANSPORT_CLOSED", `the server refused the range from ${have}`);
    }
    let offset: number;
    if (status === 206) {
      const m = CONTENT_RANGE.exec(String(res.headers["content-range"] ?? ""));
      if (!resuming || !m || Number(m[1]) !== have || Number(m[2]) + 1 !== Number(m[3])) {
        discardBody(res.body);
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
      throw await answerError(res, target);
    }
    options.onResponse?.({ status, offset, total });
    // take the body's bytes from now on: undici drops what it buffered when the connection is cut
    const chunks = takeChunks(res.body);
    const newTag = res.headers.etag;
    etag = typeof newTag === "string" && !newTag.startsWith("W/") ? newTag : undefined;
    if (etag !== undefined && total !== undefined) {
      await writeFile(statePath, JSON.stringify({ url: target.href, etag, total } satisfies PartState));
    } else {
      await rm(statePath, { force: true });
    }
    await receive(res.body, chunks, offset);
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

  async function receive(res: Readable, chunks: AsyncIterable<Buffer>, offset: number): Promise<void> {
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
    // Each chunk is on disk before the next is taken: a cut connection then keeps every byte that
    // arrived (a write stream destroyed by a broken pipe drops the writes it still queues).
    const file = await open(part, offset > 0 ? "a" : "w");
    arm();
    try {
      for await (const chunk of chunks) {
        arm();
        if (total !== undefined && have + chunk.byteLength > total) {
          throw new TransportError("MOESWARM_TRANSPORT_CLOSED", `the body is longer than its ${total} bytes`);
        }
        await file.write(chunk);
        have += chunk.byteLength;
        report(false);
      }
      report(true);
    } finally {
      clearTimeout(idle);
      await file.close();
      // trust the file over the count
      have = await sizeOf(part);
    }
  }
}

/** Bytes queued from a body before it is paused (the disk is slower than the network). */
const QUEUE_BYTES = 8 * 1024 * 1024;

/**
 * The body's chunks, taken from the stream as they arrive (from this call on) and queued until
 * read; its error comes after the chunks that arrived before it, where a stream destroyed by the
 * error would drop them.
 */
function takeChunks(body: Readable): AsyncIterable<Buffer> {
  const queue: Buffer[] = [];
  let queued = 0;
  let ended = false;
  let failure: unknown;
  let wake: (() => void) | undefined;
  const notify = () => {
    wake?.();
    wake = undefined;
  };
  body.on("data", (chunk: Buffer) => {
    queue.push(chunk);
    queued += chunk.byteLength;
    if (queued > QUEUE_BYTES) body.pause();
    notify();
  });
  body.on("end", () => {
    ended = true;
    notify();
  });
  body.on("error", (error) => {
    failure = error;
    notify();
  });
  body.on("close", () => {
    if (!ended && failure === undefined) {
      failure = new TransportError("MOESWARM_TRANSPORT_CLOSED", "the body was closed before its end");
    }
    notify();
  });
  return {
    async *[Symbol.asyncIterator]() {
      try {
        for (;;) {
          const chunk = queue.shift();
          if (chunk !== undefined) {
            queued -= chunk.byteLength;
            if (queued <= QUEUE_BYTES && body.isPaused()) body.resume();
            yield chunk;
          } else if (failure !== undefined) {
            throw failure;
          } else if (ended) {
            return;
          } else {
            await new Promise<void>((resolve) => {
              wake = resolve;
            });
          }
        }
      } finally {
        if (!ended) discardBody(body);
      }
    },
  };
}

/** The error a non-2xx answer stands for: the hub's JSON error body, or the status. */
async function answerError(res: HubStream, url: URL): Promise<MoeswarmError> {
  const parts: Buffer[] = [];
  let size = 0;
  try {
    for await (const chunk of res.body) {
      size += (chunk as Buffer).byteLength;
      if (size > 64 * 1024) break;
      parts.push(chunk as Buffer);
    }
  } catch {
    // the status alone says enough
  }
  discardBody(res.body);
  const text = Buffer.concat(parts).toString("utf8");
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch {
    json = undefined;
  }
  return hubAnswerError(res.status, json, text, url.pathname);
}

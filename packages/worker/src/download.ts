import { open, readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import type { Readable } from "node:stream";
import {
  abortReason,
  errorFromSystemError,
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

/**
 * Runs a local file operation; a failure is the disk's (ENOSPC, EACCES...: MOESWARM_IO_*, never
 * retried as if the hub were unreachable), not the network's.
 */
async function onDisk<T>(what: string, op: () => Promise<T>): Promise<T> {
  try {
    return await op();
  } catch (error) {
    throw errorFromSystemError(error, what);
  }
}

async function sizeOf(path: string): Promise<number> {
  try {
    return (await stat(path)).size;
  } catch {
    return 0;
  }
}

/** One download in progress: its settings and what it has so far, shared by its steps below. */
interface DownloadRun {
  readonly target: URL;
  readonly part: string;
  readonly statePath: string;
  readonly options: DownloadOptions;
  readonly signal: AbortSignal | undefined;
  readonly client: HubClient;
  readonly backoff: Parameters<typeof backoffDelay>[1];
  readonly idleTimeoutMs: number;
  /** Bytes of `part` on disk. */
  have: number;
  total: number | undefined;
  etag: string | undefined;
  requests: number;
  resumes: number;
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
  const run: DownloadRun = {
    target,
    part,
    statePath,
    options,
    signal,
    client: options.client ?? new HubClient({ base: target, ca: options.ca }),
    backoff: {
      initialDelayMs: options.initialDelayMs ?? 250,
      maxDelayMs: options.maxDelayMs ?? 10_000,
      factor: 2,
      jitter: 0.5,
      maxAttempts,
    },
    idleTimeoutMs: options.idleTimeoutMs ?? 30_000,
    have,
    total: state?.total,
    etag: state?.etag,
    requests: 0,
    resumes: 0,
  };
  try {
    await download(run, maxAttempts);
  } finally {
    if (run.client !== options.client) await run.client.close();
  }
  await onDisk(`moving ${part} to ${dest}`, () => rename(part, dest));
  await onDisk(`removing ${statePath}`, () => rm(statePath, { force: true }));
  return {
    path: dest,
    bytes: run.have,
    reusedBytes,
    requests: run.requests,
    resumes: run.resumes,
    etag: run.etag,
    ms: performance.now() - t0,
  };
}

/** Attempts until the file is complete, backing off after failures. */
async function download(run: DownloadRun, maxAttempts: number): Promise<void> {
  const { signal, target } = run;
  let failures = 0;
  for (;;) {
    throwIfAborted(signal);
    const before = run.have;
    try {
      const done = await attempt(run);
      if (done) break;
    } catch (error) {
      if (signal?.aborted) throw abortReason(signal);
      const e = networkError(error, target, "downloading");
      // an error answer larger than the limit is not a hub in trouble
      if (!isTransient(e) || e.code === "MOESWARM_TRANSPORT_LIMIT") throw e;
      failures = run.have > before ? 1 : failures + 1;
      if (failures >= maxAttempts) {
        throw new TransportError(
          "MOESWARM_TRANSPORT_CLOSED",
          `download of ${target.pathname} failed ${failures} times in a row: ${e.message}`,
          { cause: e, details: { url: target.href, received: run.have, total: run.total } },
        );
      }
      const delayMs = backoffDelay(failures, run.backoff);
      run.options.onRetry?.({ attempt: failures, error: e, delayMs, received: run.have });
      await sleep(delayMs, signal);
    }
  }
}

/** One request; true when the file is complete. */
async function attempt(run: DownloadRun): Promise<boolean> {
  const { options } = run;
  const headers: Record<string, string> = { ...options.headers };
  const resuming = run.have > 0 && run.etag !== undefined;
  if (resuming) {
    headers.range = `bytes=${run.have}-`;
    headers["if-range"] = run.etag as string;
  }
  run.requests++;
  const res = await run.client.open(run.target, {
    headers,
    signal: run.signal,
    headersTimeoutMs: options.headersTimeoutMs ?? 30_000,
  });
  const { status } = res;
  if (status === 416 && resuming) {
    // we hold at least the whole file: complete if the sizes agree, else start over
    const m = /^bytes \*\/(\d+)$/.exec(String(res.headers["content-range"] ?? ""));
    discardBody(res.body);
    if (m && Number(m[1]) === run.have && run.have === run.total) return true;
    await restart(run);
    throw new TransportError("MOESWARM_TRANSPORT_CLOSED", `the server refused the range from ${run.have}`);
  }
  const offset = await acceptAnswer(run, res, resuming);
  options.onResponse?.({ status, offset, total: run.total });
  // take the body's bytes from now on: undici drops what it buffered when the connection is cut
  const chunks = takeChunks(res.body);
  const newTag = res.headers.etag;
  run.etag = typeof newTag === "string" && !newTag.startsWith("W/") ? newTag : undefined;
  if (run.etag !== undefined && run.total !== undefined) {
    const state = { url: run.target.href, etag: run.etag, total: run.total } satisfies PartState;
    await onDisk(`writing ${run.statePath}`, () => writeFile(run.statePath, JSON.stringify(state)));
  } else {
    await onDisk(`removing ${run.statePath}`, () => rm(run.statePath, { force: true }));
  }
  await receive(run, res.body, chunks, offset);
  if (run.total !== undefined && run.have !== run.total) {
    throw new TransportError(
      "MOESWARM_TRANSPORT_CLOSED",
      `the body ended after ${run.have} of ${run.total} bytes`,
    );
  }
  if (run.total === undefined) run.total = run.have;
  return true;
}

/**
 * Reads a 206 or 200 answer's size into `run` and returns where its body starts in the file;
 * anything else (a range not asked for, an error status) throws.
 */
async function acceptAnswer(run: DownloadRun, res: HubStream, resuming: boolean): Promise<number> {
  if (res.status === 206) {
    const m = CONTENT_RANGE.exec(String(res.headers["content-range"] ?? ""));
    if (!resuming || !m || Number(m[1]) !== run.have || Number(m[2]) + 1 !== Number(m[3])) {
      discardBody(res.body);
      await restart(run);
      throw new TransportError(
        "MOESWARM_TRANSPORT_CLOSED",
        "the server answered a range this download did not ask for",
      );
    }
    run.total = Number(m[3]);
    run.resumes++;
    return run.have;
  }
  if (res.status === 200) {
    // a first request, or the file changed (If-Range failed): take it whole
    const length = Number(res.headers["content-length"]);
    run.total = Number.isSafeInteger(length) ? length : undefined;
    run.have = 0;
    return 0;
  }
  throw await answerError(res, run.target);
}

/** Forgets the partial file: the next request asks for the whole. */
async function restart(run: DownloadRun): Promise<void> {
  run.have = 0;
  run.etag = undefined;
  await onDisk(`removing ${run.part}`, () => rm(run.part, { force: true }));
  await onDisk(`removing ${run.statePath}`, () => rm(run.statePath, { force: true }));
}

/** Writes the body's chunks to the partial file from `offset`, cutting a body that goes idle. */
async function receive(
  run: DownloadRun,
  res: Readable,
  chunks: AsyncIterable<Buffer>,
  offset: number,
): Promise<void> {
  const { idleTimeoutMs, options } = run;
  let idle: ReturnType<typeof setTimeout> | undefined;
  const arm = () => {
    clearTimeout(idle);
    idle = setTimeout(() => {
      res.destroy(
        new TransportError("MOESWARM_TRANSPORT_TIMEOUT", `no bytes for ${idleTimeoutMs} ms`, {
          details: { received: run.have },
        }),
      );
    }, idleTimeoutMs);
  };
  let lastReport = 0;
  const report = (force: boolean) => {
    const now = performance.now();
    if (!force && now - lastReport < 100) return;
    lastReport = now;
    options.onProgress?.({ received: run.have, total: run.total });
  };
  // Each chunk is on disk before the next is taken: a cut connection then keeps every byte that
  // arrived (a write stream destroyed by a broken pipe drops the writes it still queues).
  const file = await onDisk(`opening ${run.part}`, () => open(run.part, offset > 0 ? "a" : "w"));
  arm();
  try {
    for await (const chunk of chunks) {
      arm();
      if (run.total !== undefined && run.have + chunk.byteLength > run.total) {
        throw new TransportError(
          "MOESWARM_TRANSPORT_CLOSED",
          `the body is longer than its ${run.total} bytes`,
        );
      }
      await onDisk(`writing ${run.part}`, () => file.write(chunk));
      run.have += chunk.byteLength;
      report(false);
    }
    report(true);
  } finally {
    clearTimeout(idle);
    await file.close();
    // trust the file over the count
    run.have = await sizeOf(run.part);
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

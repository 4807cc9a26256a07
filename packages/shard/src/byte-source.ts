import { open } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { abortReason, GgufError, InvalidArgumentError, linkedSignal, throwIfAborted } from "@moeswarm/core";
import { type Dispatcher, getGlobalDispatcher, interceptors, request } from "undici";

export interface ReadOptions {
  signal?: AbortSignal;
}

/**
 * Random access to the bytes of a file, a buffer or an HTTP resource. `read` returns exactly
 * `length` bytes, fewer only where the source ends (an offset at or past the end gives an empty
 * array). Returned arrays may be views the source keeps using only for a `bufferSource`, where
 * they alias the caller's buffer; treat them as read-only.
 */
export interface ByteSource extends AsyncDisposable {
  /** Total size in bytes; `undefined` while unknown (an HTTP source learns it on its first read). */
  readonly size: bigint | undefined;
  /** Where the bytes come from, for messages (a path, or a URL without its query). */
  readonly description: string;
  /**
   * How many bytes a read-ahead should ask for at once: large where reads are cheap (memory, a
   * local file), absent where each read costs a round trip (HTTP), leaving the reader's default.
   */
  readonly preferredReadSize?: number;
  read(offset: bigint | number, length: number, options?: ReadOptions): Promise<Uint8Array>;
  close(): Promise<void>;
}

/** The first read a header parse makes of a local file (later reads double it). */
export const FILE_FIRST_READ = 1024 * 1024;

// The most one read may ask for: one ArrayBuffer, and far more than any header block.
const MAX_READ = 2 ** 31 - 1;

function checkRead(offset: bigint | number, length: number): bigint {
  if (!Number.isSafeInteger(length) || length < 0 || length > MAX_READ) {
    throw new InvalidArgumentError(
      `read length must be an integer in [0, ${MAX_READ}], got ${String(length)}`,
    );
  }
  if (typeof offset === "number") {
    if (!Number.isSafeInteger(offset) || offset < 0) {
      throw new InvalidArgumentError(`read offset must be a non-negative safe integer, got ${offset}`);
    }
    return BigInt(offset);
  }
  if (typeof offset !== "bigint" || offset < 0n) {
    throw new InvalidArgumentError(`read offset must be a non-negative integer, got ${String(offset)}`);
  }
  return offset;
}

function closedError(description: string): GgufError {
  return new GgufError("MOESWARM_GGUF_IO", `${description}: the byte source is closed`);
}

/** The bytes of `bytes` as a source; reads return views into it, without copying. */
export function bufferSource(bytes: Uint8Array, options: { description?: string } = {}): ByteSource {
  if (!(bytes instanceof Uint8Array)) {
    throw new InvalidArgumentError("bufferSource needs a Uint8Array");
  }
  let closed = false;
  const size = BigInt(bytes.byteLength);
  const source: ByteSource = {
    size,
    description: options.description ?? `buffer(${bytes.byteLength} bytes)`,
    // Reads are views, so one read of everything costs nothing.
    preferredReadSize: Math.max(1, Math.min(bytes.byteLength, MAX_READ)),
    read(offset, length, opts = {}) {
      try {
        const start = checkRead(offset, length);
        throwIfAborted(opts.signal);
        if (closed) throw closedError(source.description);
        if (start >= size) return Promise.resolve(new Uint8Array(0));
        const s = Number(start);
        return Promise.resolve(bytes.subarray(s, Math.min(bytes.byteLength, s + length)));
      } catch (error) {
        return Promise.reject(error);
      }
    },
    close() {
      closed = true;
      return Promise.resolve();
    },
    [Symbol.asyncDispose]() {
      return source.close();
    },
  };
  return source;
}

/**
 * A local file read with positioned reads (never loaded whole). Opens the file and learns its
 * size up front; `close()` releases the descriptor.
 */
export async function fileSource(path: string, options: ReadOptions = {}): Promise<ByteSource> {
  if (typeof path !== "string" || path.length === 0) {
    throw new InvalidArgumentError("fileSource needs a non-empty path");
  }
  throwIfAborted(options.signal);
  let handle: Awaited<ReturnType<typeof open>>;
  let size: bigint;
  try {
    handle = await open(path, "r");
  } catch (error) {
    throw new GgufError("MOESWARM_GGUF_IO", `cannot open ${path}: ${(error as Error).message}`, {
      cause: error,
      details: { path },
    });
  }
  try {
    const st = await handle.stat({ bigint: true });
    if (!st.isFile()) {
      throw new GgufError("MOESWARM_GGUF_IO", `${path} is not a regular file`, { details: { path } });
    }
    size = st.size;
    throwIfAborted(options.signal);
  } catch (error) {
    await handle.close().catch(() => undefined);
    if (error instanceof GgufError || options.signal?.aborted) throw error;
    throw new GgufError("MOESWARM_GGUF_IO", `cannot stat ${path}: ${(error as Error).message}`, {
      cause: error,
      details: { path },
    });
  }
  let closing: Promise<void> | undefined;
  const source: ByteSource = {
    size,
    description: path,
    // A header parse starts with one block and doubles it as the header demands (Fetcher): 1 MiB
    // covers most headers in one read, where a 16 MiB first read cost a large file's parse 2x.
    preferredReadSize: FILE_FIRST_READ,
    async read(offset, length, opts = {}) {
      const start = checkRead(offset, length);
      throwIfAborted(opts.signal);
      if (closing) throw closedError(path);
      if (start >= size) return new Uint8Array(0);
      const want = Number(size - start < BigInt(length) ? size - start : BigInt(length));
      const out = new Uint8Array(want);
      let got = 0;
      while (got < want) {
        throwIfAborted(opts.signal);
        let n: number;
        try {
          ({ bytesRead: n } = await handle.read(out, got, want - got, Number(start) + got));
        } catch (error) {
          throw new GgufError("MOESWARM_GGUF_IO", `reading ${path}: ${(error as Error).message}`, {
            cause: error,
            details: { path, offset: (start + BigInt(got)).toString() },
          });
        }
        if (n === 0) break; // the file shrank since it was opened: a short read, as at its end
        got += n;
      }
      return got === want ? out : out.subarray(0, got);
    },
    close() {
      closing ??= handle.close();
      return closing;
    },
    [Symbol.asyncDispose]() {
      return source.close();
    },
  };
  return source;
}

export interface HttpSourceOptions {
  /** Aborts every read of this source (each read may also take its own signal). */
  signal?: AbortSignal;
  /** Extra request headers (authorization...). `Range` is set by the source. */
  headers?: Record<string, string>;
  /**
   * The undici dispatcher (an Agent, a ProxyAgent, a MockAgent, or one composed with
   * `interceptors.retry`); the global dispatcher when absent. Redirects are followed on top of it.
   */
  dispatcher?: Dispatcher;
  /** Redirects followed per request (default 5). */
  maxRedirections?: number;
}

function redact(url: URL): string {
  return `${url.origin}${url.pathname}`;
}

function firstHeader(value: string | string[] | undefined): string | undefined {
  return Array.isArray(value) ? value[0] : value;
}

// Destroying an unread undici body makes it emit an abort error; nobody else listens for it.
function discard(body: Dispatcher.ResponseData["body"]): void {
  body.on("error", () => undefined);
  body.destroy();
}

const CONTENT_RANGE = /^bytes\s+(\d+)-(\d+)\/(\d+|\*)$/i;
const UNSATISFIED_RANGE = /^bytes\s+\*\/(\d+)$/i;

/** Ties two optional signals into one (core's linkedSignal when both are given). */
function linkSignals(
  a: AbortSignal | undefined,
  b: AbortSignal | undefined,
): { signal: AbortSignal | undefined; dispose(): void } {
  if (!a || !b) return { signal: a ?? b, dispose() {} };
  return linkedSignal([a, b]);
}

/** The URL and redirect limit of httpSource's arguments, validated. */
function checkHttpOptions(
  url: string | URL,
  options: HttpSourceOptions,
): { target: URL; maxRedirections: number } {
  let target: URL;
  try {
    target = new URL(url);
  } catch (error) {
    throw new InvalidArgumentError(`invalid URL ${String(url)}`, {
      cause: error,
    });
  }
  if (target.protocol !== "http:" && target.protocol !== "https:") {
    throw new InvalidArgumentError(`httpSource needs an http(s) URL, got ${target.protocol}`);
  }
  const maxRedirections = options.maxRedirections ?? 5;
  if (!Number.isSafeInteger(maxRedirections) || maxRedirections < 0) {
    throw new InvalidArgumentError("maxRedirections must be a non-negative integer");
  }
  for (const name of Object.keys(options.headers ?? {})) {
    if (name.toLowerCase() === "range") {
      throw new InvalidArgumentError("httpSource sets the Range header itself");
    }
  }
  return { target, maxRedirections };
}

/** Reads a 206 body of exactly `want` bytes (its Content-Range's length). */
async function readBody(
  body: Dispatcher.ResponseData["body"],
  want: number,
  contentRange: string,
  signal: AbortSignal | undefined,
  ioError: (message: string, details?: Record<string, unknown>, cause?: unknown) => GgufError,
): Promise<Uint8Array> {
  const out = new Uint8Array(want);
  let got = 0;
  try {
    for await (const chunk of body as AsyncIterable<Uint8Array>) {
      if (got + chunk.byteLength > want) {
        throw ioError(`the body is longer than its Content-Range (${contentRange})`);
      }
      out.set(chunk, got);
      got += chunk.byteLength;
    }
  } catch (error) {
    discard(body);
    if (signal?.aborted) throw abortReason(signal);
    if (error instanceof GgufError) throw error;
    throw ioError(`reading the body failed: ${(error as Error).message}`, {}, error);
  }
  if (got !== want) throw ioError(`the body ended after ${got} of ${want} bytes`);
  return out;
}

/**
 * `length` bytes from `start`, asking again for the rest while answers stop early (a server that
 * caps its ranges), up to the end of the resource.
 */
async function readInPieces(
  fetchRange: (from: bigint, to: bigint) => Promise<Uint8Array>,
  start: bigint,
  length: number,
  size: () => bigint | undefined,
): Promise<Uint8Array> {
  const last = start + BigInt(length) - 1n;
  const first = await fetchRange(start, last);
  if (first.byteLength === length || first.byteLength === 0) return first;
  const out = new Uint8Array(length);
  out.set(first);
  let got = first.byteLength;
  while (got < length) {
    const total = size();
    if (total !== undefined && start + BigInt(got) >= total) break;
    const part = await fetchRange(start + BigInt(got), last);
    if (part.byteLength === 0) break;
    out.set(part, got);
    got += part.byteLength;
  }
  return got === length ? out : out.subarray(0, got);
}

/**
 * Any answer but 206, its body never read (a server ignoring Range would send the whole 100+ GB
 * file): a 416 past the end of the resource is an empty read, anything else an error.
 */
function nonPartialAnswer(
  { statusCode, headers, body }: Dispatcher.ResponseData,
  from: bigint,
  to: bigint,
  s: {
    learnSize(total: bigint): void;
    size(): bigint | undefined;
    ioError(message: string, details?: Record<string, unknown>): GgufError;
  },
): Uint8Array {
  discard(body);
  if (statusCode === 416) {
    const m = UNSATISFIED_RANGE.exec((firstHeader(headers["content-range"]) ?? "").trim());
    if (m) s.learnSize(BigInt(m[1]!));
    const size = s.size();
    if (size !== undefined && from >= size) return new Uint8Array(0);
    throw s.ioError(`range ${from}-${to} not satisfiable`, { status: statusCode });
  }
  throw s.ioError(
    statusCode === 200
      ? "the server ignored the Range header (200 instead of 206)"
      : `HTTP ${statusCode} for range ${from}-${to}`,
    { status: statusCode },
  );
}

/**
 * An HTTP(S) resource read with `Range: bytes=a-b` requests through undici. Every answer must be
 * `206 Partial Content` with a matching `Content-Range` (or `416` past the end); a server that
 * ignores Range gets GgufError MOESWARM_GGUF_IO and its body is not downloaded. The size comes
 * from the first answer's `Content-Range` and must not change afterwards.
 */
export function httpSource(url: string | URL, options: HttpSourceOptions = {}): ByteSource {
  const { target, maxRedirections } = checkHttpOptions(url, options);
  const dispatcher = (options.dispatcher ?? getGlobalDispatcher()).compose(
    interceptors.redirect({ maxRedirections }),
  );
  const description = redact(target);
  let size: bigint | undefined;
  let closed = false;

  const ioError = (message: string, details: Record<string, unknown> = {}, cause?: unknown) =>
    new GgufError("MOESWARM_GGUF_IO", `${description}: ${message}`, {
      cause,
      details: { url: description, ...details },
    });

  const learnSize = (total: bigint) => {
    if (size !== undefined && size !== total) {
      throw ioError(`the resource changed size from ${size} to ${total} bytes between requests`);
    }
    size = total;
  };

  // One request for [from, to]; the answer may stop early (at the end of the resource, or a
  // server that caps its ranges), the caller asks again for the rest.
  const fetchRange = async (
    from: bigint,
    to: bigint,
    signal: AbortSignal | undefined,
  ): Promise<Uint8Array> => {
    let response: Dispatcher.ResponseData;
    try {
      response = await request(target, {
        method: "GET",
        dispatcher,
        signal: signal ?? null,
        headers: { ...options.headers, range: `bytes=${from}-${to}` },
      });
    } catch (error) {
      if (signal?.aborted) throw abortReason(signal);
      throw ioError(`request failed: ${(error as Error).message}`, {}, error);
    }
    const { statusCode, headers, body } = response;
    if (statusCode !== 206) {
      return nonPartialAnswer(response, from, to, { learnSize, size: () => size, ioError });
    }
    const contentRange = (firstHeader(headers["content-range"]) ?? "").trim();
    const m = CONTENT_RANGE.exec(contentRange);
    if (!m || m[3] === "*") {
      discard(body);
      throw ioError(`206 without a usable Content-Range (${JSON.stringify(contentRange)})`);
    }
    const first = BigInt(m[1]!);
    const last = BigInt(m[2]!);
    try {
      learnSize(BigInt(m[3]!));
    } catch (error) {
      discard(body);
      throw error;
    }
    if (first !== from || last < first || last > to) {
      discard(body);
      throw ioError(`Content-Range ${contentRange} does not answer bytes=${from}-${to}`);
    }
    return readBody(body, Number(last - first + 1n), contentRange, signal, ioError);
  };

  const source: ByteSource = {
    get size() {
      return size;
    },
    description,
    async read(offset, length, opts = {}) {
      const start = checkRead(offset, length);
      throwIfAborted(options.signal);
      throwIfAborted(opts.signal);
      if (closed) throw closedError(description);
      if (length === 0 || (size !== undefined && start >= size)) return new Uint8Array(0);
      const linked = linkSignals(options.signal, opts.signal);
      try {
        return await readInPieces(
          (from, to) => fetchRange(from, to, linked.signal),
          start,
          length,
          () => size,
        );
      } finally {
        linked.dispose();
      }
    },
    close() {
      closed = true;
      return Promise.resolve();
    },
    [Symbol.asyncDispose]() {
      return source.close();
    },
  };
  return source;
}

/**
 * What readGguf and friends take: a source, a path, bytes, or a `file:`/`http(s):` URL (as a URL or
 * as a string beginning with `http://`, `https://` or `file://`).
 */
export type ByteSourceInput = ByteSource | string | Uint8Array | URL;

function isByteSource(value: unknown): value is ByteSource {
  return (
    typeof value === "object" &&
    value !== null &&
    typeof (value as ByteSource).read === "function" &&
    typeof (value as ByteSource).close === "function"
  );
}

/**
 * Opens `input` as a source. `owned` is true when this call opened it (the caller then closes it);
 * a ByteSource passed in stays the caller's.
 */
export async function openByteSource(
  input: ByteSourceInput,
  options: { signal?: AbortSignal } = {},
): Promise<{ source: ByteSource; owned: boolean }> {
  if (isByteSource(input)) return { source: input, owned: false };
  if (input instanceof Uint8Array) return { source: bufferSource(input), owned: true };
  if (typeof input === "string") {
    // "http://..." as a string is a URL, not a relative path (a path of that name needs "./")
    if (/^https?:\/\//i.test(input)) return { source: httpSource(new URL(input), options), owned: true };
    if (/^file:\/\//i.test(input))
      return { source: await fileSource(fileURLToPath(input), options), owned: true };
    return { source: await fileSource(input, options), owned: true };
  }
  if (input instanceof URL) {
    if (input.protocol === "file:")
      return { source: await fileSource(fileURLToPath(input), options), owned: true };
    if (input.protocol === "http:" || input.protocol === "https:") {
      return { source: httpSource(input, options), owned: true };
    }
    throw new InvalidArgumentError(`unsupported URL protocol ${input.protocol}`);
  }
  throw new InvalidArgumentError("expected a ByteSource, a path, a Uint8Array or a URL");
}

// Byte plumbing shared by slicing, manifests and verification: reading ranges of a source in
// bounded chunks, a source made of several ranges of another, and per-slab sha256.
import { createHash, type Hash } from "node:crypto";
import { GgufError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import type { ByteSource, ReadOptions } from "./byte-source.js";

/** Default read size: large enough for disk and HTTP throughput, small enough to keep memory flat. */
export const DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024;

/** A half-open byte range `[start, end)` of a source. */
export interface ByteRange {
  readonly start: bigint;
  readonly end: bigint;
}

export function checkChunkSize(chunkSize: number | undefined): number {
  const size = chunkSize ?? DEFAULT_CHUNK_BYTES;
  if (!Number.isSafeInteger(size) || size < 1 || size > 2 ** 30) {
    throw new InvalidArgumentError(`chunkSize must be an integer in [1, 2^30], got ${String(chunkSize)}`);
  }
  return size;
}

async function readExact(
  source: ByteSource,
  offset: bigint,
  length: number,
  signal: AbortSignal | undefined,
): Promise<Uint8Array> {
  const bytes = await source.read(offset, length, { signal });
  if (bytes.byteLength !== length) {
    throw new GgufError(
      "MOESWARM_GGUF_TRUNCATED",
      `${source.description} ends ${length - bytes.byteLength} bytes early at offset ${offset + BigInt(bytes.byteLength)}`,
      { details: { offset: offset.toString(), length } },
    );
  }
  return bytes;
}

/** The bytes of `ranges` of `source`, in order, in chunks of at most `chunkSize`. */
export async function* readRanges(
  source: ByteSource,
  ranges: Iterable<ByteRange>,
  chunkSize: number,
  signal: AbortSignal | undefined,
): AsyncGenerator<Uint8Array> {
  const chunk = BigInt(chunkSize);
  for (const { start, end } of ranges) {
    for (let pos = start; pos < end; ) {
      throwIfAborted(signal);
      const n = end - pos < chunk ? end - pos : chunk;
      yield await readExact(source, pos, Number(n), signal);
      pos += n;
    }
  }
}

/** sha256 (hex) of `[offset, offset + length)` of a source, read in bounded chunks. */
export async function sha256OfRange(
  source: ByteSource,
  offset: bigint,
  length: bigint,
  options: { signal?: AbortSignal; chunkSize?: number } = {},
): Promise<string> {
  const hash = createHash("sha256");
  for await (const bytes of readRanges(
    source,
    [{ start: offset, end: offset + length }],
    checkChunkSize(options.chunkSize),
    options.signal,
  )) {
    hash.update(bytes);
  }
  return hash.digest("hex");
}

/**
 * Hashes a byte stream as consecutive slabs of `slabBytes` each: one sha256 per slab, in order.
 * `onBytes` sees every chunk (progress, a second hash).
 */
export class SlabHasher {
  private hash: Hash = createHash("sha256");
  private filled = 0n;
  readonly digests: string[] = [];

  constructor(private readonly slabBytes: bigint) {
    if (slabBytes <= 0n) throw new InvalidArgumentError("slabBytes must be positive");
  }

  update(bytes: Uint8Array): void {
    let at = 0;
    while (at < bytes.byteLength) {
      const room = this.slabBytes - this.filled;
      const take = BigInt(bytes.byteLength - at) < room ? bytes.byteLength - at : Number(room);
      this.hash.update(at === 0 && take === bytes.byteLength ? bytes : bytes.subarray(at, at + take));
      at += take;
      this.filled += BigInt(take);
      if (this.filled === this.slabBytes) {
        this.digests.push(this.hash.digest("hex"));
        this.hash = createHash("sha256");
        this.filled = 0n;
      }
    }
  }

  /** True when every byte fed so far closed a slab. */
  get complete(): boolean {
    return this.filled === 0n;
  }
}

/**
 * A source whose bytes are the concatenation of `ranges` of `inner`: the data of a sliced tensor,
 * which the writer then reads as one range. Reads within one range return the inner read as is.
 */
export function concatRangesSource(
  inner: ByteSource,
  ranges: readonly ByteRange[],
  description?: string,
): ByteSource {
  const starts: bigint[] = [];
  let size = 0n;
  for (const r of ranges) {
    starts.push(size);
    size += r.end - r.start;
  }
  const source: ByteSource = {
    size,
    description: description ?? `${inner.description} (${ranges.length} ranges)`,
    async read(offset, length, options: ReadOptions = {}) {
      const from = BigInt(offset);
      if (from >= size || length === 0) return new Uint8Array(0);
      const to = from + BigInt(length) < size ? from + BigInt(length) : size;
      // Binary search for the range holding `from`.
      let lo = 0;
      let hi = ranges.length - 1;
      while (lo < hi) {
        const mid = (lo + hi + 1) >> 1;
        if (starts[mid]! <= from) lo = mid;
        else hi = mid - 1;
      }
      const parts: Uint8Array[] = [];
      let pos = from;
      for (let i = lo; i < ranges.length && pos < to; i++) {
        const r = ranges[i]!;
        const rangeEnd = starts[i]! + (r.end - r.start);
        const take = (to < rangeEnd ? to : rangeEnd) - pos;
        parts.push(await readExact(inner, r.start + (pos - starts[i]!), Number(take), options.signal));
        pos += take;
      }
      if (parts.length === 1) return parts[0]!;
      const out = new Uint8Array(Number(to - from));
      let at = 0;
      for (const p of parts) {
        out.set(p, at);
        at += p.byteLength;
      }
      return out;
    },
    close: () => Promise.resolve(),
    [Symbol.asyncDispose]: () => Promise.resolve(),
  };
  return source;
}

/** Contiguous runs of sorted, distinct integers: [0,1,2,5,6] -> [[0,3],[5,7]]. */
export function runsOf(sorted: readonly number[]): Array<[number, number]> {
  const runs: Array<[number, number]> = [];
  for (const v of sorted) {
    const last = runs[runs.length - 1];
    if (last && last[1] === v) last[1] = v + 1;
    else runs.push([v, v + 1]);
  }
  return runs;
}

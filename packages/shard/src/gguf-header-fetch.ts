// The asynchronous half of the GGUF reader: fetches header bytes from a ByteSource into the
// parser's window, in read-ahead blocks that grow so a header costs a handful of reads.
import { GgufError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import type { ByteSource } from "./byte-source.js";
import { type HeaderParser, truncated } from "./gguf-header-parser.js";

const MAX_BLOCK = 64 * 1024 * 1024;

/** Fetches header bytes into the parser's window: read-ahead in growing blocks. */
export class Fetcher {
  private block: number;

  constructor(
    private readonly source: ByteSource,
    private readonly parser: HeaderParser,
    private readonly signal: AbortSignal | undefined,
    blockSize: number,
  ) {
    this.block = blockSize;
    this.learnSize();
  }

  private learnSize(): void {
    const size = this.source.size;
    if (size !== undefined) {
      this.parser.eof = Math.min(
        this.parser.eof,
        size > BigInt(Number.MAX_SAFE_INTEGER) ? Number.MAX_SAFE_INTEGER : Number(size),
      );
    }
  }

  /** Grows the window to at least `need`, keeping the bytes from `keepFrom` on. */
  async grow(keepFrom: number, need: number): Promise<void> {
    throwIfAborted(this.signal);
    const p = this.parser;
    let target = Math.max(need, p.end + this.block);
    this.block = Math.max(this.block, Math.min(this.block * 2, MAX_BLOCK));
    target = Math.min(target, p.eof, p.limits.maxHeaderBytes);
    let chunk: Uint8Array;
    try {
      chunk = await this.source.read(p.end, target - p.end, { signal: this.signal });
    } catch (error) {
      if (this.signal?.aborted || error instanceof GgufError || error instanceof InvalidArgumentError)
        throw error;
      throw new GgufError(
        "MOESWARM_GGUF_IO",
        `reading ${this.source.description}: ${(error as Error).message}`,
        {
          cause: error,
        },
      );
    }
    // A source answering with more than asked is ignored beyond the request.
    if (chunk.byteLength > target - p.end) chunk = chunk.subarray(0, target - p.end);
    this.learnSize();
    const newEnd = p.end + chunk.byteLength;
    if (chunk.byteLength < target - p.end) p.eof = Math.min(p.eof, newEnd);
    if (newEnd < need) throw truncated(p.what, need, newEnd);
    const keep = p.bytes.subarray(keepFrom - p.base);
    if (keep.byteLength === 0) {
      p.setWindow(chunk, p.end);
    } else {
      const joined = new Uint8Array(keep.byteLength + chunk.byteLength);
      joined.set(keep);
      joined.set(chunk, keep.byteLength);
      p.setWindow(joined, keepFrom);
    }
  }
}

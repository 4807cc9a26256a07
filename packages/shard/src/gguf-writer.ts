// Writing GGUF files: the planned bytes as a stream of chunks, to a path (atomically) or a Writable.
import type { Writable } from "node:stream";
import { GgufError, InvalidArgumentError, onAbort, throwIfAborted } from "@moeswarm/core";
import { writeAll, writeFileAtomically } from "./atomic-file.js";
import { asPlan, type GgufPlan, type GgufTensorRange, type GgufWriteInput, toBigInt } from "./gguf-layout.js";
import { checkedNumber } from "./gguf-limits.js";

export type {
  GgufPlan,
  GgufPlannedTensor,
  GgufTensorRange,
  GgufWriteInput,
  GgufWriteTensor,
} from "./gguf-layout.js";
export { planGguf } from "./gguf-layout.js";

const DEFAULT_CHUNK = 4 * 1024 * 1024;

export interface GgufStreamOptions {
  signal?: AbortSignal;
  /** Largest chunk yielded, in bytes (default 4 MiB); tensor ranges are read in chunks this size. */
  chunkSize?: number;
  /** First byte of the file to produce (default 0), for HTTP Range answers. */
  start?: bigint | number;
  /** End (exclusive) of the bytes to produce (default `totalSize`). */
  end?: bigint | number;
}

type Segment =
  | { kind: "bytes"; start: bigint; length: bigint; bytes: Uint8Array; name?: string }
  | { kind: "zeros"; start: bigint; length: bigint }
  | { kind: "range"; start: bigint; length: bigint; range: GgufTensorRange; name: string }
  | { kind: "missing"; start: bigint; length: bigint; name: string };

function* segments(plan: GgufPlan): Generator<Segment> {
  yield { kind: "bytes", start: 0n, length: BigInt(plan.header.byteLength), bytes: plan.header };
  let pos = BigInt(plan.header.byteLength);
  for (const t of plan.tensors) {
    if (t.absoluteOffset > pos) yield { kind: "zeros", start: pos, length: t.absoluteOffset - pos };
    const { data, name } = t;
    if (data === undefined) yield { kind: "missing", start: t.absoluteOffset, length: t.nbytes, name };
    else if (data instanceof Uint8Array)
      yield { kind: "bytes", start: t.absoluteOffset, length: t.nbytes, bytes: data, name };
    else yield { kind: "range", start: t.absoluteOffset, length: t.nbytes, range: data, name };
    pos = t.absoluteOffset + t.nbytes;
  }
  if (plan.totalSize > pos) yield { kind: "zeros", start: pos, length: plan.totalSize - pos };
}

/**
 * The bytes of the planned file (or of `[start, end)` of it) as an async iterable of chunks:
 * header, then each tensor's data and padding, reading tensor ranges in bounded chunks. Validates
 * eagerly; yielded chunks may be views of the tensor buffers given, so do not modify them.
 */
export function ggufByteStream(
  input: GgufWriteInput | GgufPlan,
  options: GgufStreamOptions = {},
): AsyncIterable<Uint8Array> {
  const plan = asPlan(input);
  const chunkSize = options.chunkSize ?? DEFAULT_CHUNK;
  if (!Number.isSafeInteger(chunkSize) || chunkSize < 1 || chunkSize > 2 ** 30) {
    throw new InvalidArgumentError(`chunkSize must be an integer in [1, 2^30], got ${String(chunkSize)}`);
  }
  const start = toBigInt(options.start ?? 0, "start");
  const end = toBigInt(options.end ?? plan.totalSize, "end");
  if (start > end || end > plan.totalSize) {
    throw new InvalidArgumentError(`range [${start}, ${end}) is not inside the ${plan.totalSize}-byte file`);
  }
  for (const seg of segments(plan)) {
    if (seg.kind === "missing" && seg.start < end && seg.start + seg.length > start) {
      throw new InvalidArgumentError(
        `tensor ${JSON.stringify(seg.name)} has no data (only a header-only write may omit it)`,
      );
    }
  }
  return produce(plan, start, end, chunkSize, options.signal);
}

async function* produce(
  plan: GgufPlan,
  start: bigint,
  end: bigint,
  chunkSize: number,
  signal: AbortSignal | undefined,
): AsyncGenerator<Uint8Array> {
  const chunk = BigInt(chunkSize);
  for (const seg of segments(plan)) {
    const segEnd = seg.start + seg.length;
    if (segEnd <= start || seg.length === 0n) continue;
    if (seg.start >= end) break;
    let pos = seg.start > start ? seg.start : start;
    const stop = segEnd < end ? segEnd : end;
    while (pos < stop) {
      throwIfAborted(signal);
      const n = stop - pos < chunk ? stop - pos : chunk;
      const rel = pos - seg.start;
      switch (seg.kind) {
        case "bytes":
          yield seg.bytes.subarray(Number(rel), Number(rel + n));
          break;
        case "zeros":
          yield new Uint8Array(Number(n));
          break;
        case "range": {
          const { source, offset } = seg.range;
          const bytes = await source.read(BigInt(offset) + rel, Number(n), { signal });
          if (BigInt(bytes.byteLength) !== n) {
            throw new GgufError(
              "MOESWARM_GGUF_TRUNCATED",
              `tensor ${JSON.stringify(seg.name)}: ${source.description} ended ${n - BigInt(bytes.byteLength)} bytes early`,
              { details: { tensor: seg.name } },
            );
          }
          yield bytes;
          break;
        }
        case "missing":
          throw new InvalidArgumentError(`tensor ${JSON.stringify(seg.name)} has no data`);
      }
      pos += n;
    }
  }
}

export interface WriteGgufOptions {
  signal?: AbortSignal;
  /** Chunk size for copying tensor ranges (default 4 MiB). */
  chunkSize?: number;
  /**
   * Write the header only and extend the file to its full size without writing data: the data
   * region is a sparse hole (zeros) that costs no disk, and tensors may omit `data`. Paths only.
   */
  headerOnly?: boolean;
}

function writeChunk(sink: Writable, chunk: Uint8Array, signal: AbortSignal | undefined): Promise<void> {
  return new Promise<void>((resolve, reject) => {
    const onError = (error: Error) => {
      cleanup();
      reject(error);
    };
    const abort = onAbort(signal, (reason) => {
      cleanup();
      reject(reason);
    });
    function cleanup(): void {
      abort[Symbol.dispose]();
      sink.removeListener("error", onError);
    }
    sink.once("error", onError);
    sink.write(chunk, (error) => {
      cleanup();
      if (error) reject(error);
      else resolve();
    });
  });
}

/**
 * Writes a GGUF file to `target`: a path (written to a temporary file beside it, then renamed, so
 * readers never see half a file) or a Node Writable (left open). Returns the plan: header bytes,
 * every tensor's offset, the total size.
 */
export async function writeGguf(
  input: GgufWriteInput | GgufPlan,
  target: string | Writable,
  options: WriteGgufOptions = {},
): Promise<GgufPlan> {
  const signal = options.signal;
  throwIfAborted(signal);
  const plan = asPlan(input);
  if (typeof target === "string") {
    if (target.length === 0) throw new InvalidArgumentError("writeGguf needs a non-empty path");
    await writeFile(plan, target, options);
    return plan;
  }
  if (typeof target !== "object" || target === null || typeof target.write !== "function") {
    throw new InvalidArgumentError("writeGguf needs a path or a Writable");
  }
  if (options.headerOnly)
    throw new InvalidArgumentError("headerOnly needs a path: a stream cannot hold a sparse region");
  for await (const chunk of ggufByteStream(plan, { signal, chunkSize: options.chunkSize })) {
    await writeChunk(target, chunk, signal);
  }
  return plan;
}

async function writeFile(plan: GgufPlan, path: string, options: WriteGgufOptions): Promise<void> {
  const { signal } = options;
  const stream = options.headerOnly
    ? undefined
    : ggufByteStream(plan, { signal, chunkSize: options.chunkSize });
  await writeFileAtomically(
    path,
    async (handle) => {
      if (stream) {
        for await (const chunk of stream) {
          throwIfAborted(signal);
          await writeAll(handle, chunk);
        }
      } else {
        await handle.write(plan.header, 0, plan.header.byteLength, 0);
        throwIfAborted(signal);
        await handle.truncate(checkedNumber(plan.totalSize, "the file size", "MOESWARM_GGUF_LIMIT"));
      }
    },
    signal,
  );
}

import type { Writable } from "node:stream";
import { abortReason, GgufError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import { writeAll, writeFileAtomically } from "./atomic-file.js";
import type { ByteSource } from "./byte-source.js";
import { type GgmlType, ggmlTensorBytes, ggmlTypeTraits, isGgmlType } from "./ggml-type.js";
import {
  GGML_MAX_DIMS,
  GGML_MAX_NAME,
  GGUF_DEFAULT_ALIGNMENT,
  GGUF_KEY_GENERAL_ALIGNMENT,
  GGUF_MAGIC,
  GGUF_VERSION,
  GgufValueType,
  ggufValueTypeName,
  isGgufValueType,
} from "./gguf-constants.js";
import { checkedNumber, DEFAULT_GGUF_LIMITS } from "./gguf-limits.js";
import type { GgufArray, GgufMetadata, GgufMetadataValue } from "./gguf-metadata.js";
import type { GgufTensorInfo } from "./gguf-reader.js";

/** Bytes of a tensor taken from a range of a source (a slab of another GGUF file, say). */
export interface GgufTensorRange {
  readonly source: ByteSource;
  readonly offset: bigint | number;
  readonly length: bigint | number;
}

export interface GgufWriteTensor {
  readonly name: string;
  readonly type: GgmlType;
  /** ggml's `ne`, fastest-varying first, at most 4 entries. */
  readonly shape: readonly number[];
  /** The tensor's bytes (exactly `ggml_nbytes`). Optional only for header-only output. */
  readonly data?: Uint8Array | GgufTensorRange;
}

export interface GgufWriteInput {
  /** In the order to write (a Map, or a record whose key order is kept). */
  readonly metadata: GgufMetadata | Readonly<Record<string, GgufMetadataValue>>;
  /** Written in this order, each at the next aligned offset (as ggml and gguf-py lay them out). */
  readonly tensors: readonly GgufWriteTensor[];
  /**
   * Data alignment; defaults to the metadata's `general.alignment`, else 32. A value other than 32
   * not in the metadata is added to it as `general.alignment` (u32) so readers find it.
   */
  readonly alignment?: number;
  /** GGUF version to write (default 3; v2 has the same little-endian layout). */
  readonly version?: 2 | 3;
}

export interface GgufPlannedTensor extends GgufTensorInfo {
  readonly data: Uint8Array | GgufTensorRange | undefined;
}

/** The exact layout of a GGUF file before any byte is written. */
export interface GgufPlan {
  readonly version: 2 | 3;
  /** The metadata as written (with `general.alignment` when it was added). */
  readonly metadata: GgufMetadata;
  readonly alignment: number;
  /** Magic through the last tensor info, unpadded. */
  readonly header: Uint8Array;
  /** Where tensor data starts: `header.byteLength` rounded up to the alignment. */
  readonly dataOffset: bigint;
  readonly tensors: readonly GgufPlannedTensor[];
  /** Size of the whole file; every tensor's data is padded to the alignment, the last one too. */
  readonly totalSize: bigint;
}

const PLANS = new WeakSet<object>();
const HOST_LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
const DEFAULT_CHUNK = 4 * 1024 * 1024;
const MAX_ALIGNMENT = 2 ** 31;

function invalid(message: string, details?: Record<string, unknown>): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", message, details ? { details } : {});
}

/** A growable little-endian byte buffer for the header. */
class ByteBuilder {
  private buf = new Uint8Array(64 * 1024);
  private view = new DataView(this.buf.buffer);
  private static readonly encoder = new TextEncoder();
  length = 0;

  private reserve(n: number): void {
    const need = this.length + n;
    if (need <= this.buf.byteLength) return;
    let size = this.buf.byteLength * 2;
    while (size < need) size *= 2;
    const next = new Uint8Array(size);
    next.set(this.buf.subarray(0, this.length));
    this.buf = next;
    this.view = new DataView(next.buffer);
  }

  u8(v: number): void {
    this.reserve(1);
    this.view.setUint8(this.length, v);
    this.length += 1;
  }
  i8(v: number): void {
    this.reserve(1);
    this.view.setInt8(this.length, v);
    this.length += 1;
  }
  u16(v: number): void {
    this.reserve(2);
    this.view.setUint16(this.length, v, true);
    this.length += 2;
  }
  i16(v: number): void {
    this.reserve(2);
    this.view.setInt16(this.length, v, true);
    this.length += 2;
  }
  u32(v: number): void {
    this.reserve(4);
    this.view.setUint32(this.length, v, true);
    this.length += 4;
  }
  i32(v: number): void {
    this.reserve(4);
    this.view.setInt32(this.length, v, true);
    this.length += 4;
  }
  f32(v: number): void {
    this.reserve(4);
    this.view.setFloat32(this.length, v, true);
    this.length += 4;
  }
  f64(v: number): void {
    this.reserve(8);
    this.view.setFloat64(this.length, v, true);
    this.length += 8;
  }
  u64(v: bigint): void {
    this.reserve(8);
    this.view.setBigUint64(this.length, v, true);
    this.length += 8;
  }
  i64(v: bigint): void {
    this.reserve(8);
    this.view.setBigInt64(this.length, v, true);
    this.length += 8;
  }
  bytes(b: Uint8Array): void {
    this.reserve(b.byteLength);
    this.buf.set(b, this.length);
    this.length += b.byteLength;
  }
  /** u64 byte length, then UTF-8 bytes. */
  string(s: string): void {
    this.reserve(8 + s.length * 3);
    const start = this.length + 8;
    let n = 0;
    // Short ASCII strings (most tokens) are cheaper to copy by hand than through encodeInto.
    if (s.length <= 32) {
      const b = this.buf;
      for (; n < s.length; n++) {
        const c = s.charCodeAt(n);
        if (c >= 0x80) break;
        b[start + n] = c;
      }
      if (n < s.length) n = 0;
      else {
        this.view.setBigUint64(this.length, BigInt(n), true);
        this.length = start + n;
        return;
      }
    }
    const { written } = ByteBuilder.encoder.encodeInto(s, this.buf.subarray(start));
    this.view.setUint32(this.length, written, true);
    this.view.setUint32(this.length + 4, 0, true);
    this.length = start + written;
  }
  result(): Uint8Array {
    return this.buf.slice(0, this.length);
  }
}

const INT_RANGES: Partial<Record<GgufValueType, [number, number]>> = {
  [GgufValueType.UINT8]: [0, 0xff],
  [GgufValueType.INT8]: [-0x80, 0x7f],
  [GgufValueType.UINT16]: [0, 0xffff],
  [GgufValueType.INT16]: [-0x8000, 0x7fff],
  [GgufValueType.UINT32]: [0, 0xffffffff],
  [GgufValueType.INT32]: [-0x80000000, 0x7fffffff],
};

const TYPED_FOR: Partial<Record<GgufValueType, new (n: number) => ArrayBufferView>> = {
  [GgufValueType.UINT8]: Uint8Array,
  [GgufValueType.INT8]: Int8Array,
  [GgufValueType.UINT16]: Uint16Array,
  [GgufValueType.INT16]: Int16Array,
  [GgufValueType.UINT32]: Uint32Array,
  [GgufValueType.INT32]: Int32Array,
  [GgufValueType.FLOAT32]: Float32Array,
  [GgufValueType.UINT64]: BigUint64Array,
  [GgufValueType.INT64]: BigInt64Array,
  [GgufValueType.FLOAT64]: Float64Array,
};

function writeScalar(w: ByteBuilder, type: GgufValueType, value: unknown, where: string): void {
  const range = INT_RANGES[type];
  if (range) {
    if (typeof value !== "number" || !Number.isInteger(value) || value < range[0] || value > range[1]) {
      throw invalid(
        `${where}: ${ggufValueTypeName(type)} needs an integer in [${range[0]}, ${range[1]}], got ${String(value)}`,
      );
    }
  }
  switch (type) {
    case GgufValueType.UINT8:
      w.u8(value as number);
      return;
    case GgufValueType.INT8:
      w.i8(value as number);
      return;
    case GgufValueType.UINT16:
      w.u16(value as number);
      return;
    case GgufValueType.INT16:
      w.i16(value as number);
      return;
    case GgufValueType.UINT32:
      w.u32(value as number);
      return;
    case GgufValueType.INT32:
      w.i32(value as number);
      return;
    case GgufValueType.FLOAT32:
    case GgufValueType.FLOAT64:
      if (typeof value !== "number")
        throw invalid(`${where}: ${ggufValueTypeName(type)} needs a number, got ${typeof value}`);
      if (type === GgufValueType.FLOAT32) w.f32(value);
      else w.f64(value);
      return;
    case GgufValueType.BOOL:
      if (typeof value !== "boolean") throw invalid(`${where}: bool needs a boolean, got ${typeof value}`);
      w.u8(value ? 1 : 0);
      return;
    case GgufValueType.STRING:
      if (typeof value !== "string") throw invalid(`${where}: str needs a string, got ${typeof value}`);
      w.string(value);
      return;
    case GgufValueType.UINT64:
    case GgufValueType.INT64: {
      const v = typeof value === "number" && Number.isSafeInteger(value) ? BigInt(value) : value;
      const [lo, hi] = type === GgufValueType.UINT64 ? [0n, 2n ** 64n - 1n] : [-(2n ** 63n), 2n ** 63n - 1n];
      if (typeof v !== "bigint" || v < lo || v > hi) {
        throw invalid(
          `${where}: ${ggufValueTypeName(type)} needs an integer in [${lo}, ${hi}], got ${String(value)}`,
        );
      }
      if (type === GgufValueType.UINT64) w.u64(v);
      else w.i64(v);
      return;
    }
    default:
      throw invalid(`${where}: value type ${String(type)} is not a GGUF scalar type`);
  }
}

function writeArray(w: ByteBuilder, value: GgufArray, where: string, depth: number): void {
  if (typeof value !== "object" || value === null || value.type !== GgufValueType.ARRAY) {
    throw invalid(`${where}: expected an array value ({type: ARRAY, itemType, value})`);
  }
  // The reader's default bound; also stops a self-referencing array.
  if (depth > DEFAULT_GGUF_LIMITS.maxArrayDepth) {
    throw invalid(`${where}: arrays nested deeper than ${DEFAULT_GGUF_LIMITS.maxArrayDepth}`);
  }
  const { itemType } = value;
  const items: unknown = value.value;
  if (!isGgufValueType(itemType))
    throw invalid(`${where}: array item type ${String(itemType)} is not a GGUF type`);
  if (
    typeof items !== "object" ||
    items === null ||
    typeof (items as ArrayLike<unknown>).length !== "number" ||
    (!Array.isArray(items) && !ArrayBuffer.isView(items))
  ) {
    throw invalid(`${where}: array value must be an array or a typed array`);
  }
  const list = items as ArrayLike<unknown>;
  w.u32(itemType);
  w.u64(BigInt(list.length));
  const ctor = TYPED_FOR[itemType];
  if (ArrayBuffer.isView(list)) {
    if (!ctor || !(list instanceof ctor)) {
      throw invalid(`${where}: a ${list.constructor.name} cannot hold ${ggufValueTypeName(itemType)} items`);
    }
    if (HOST_LITTLE_ENDIAN) {
      w.bytes(new Uint8Array(list.buffer, list.byteOffset, list.byteLength));
      return;
    }
  }
  if (itemType === GgufValueType.ARRAY) {
    for (let i = 0; i < list.length; i++) writeArray(w, list[i] as GgufArray, `${where}[${i}]`, depth + 1);
    return;
  }
  if (itemType === GgufValueType.STRING) {
    for (let i = 0; i < list.length; i++) {
      const s = list[i];
      if (typeof s !== "string") throw invalid(`${where}[${i}]: str needs a string, got ${typeof s}`);
      w.string(s);
    }
    return;
  }
  for (let i = 0; i < list.length; i++) writeScalar(w, itemType, list[i], `${where}[${i}]`);
}

function writeValue(w: ByteBuilder, key: string, value: GgufMetadataValue): void {
  const where = `metadata ${JSON.stringify(key)}`;
  if (typeof value !== "object" || value === null || !isGgufValueType(value.type)) {
    throw invalid(`${where}: expected {type, value} with a GGUF value type`);
  }
  w.u32(value.type);
  if (value.type === GgufValueType.ARRAY) writeArray(w, value, where, 1);
  else writeScalar(w, value.type, value.value, where);
}

function metadataEntries(input: GgufWriteInput["metadata"]): [string, GgufMetadataValue][] {
  if (input instanceof Map) return [...input.entries()];
  if (typeof input !== "object" || input === null) throw invalid("metadata must be a Map or an object");
  return Object.entries(input as Readonly<Record<string, GgufMetadataValue>>);
}

function checkAlignment(alignment: unknown, what: string): number {
  if (
    typeof alignment !== "number" ||
    !Number.isInteger(alignment) ||
    alignment <= 0 ||
    alignment > MAX_ALIGNMENT ||
    (alignment & (alignment - 1)) !== 0
  ) {
    throw new GgufError(
      "MOESWARM_GGUF_BAD_ALIGNMENT",
      `${what} = ${String(alignment)} is not a power of two u32`,
      {
        details: { alignment: String(alignment) },
      },
    );
  }
  return alignment;
}

const NAME_ENCODER = new TextEncoder();

function isTensorRange(value: unknown): value is GgufTensorRange {
  return (
    typeof value === "object" && value !== null && "source" in value && "offset" in value && "length" in value
  );
}

function toBigInt(value: unknown, what: string): bigint {
  if (typeof value === "bigint" && value >= 0n) return value;
  if (typeof value === "number" && Number.isSafeInteger(value) && value >= 0) return BigInt(value);
  throw invalid(`${what} must be a non-negative integer, got ${String(value)}`);
}

/**
 * Computes the exact bytes of the header and the offset of every tensor, validating the input:
 * the file `ggufByteStream`/`writeGguf` produce has exactly `totalSize` bytes, so a server can
 * send `Content-Length` before reading any weight. Tensor data is not touched.
 */
export function planGguf(input: GgufWriteInput): GgufPlan {
  if (typeof input !== "object" || input === null) throw invalid("planGguf needs {metadata, tensors}");
  const version = input.version ?? GGUF_VERSION;
  if (version !== 2 && version !== 3) throw invalid(`version must be 2 or 3, got ${String(version)}`);
  if (!Array.isArray(input.tensors)) throw invalid("tensors must be an array");

  const entries = metadataEntries(input.metadata);
  const alignEntry = entries.find(([k]) => k === GGUF_KEY_GENERAL_ALIGNMENT)?.[1];
  let alignment: number;
  if (alignEntry !== undefined) {
    if (alignEntry.type !== GgufValueType.UINT32) {
      throw new GgufError("MOESWARM_GGUF_BAD_ALIGNMENT", `${GGUF_KEY_GENERAL_ALIGNMENT} must be u32`);
    }
    alignment = checkAlignment(alignEntry.value, GGUF_KEY_GENERAL_ALIGNMENT);
    if (input.alignment !== undefined && input.alignment !== alignment) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_ALIGNMENT",
        `alignment ${String(input.alignment)} disagrees with ${GGUF_KEY_GENERAL_ALIGNMENT} = ${alignment}`,
      );
    }
  } else {
    alignment = checkAlignment(input.alignment ?? GGUF_DEFAULT_ALIGNMENT, "alignment");
    if (alignment !== GGUF_DEFAULT_ALIGNMENT) {
      entries.push([GGUF_KEY_GENERAL_ALIGNMENT, { type: GgufValueType.UINT32, value: alignment }]);
    }
  }

  const w = new ByteBuilder();
  w.u32(GGUF_MAGIC);
  w.u32(version);
  w.u64(BigInt(input.tensors.length));
  w.u64(BigInt(entries.length));
  for (const [key, value] of entries) {
    if (typeof key !== "string" || key.length === 0) throw invalid("metadata keys must be non-empty strings");
    w.string(key);
    writeValue(w, key, value);
  }

  const align = BigInt(alignment);
  const pad = (n: bigint) => (align - (n % align)) % align;
  const names = new Set<string>();
  const infos: Omit<GgufPlannedTensor, "absoluteOffset">[] = [];
  let offset = 0n;
  input.tensors.forEach((t, i) => {
    if (typeof t !== "object" || t === null) throw invalid(`tensors[${i}] must be an object`);
    const { name, type, shape, data } = t;
    if (typeof name !== "string" || name.length === 0)
      throw invalid(`tensors[${i}].name must be a non-empty string`);
    const tensorError = (message: string) =>
      new GgufError("MOESWARM_GGUF_BAD_TENSOR", `tensor ${JSON.stringify(name)}: ${message}`, {
        details: { tensor: name },
      });
    if (NAME_ENCODER.encode(name).byteLength >= GGML_MAX_NAME) {
      throw tensorError(`the name is longer than ${GGML_MAX_NAME - 1} bytes`);
    }
    if (names.has(name)) throw tensorError("the name appears twice");
    names.add(name);
    if (typeof type !== "number" || !isGgmlType(type))
      throw tensorError(`unknown or removed ggml type ${String(type)}`);
    if (!Array.isArray(shape) || shape.length > GGML_MAX_DIMS) {
      throw tensorError(`shape must be an array of at most ${GGML_MAX_DIMS} dimensions`);
    }
    let nElements = 1;
    for (const ne of shape) {
      if (typeof ne !== "number" || !Number.isSafeInteger(ne) || ne < 0) {
        throw tensorError(`shape entries must be non-negative integers, got ${String(ne)}`);
      }
      nElements *= ne;
    }
    if (!Number.isSafeInteger(nElements)) throw tensorError(`shape ${shape.join("x")} has too many elements`);
    const { blockSize, name: typeName } = ggmlTypeTraits(type);
    if ((shape[0] ?? 1) % blockSize !== 0) {
      throw tensorError(
        `ne[0] = ${shape[0] ?? 1} is not a multiple of ${typeName}'s block size ${blockSize}`,
      );
    }
    const nbytes = ggmlTensorBytes(type, shape.length === 0 ? [1] : shape);
    if (data !== undefined) {
      if (data instanceof Uint8Array) {
        if (BigInt(data.byteLength) !== nbytes) {
          throw invalid(
            `tensor ${JSON.stringify(name)}: ${data.byteLength} bytes of data, the shape needs ${nbytes}`,
            {
              tensor: name,
            },
          );
        }
      } else if (isTensorRange(data)) {
        const length = toBigInt(data.length, `tensor ${JSON.stringify(name)} data length`);
        const from = toBigInt(data.offset, `tensor ${JSON.stringify(name)} data offset`);
        if (length !== nbytes) {
          throw invalid(
            `tensor ${JSON.stringify(name)}: a range of ${length} bytes, the shape needs ${nbytes}`,
            {
              tensor: name,
            },
          );
        }
        const size = data.source.size;
        if (size !== undefined && from + length > size) {
          throw invalid(
            `tensor ${JSON.stringify(name)}: range [${from}, ${from + length}) is outside ${data.source.description} (${size} bytes)`,
            { tensor: name },
          );
        }
      } else {
        throw invalid(
          `tensor ${JSON.stringify(name)}: data must be a Uint8Array or {source, offset, length}`,
        );
      }
    }
    infos.push({ name, type, shape: [...shape], nElements, nbytes, offset, data });
    offset += nbytes + pad(nbytes);
  });
  for (const t of infos) {
    w.string(t.name);
    w.u32(t.shape.length);
    for (const ne of t.shape) w.u64(BigInt(ne));
    w.u32(t.type);
    w.u64(t.offset);
  }

  const header = w.result();
  const headerSize = BigInt(header.byteLength);
  const dataOffset = headerSize + pad(headerSize);
  const plan: GgufPlan = {
    version,
    metadata: new Map(entries),
    alignment,
    header,
    dataOffset,
    tensors: infos.map((t) => ({ ...t, absoluteOffset: dataOffset + t.offset })),
    totalSize: dataOffset + offset,
  };
  PLANS.add(plan);
  return plan;
}

function asPlan(input: GgufWriteInput | GgufPlan): GgufPlan {
  return PLANS.has(input) ? (input as GgufPlan) : planGguf(input as GgufWriteInput);
}

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
    throw invalid(`chunkSize must be an integer in [1, 2^30], got ${String(chunkSize)}`);
  }
  const start = toBigInt(options.start ?? 0, "start");
  const end = toBigInt(options.end ?? plan.totalSize, "end");
  if (start > end || end > plan.totalSize) {
    throw invalid(`range [${start}, ${end}) is not inside the ${plan.totalSize}-byte file`);
  }
  for (const seg of segments(plan)) {
    if (seg.kind === "missing" && seg.start < end && seg.start + seg.length > start) {
      throw invalid(`tensor ${JSON.stringify(seg.name)} has no data (only a header-only write may omit it)`);
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
          throw invalid(`tensor ${JSON.stringify(seg.name)} has no data`);
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
    const onAbort = () => {
      cleanup();
      reject(abortReason(signal!));
    };
    const onError = (error: Error) => {
      cleanup();
      reject(error);
    };
    const cleanup = () => {
      signal?.removeEventListener("abort", onAbort);
      sink.removeListener("error", onError);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
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
    if (target.length === 0) throw invalid("writeGguf needs a non-empty path");
    await writeFile(plan, target, options);
    return plan;
  }
  if (typeof target !== "object" || target === null || typeof target.write !== "function") {
    throw invalid("writeGguf needs a path or a Writable");
  }
  if (options.headerOnly) throw invalid("headerOnly needs a path: a stream cannot hold a sparse region");
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

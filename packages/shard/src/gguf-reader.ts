import { GgufError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import { type ByteSource, type ByteSourceInput, openByteSource } from "./byte-source.js";
import { type GgmlType, ggmlTypeTraits, isGgmlType } from "./ggml-type.js";
import {
  GGML_MAX_DIMS,
  GGUF_DEFAULT_ALIGNMENT,
  GGUF_KEY_GENERAL_ALIGNMENT,
  GGUF_MAGIC,
  GgufValueType,
  ggufScalarSize,
  ggufValueTypeName,
  isGgufValueType,
} from "./gguf-constants.js";
import { type GgufLimits, resolveGgufLimits } from "./gguf-limits.js";
import type { GgufArray, GgufMetadata, GgufMetadataValue } from "./gguf-metadata.js";

/** One tensor info of a GGUF header. */
export interface GgufTensorInfo {
  readonly name: string;
  readonly type: GgmlType;
  /** ggml's `ne`, fastest-varying first (`ne[0]` is the row length); `n_dims` entries. */
  readonly shape: readonly number[];
  readonly nElements: number;
  /** Bytes of the tensor's data (`ggml_nbytes`), without padding. */
  readonly nbytes: bigint;
  /** Offset of the data from the start of the data section, as stored in the file. */
  readonly offset: bigint;
  /** Offset of the data from the start of the file: `dataOffset + offset`. */
  readonly absoluteOffset: bigint;
}

/** A parsed GGUF header: everything before the tensor data. */
export interface GgufHeader {
  readonly version: 2 | 3;
  /** Metadata in file order, each value with its GGUF type. */
  readonly metadata: GgufMetadata;
  readonly tensors: readonly GgufTensorInfo[];
  /** `general.alignment`, or 32. */
  readonly alignment: number;
  /** Bytes from the magic to the end of the last tensor info (the header before padding). */
  readonly headerSize: number;
  /** Where the data section starts: `headerSize` rounded up to `alignment`. */
  readonly dataOffset: bigint;
  /** The data section's length as ggml computes it: the end of the furthest tensor, padded. */
  readonly dataSize: bigint;
  /** Size of the source when known. */
  readonly fileSize: bigint | undefined;
}

export interface ReadGgufOptions {
  signal?: AbortSignal;
  /** Bounds on counts and lengths (defaults in DEFAULT_GGUF_LIMITS). */
  limits?: Partial<GgufLimits>;
  /**
   * First read-ahead in bytes: the source's `preferredReadSize` (16 MiB for a file, everything
   * for a buffer), else 1 MiB (HTTP). Each further read doubles it up to 64 MiB, or asks for
   * exactly what a large value needs, so a header costs a handful of reads (HTTP requests).
   */
  blockSize?: number;
  /**
   * Size of the whole file when the source holds only its beginning (header bytes kept in
   * memory, say): tensor data is checked against this instead of the source's size.
   */
  fileSize?: bigint | number;
}

const DEFAULT_BLOCK = 1024 * 1024;
const MAX_BLOCK = 64 * 1024 * 1024;

// Returned by a parse step whose item runs past the bytes fetched so far; the driver fetches more
// and parses the item again from its start. Rare (once per read-ahead block), so cheap.
const NEED: unique symbol = Symbol("need");
type Need = typeof NEED;

const HOST_LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

interface NodeBufferLike {
  utf8Slice?(start: number, end: number): string;
  toString(encoding: "utf8", start: number, end: number): string;
}

function shorten(s: string): string {
  return s.length > 80 ? `${s.slice(0, 80)}...` : s;
}

function truncated(what: string, needed: number, have: number): GgufError {
  return new GgufError(
    "MOESWARM_GGUF_TRUNCATED",
    `the file ends at byte ${have}, inside ${what} (needs ${needed})`,
    {
      details: { what, needed, fileSize: have },
    },
  );
}

function limit(what: string, value: number | bigint, max: number): GgufError {
  return new GgufError("MOESWARM_GGUF_LIMIT", `${what} is ${value}, above the limit ${max}`, {
    details: { what, value: String(value), max },
  });
}

function badTensor(name: string, message: string, details: Record<string, unknown> = {}): GgufError {
  return new GgufError("MOESWARM_GGUF_BAD_TENSOR", `tensor ${JSON.stringify(name)}: ${message}`, {
    details: { tensor: name, ...details },
  });
}

type MutableTensorInfo = { -readonly [K in keyof GgufTensorInfo]: GgufTensorInfo[K] };

/**
 * Synchronous parsing over a window of fetched bytes. Every read is bounds-checked against the
 * window first; running past it returns NEED with `need` set, never an out-of-range access.
 */
class HeaderParser {
  bytes: Uint8Array = new Uint8Array(0);
  private view: DataView = new DataView(this.bytes.buffer);
  private text: NodeBufferLike = Buffer.alloc(0);
  /** File offset of bytes[0]. */
  base = 0;
  /** File offset just past the fetched bytes. */
  end = 0;
  /** File offset of the next byte to parse. */
  pos = 0;
  /** Window end the failed item needs. */
  need = 0;
  /** Where the source ends, when known (Infinity otherwise). */
  eof = Number.POSITIVE_INFINITY;
  elementsLeft: number;
  /** What is being parsed, for messages: built only when an error needs it. */
  private ctx: "header" | "key" | "value" | "tensor" = "header";
  private ctxName: string | undefined = undefined;
  private ctxIndex = 0;

  get what(): string {
    switch (this.ctx) {
      case "header":
        return "the GGUF header";
      case "key":
        return `metadata key #${this.ctxIndex}`;
      case "value":
        return `metadata ${JSON.stringify(shorten(this.ctxName ?? ""))}`;
    }
    return this.ctxName === undefined
      ? `tensor info #${this.ctxIndex}`
      : `tensor info ${JSON.stringify(shorten(this.ctxName))}`;
  }

  constructor(readonly limits: GgufLimits) {
    this.elementsLeft = limits.maxMetadataElements;
  }

  setWindow(bytes: Uint8Array, base: number): void {
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.text = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.base = base;
    this.end = base + bytes.byteLength;
  }

  /** Marks the item as needing the window to reach `end`, or fails when it never can. */
  private needAt(end: number): Need {
    if (end > this.eof) throw truncated(this.what, end, this.eof);
    if (end > this.limits.maxHeaderBytes) throw limit("header size", end, this.limits.maxHeaderBytes);
    this.need = end;
    return NEED;
  }

  u32(p: number): number {
    return this.view.getUint32(p - this.base, true);
  }

  /** A u64 as a number: exact below 2^53, and larger values still compare as larger. */
  u64Approx(p: number): number {
    const o = p - this.base;
    return this.view.getUint32(o + 4, true) * 4294967296 + this.view.getUint32(o, true);
  }

  u64(p: number): bigint {
    return this.view.getBigUint64(p - this.base, true);
  }

  /** Ensures `n` bytes at pos are fetched; false (with `need` set) when not. */
  has(n: number): boolean {
    const e = this.pos + n;
    if (e <= this.end) return true;
    this.needAt(e);
    return false;
  }

  private decode(start: number, end: number): string {
    // Buffer's native UTF-8 slice: keeps a leading BOM (TextDecoder's default drops it) and
    // replaces invalid UTF-8 as TextDecoder does. Faster than a JS loop once strings are kept.
    const s = start - this.base;
    const e = end - this.base;
    return this.text.utf8Slice ? this.text.utf8Slice(s, e) : this.text.toString("utf8", s, e);
  }

  /** A length-prefixed string; `maxBytes` is the tensor-name bound when given. */
  string(maxBytes?: number): string | Need {
    const p = this.pos;
    if (p + 8 > this.end) return this.needAt(p + 8);
    const len = this.u64Approx(p);
    if (maxBytes !== undefined) {
      if (len > maxBytes)
        throw badTensor(`#${this.ctxIndex}`, `name of ${len} bytes, longer than ${maxBytes}`);
    } else if (len > this.limits.maxStringBytes) {
      throw limit(`a string length in ${this.what}`, len, this.limits.maxStringBytes);
    }
    const e = p + 8 + len;
    if (e > this.end) return this.needAt(e);
    this.pos = e;
    return this.decode(p + 8, e);
  }

  private scalar(type: GgufValueType): GgufMetadataValue | Need {
    if (type === GgufValueType.STRING) {
      const value = this.string();
      return value === NEED ? NEED : { type, value };
    }
    const size = ggufScalarSize(type);
    const p = this.pos;
    if (p + size > this.end) return this.needAt(p + size);
    const o = p - this.base;
    const v = this.view;
    this.pos = p + size;
    switch (type) {
      case GgufValueType.UINT8:
        return { type, value: v.getUint8(o) };
      case GgufValueType.INT8:
        return { type, value: v.getInt8(o) };
      case GgufValueType.UINT16:
        return { type, value: v.getUint16(o, true) };
      case GgufValueType.INT16:
        return { type, value: v.getInt16(o, true) };
      case GgufValueType.UINT32:
        return { type, value: v.getUint32(o, true) };
      case GgufValueType.INT32:
        return { type, value: v.getInt32(o, true) };
      case GgufValueType.FLOAT32:
        return { type, value: v.getFloat32(o, true) };
      case GgufValueType.BOOL:
        return { type, value: v.getUint8(o) !== 0 };
      case GgufValueType.UINT64:
        return { type, value: v.getBigUint64(o, true) };
      case GgufValueType.INT64:
        return { type, value: v.getBigInt64(o, true) };
      case GgufValueType.FLOAT64:
        return { type, value: v.getFloat64(o, true) };
      default:
        throw new GgufError("MOESWARM_GGUF_BAD_VALUE_TYPE", `unexpected value type ${type} in ${this.what}`);
    }
  }

  value(type: number, depth: number): GgufMetadataValue | Need {
    if (!isGgufValueType(type)) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_VALUE_TYPE",
        `${this.what} has value type ${type}, not a GGUF type`,
        {
          details: { type },
        },
      );
    }
    return type === GgufValueType.ARRAY ? this.array(depth + 1) : this.scalar(type);
  }

  private array(depth: number): GgufArray | Need {
    if (depth > this.limits.maxArrayDepth) {
      throw limit(`array nesting in ${this.what}`, depth, this.limits.maxArrayDepth);
    }
    const p = this.pos;
    if (p + 12 > this.end) return this.needAt(p + 12);
    const itemType = this.u32(p);
    if (!isGgufValueType(itemType)) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_VALUE_TYPE",
        `${this.what} has an array of value type ${itemType}, not a GGUF type`,
        { details: { type: itemType } },
      );
    }
    const n = this.u64Approx(p + 4);
    if (n > this.limits.maxArrayLength)
      throw limit(`an array length in ${this.what}`, n, this.limits.maxArrayLength);
    this.elementsLeft -= n;
    if (this.elementsLeft < 0) {
      throw limit(
        "the metadata array elements in total",
        this.limits.maxMetadataElements - this.elementsLeft,
        this.limits.maxMetadataElements,
      );
    }
    // Each element takes at least this many bytes, so a count the file cannot hold fails here,
    // before anything is allocated for it.
    const minItem =
      itemType === GgufValueType.STRING
        ? 8
        : itemType === GgufValueType.ARRAY
          ? 12
          : ggufScalarSize(itemType);
    const minEnd = p + 12 + n * minItem;
    if (minEnd > this.eof) throw truncated(this.what, minEnd, this.eof);
    if (minEnd > this.limits.maxHeaderBytes) throw limit("header size", minEnd, this.limits.maxHeaderBytes);
    this.pos = p + 12;
    switch (itemType) {
      case GgufValueType.STRING: {
        // Walk the lengths first: a vocabulary spanning several read-ahead blocks then costs
        // re-walking cheap lengths, not re-decoding strings, and the decode loop needs no checks.
        let q = this.pos;
        const max = this.limits.maxStringBytes;
        for (let i = 0; i < n; i++) {
          if (q + 8 > this.end) return this.needAt(q + 8);
          const len = this.u64Approx(q);
          if (len > max) throw limit(`a string length in ${this.what}`, len, max);
          q += 8 + len;
        }
        if (q > this.end) return this.needAt(q);
        // push, not new Array(n): V8 makes a large preallocated array a slow dictionary.
        const out: string[] = [];
        let s = this.pos;
        for (let i = 0; i < n; i++) {
          const e = s + 8 + this.view.getUint32(s - this.base, true);
          out.push(this.decode(s + 8, e));
          s = e;
        }
        this.pos = q;
        return { type: GgufValueType.ARRAY, itemType, value: out };
      }
      case GgufValueType.ARRAY: {
        const out: GgufArray[] = [];
        for (let i = 0; i < n; i++) {
          const a = this.array(depth + 1);
          if (a === NEED) return NEED;
          out.push(a);
        }
        return { type: GgufValueType.ARRAY, itemType, value: out };
      }
      case GgufValueType.BOOL: {
        if (minEnd > this.end) return this.needAt(minEnd);
        const out: boolean[] = new Array(n);
        const b = this.bytes;
        const s = this.pos - this.base;
        for (let i = 0; i < n; i++) out[i] = b[s + i] !== 0;
        this.pos = minEnd;
        return { type: GgufValueType.ARRAY, itemType, value: out };
      }
      default: {
        if (minEnd > this.end) return this.needAt(minEnd);
        const value = this.numericArray(itemType, n);
        this.pos = minEnd;
        return { type: GgufValueType.ARRAY, itemType, value } as GgufArray;
      }
    }
  }

  private numericArray(
    type: GgufValueType,
    n: number,
  ):
    | Uint8Array
    | Int8Array
    | Uint16Array
    | Int16Array
    | Uint32Array
    | Int32Array
    | Float32Array
    | BigUint64Array
    | BigInt64Array
    | Float64Array {
    const size = ggufScalarSize(type);
    const s = this.pos - this.base + this.bytes.byteOffset;
    const ctor = TYPED[type]!;
    if (HOST_LITTLE_ENDIAN) {
      // A copy into a fresh buffer: aligned for the view, and keeps the exact bits (NaN payloads).
      return new ctor(this.bytes.buffer.slice(s, s + n * size));
    }
    const out = new ctor(n);
    const v = this.view;
    const o = this.pos - this.base;
    const get = DATAVIEW_GET[type]!;
    for (let i = 0; i < n; i++) (out as unknown as (number | bigint)[])[i] = get(v, o + i * size);
    return out;
  }

  /** One key/value pair, or NEED. */
  kv(index: number): [string, GgufMetadataValue] | Need {
    this.ctx = "key";
    this.ctxName = undefined;
    this.ctxIndex = index;
    const key = this.string();
    if (key === NEED) return NEED;
    this.ctx = "value";
    this.ctxName = key;
    if (!this.has(4)) return NEED;
    const type = this.u32(this.pos);
    this.pos += 4;
    const value = this.value(type, 0);
    if (value === NEED) return NEED;
    return [key, value];
  }

  /** One tensor info, or NEED. */
  /** Offset and size of the last tensor info, as numbers (both checked below 2^53). */
  lastOffset = 0;
  lastNbytes = 0;

  tensorInfo(index: number): MutableTensorInfo | Need {
    this.ctx = "tensor";
    this.ctxName = undefined;
    this.ctxIndex = index;
    const name = this.string(this.limits.maxTensorNameBytes);
    if (name === NEED) return NEED;
    this.ctxName = name;
    if (!this.has(4)) return NEED;
    const nDims = this.u32(this.pos);
    if (nDims > GGML_MAX_DIMS)
      throw badTensor(name, `${nDims} dimensions, more than ${GGML_MAX_DIMS}`, { nDims });
    if (!this.has(4 + 8 * nDims + 12)) return NEED;
    let p = this.pos + 4;
    const shape: number[] = [];
    // Numbers, not bigints: thousands of tensors, and every value is bounded by 2^53 - 1 anyway.
    let elements = 1;
    for (let d = 0; d < nDims; d++, p += 8) {
      const ne = this.u64Approx(p);
      if (ne > Number.MAX_SAFE_INTEGER) {
        throw badTensor(name, `ne[${d}] = ${this.u64(p)} is not a valid element count`, {
          dim: d,
          ne: this.u64(p).toString(),
        });
      }
      shape.push(ne);
      elements *= ne;
    }
    // A product past 2^53 - 1 compares larger even where the float rounds.
    if (elements > Number.MAX_SAFE_INTEGER) {
      throw badTensor(name, `shape ${shape.join("x")} has too many elements`, { shape });
    }
    const type = this.u32(p);
    if (!isGgmlType(type)) throw badTensor(name, `unknown or removed ggml type ${type}`, { type });
    const { blockSize, typeSize, name: typeName } = ggmlTypeTraits(type);
    const ne0 = nDims === 0 ? 1 : shape[0]!;
    if (ne0 % blockSize !== 0) {
      throw badTensor(name, `ne[0] = ${ne0} is not a multiple of ${typeName}'s block size ${blockSize}`, {
        ne0,
        blockSize,
      });
    }
    const nbytes = (elements / blockSize) * typeSize;
    if (nbytes > Number.MAX_SAFE_INTEGER) throw badTensor(name, `${nbytes} bytes is too large`, { shape });
    const offset = this.u64Approx(p + 4);
    if (offset > Number.MAX_SAFE_INTEGER) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_OFFSET",
        `tensor ${JSON.stringify(name)}: offset ${this.u64(p + 4)} is past any file`,
        {
          details: { tensor: name, offset: this.u64(p + 4).toString() },
        },
      );
    }
    this.pos = p + 12;
    this.lastOffset = offset;
    this.lastNbytes = nbytes;
    return {
      name,
      type,
      shape,
      nElements: elements,
      nbytes: BigInt(nbytes),
      offset: BigInt(offset),
      absoluteOffset: 0n,
    };
  }
}

type TypedCtor = new (
  arg: ArrayBufferLike | number,
) =>
  | Uint8Array
  | Int8Array
  | Uint16Array
  | Int16Array
  | Uint32Array
  | Int32Array
  | Float32Array
  | BigUint64Array
  | BigInt64Array
  | Float64Array;

const TYPED: Partial<Record<GgufValueType, TypedCtor>> = {
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

const DATAVIEW_GET: Partial<Record<GgufValueType, (v: DataView, o: number) => number | bigint>> = {
  [GgufValueType.UINT8]: (v, o) => v.getUint8(o),
  [GgufValueType.INT8]: (v, o) => v.getInt8(o),
  [GgufValueType.UINT16]: (v, o) => v.getUint16(o, true),
  [GgufValueType.INT16]: (v, o) => v.getInt16(o, true),
  [GgufValueType.UINT32]: (v, o) => v.getUint32(o, true),
  [GgufValueType.INT32]: (v, o) => v.getInt32(o, true),
  [GgufValueType.FLOAT32]: (v, o) => v.getFloat32(o, true),
  [GgufValueType.UINT64]: (v, o) => v.getBigUint64(o, true),
  [GgufValueType.INT64]: (v, o) => v.getBigInt64(o, true),
  [GgufValueType.FLOAT64]: (v, o) => v.getFloat64(o, true),
};

/** Fetches header bytes into the parser's window: read-ahead in growing blocks. */
class Fetcher {
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

/**
 * Reads the header of a GGUF file (v2 or v3, little-endian): metadata with value types, tensor
 * infos, alignment and data offset. Reads only the header's bytes, in a few large reads, so a
 * 100+ GB model over HTTP costs a few requests. Every count, length and offset is checked before
 * use; a malformed or hostile file gets a GgufError with a code, never a huge allocation.
 */
export async function readGguf(input: ByteSourceInput, options: ReadGgufOptions = {}): Promise<GgufHeader> {
  const limits = resolveGgufLimits(options.limits);
  const requested = options.blockSize;
  const declared = options.fileSize;
  if (
    declared !== undefined &&
    !(typeof declared === "bigint" ? declared >= 0n : Number.isSafeInteger(declared) && declared >= 0)
  ) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `fileSize must be a non-negative integer, got ${String(declared)}`,
    );
  }
  const declaredSize = declared === undefined ? undefined : BigInt(declared);
  if (
    requested !== undefined &&
    (!Number.isSafeInteger(requested) || requested < 64 || requested > 2 ** 31 - 1)
  ) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `blockSize must be an integer in [64, 2^31 - 1], got ${String(requested)}`,
    );
  }
  throwIfAborted(options.signal);
  const { source, owned } = await openByteSource(input, { signal: options.signal });
  try {
    const preferred = source.preferredReadSize;
    const blockSize =
      requested ??
      (typeof preferred === "number" && Number.isSafeInteger(preferred) && preferred > 0
        ? Math.min(preferred, 2 ** 31 - 1)
        : DEFAULT_BLOCK);
    return await parseHeader(source, limits, options.signal, blockSize, declaredSize);
  } finally {
    if (owned) await source.close();
  }
}

async function parseHeader(
  source: ByteSource,
  limits: GgufLimits,
  signal: AbortSignal | undefined,
  blockSize: number,
  declaredSize: bigint | undefined,
): Promise<GgufHeader> {
  const parser = new HeaderParser(limits);
  const fetcher = new Fetcher(source, parser, signal, blockSize);

  await fetcher.grow(0, 0);
  if (parser.end < 4)
    throw new GgufError("MOESWARM_GGUF_BAD_MAGIC", "the file is shorter than the GGUF magic");
  if (parser.u32(0) !== GGUF_MAGIC) {
    const b = parser.bytes;
    throw new GgufError(
      "MOESWARM_GGUF_BAD_MAGIC",
      `not a GGUF file: starts with ${[...b.subarray(0, 4)].map((x) => x.toString(16).padStart(2, "0")).join(" ")}`,
    );
  }
  if (parser.end < 24) await fetcher.grow(0, 24);
  const version = parser.u32(4);
  if ((version & 0xffff) === 0 && version !== 0) {
    // gguf.cpp's test: a byte-swapped small version reads as 0xVV000000.
    throw new GgufError(
      "MOESWARM_GGUF_UNSUPPORTED_VERSION",
      `version field 0x${version.toString(16)}: a big-endian GGUF file; only little-endian files are supported`,
      { details: { version, bigEndian: true } },
    );
  }
  if (version !== 2 && version !== 3) {
    throw new GgufError(
      "MOESWARM_GGUF_UNSUPPORTED_VERSION",
      version === 1
        ? "GGUF v1 is not supported (only v2 and v3)"
        : `GGUF version ${version} is not supported (only v2 and v3)`,
      { details: { version } },
    );
  }
  const nTensors = parser.u64Approx(8);
  const nKv = parser.u64Approx(16);
  if (nTensors > limits.maxTensorCount) throw limit("the tensor count", nTensors, limits.maxTensorCount);
  if (nKv > limits.maxKvCount) throw limit("the metadata key count", nKv, limits.maxKvCount);
  // Smallest encodings: a kv is 8 (key length) + 4 (type) + 1; a tensor info 8 + 4 + 4 + 8.
  const minEnd = 24 + nKv * 13 + nTensors * 24;
  if (minEnd > parser.eof)
    throw truncated(`${nKv} metadata pairs and ${nTensors} tensor infos`, minEnd, parser.eof);
  parser.pos = 24;

  const metadata = new Map<string, GgufMetadataValue>();
  for (let i = 0; i < nKv; i++) {
    const start = parser.pos;
    const budget = parser.elementsLeft;
    let kv = parser.kv(i);
    while (kv === NEED) {
      await fetcher.grow(start, parser.need);
      parser.pos = start;
      parser.elementsLeft = budget;
      kv = parser.kv(i);
    }
    if (metadata.has(kv[0])) {
      throw new GgufError(
        "MOESWARM_GGUF_DUPLICATE_KEY",
        `metadata key ${JSON.stringify(kv[0])} appears twice`,
        {
          details: { key: kv[0] },
        },
      );
    }
    metadata.set(kv[0], kv[1]);
  }

  let alignment = GGUF_DEFAULT_ALIGNMENT;
  const align = metadata.get(GGUF_KEY_GENERAL_ALIGNMENT);
  if (align !== undefined) {
    if (align.type !== GgufValueType.UINT32) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_ALIGNMENT",
        `${GGUF_KEY_GENERAL_ALIGNMENT} must be u32, not ${align.type === GgufValueType.ARRAY ? "arr" : ggufValueTypeName(align.type)}`,
      );
    }
    alignment = align.value;
    if (alignment === 0 || (alignment & (alignment - 1)) !== 0) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_ALIGNMENT",
        `${GGUF_KEY_GENERAL_ALIGNMENT} = ${alignment} is not a power of two`,
        {
          details: { alignment },
        },
      );
    }
  }

  const tensors: MutableTensorInfo[] = [];
  const offsets: number[] = [];
  const sizes: number[] = [];
  const names = new Set<string>();
  for (let i = 0; i < nTensors; i++) {
    const start = parser.pos;
    let t = parser.tensorInfo(i);
    while (t === NEED) {
      await fetcher.grow(start, parser.need);
      parser.pos = start;
      t = parser.tensorInfo(i);
    }
    if (names.has(t.name)) throw badTensor(t.name, "the name appears twice");
    names.add(t.name);
    if (parser.lastOffset % alignment !== 0) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_ALIGNMENT",
        `tensor ${JSON.stringify(t.name)}: offset ${t.offset} is not a multiple of the alignment ${alignment}`,
        { details: { tensor: t.name, offset: t.offset.toString(), alignment } },
      );
    }
    tensors.push(t);
    offsets.push(parser.lastOffset);
    sizes.push(parser.lastNbytes);
  }

  const headerSize = parser.pos;
  const dataStart = Math.ceil(headerSize / alignment) * alignment;
  const dataOffset = BigInt(dataStart);
  const sourceSize = source.size ?? (Number.isFinite(parser.eof) ? BigInt(parser.eof) : undefined);
  if (declaredSize !== undefined && sourceSize !== undefined && declaredSize < sourceSize) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `fileSize ${declaredSize} is smaller than the source (${sourceSize} bytes)`,
    );
  }
  const fileSize = declaredSize ?? sourceSize;
  // Every bound below is checked in numbers: a file past 2^53 bytes (8 PiB) does not exist.
  const limitEnd =
    fileSize === undefined || fileSize > BigInt(Number.MAX_SAFE_INTEGER)
      ? Number.MAX_SAFE_INTEGER
      : Number(fileSize);
  if (tensors.length > 0 && dataStart > limitEnd) {
    throw truncated("the padding before the tensor data", dataStart, limitEnd);
  }

  let dataSize = 0;
  let ordered = true;
  for (let i = 0; i < tensors.length; i++) {
    const t = tensors[i]!;
    const offset = offsets[i]!;
    const nbytes = sizes[i]!;
    const absolute = dataStart + offset;
    if (absolute + nbytes > limitEnd) {
      const where = fileSize === undefined ? "past 2^53 bytes" : `outside the ${fileSize}-byte file`;
      throw new GgufError(
        "MOESWARM_GGUF_BAD_OFFSET",
        `tensor ${JSON.stringify(t.name)}: data [${dataOffset + t.offset}, ${dataOffset + t.offset + t.nbytes}) lies ${where}`,
        {
          details: {
            tensor: t.name,
            offset: (dataOffset + t.offset).toString(),
            nbytes: t.nbytes.toString(),
          },
        },
      );
    }
    t.absoluteOffset = BigInt(absolute);
    const padded = Math.ceil((offset + nbytes) / alignment) * alignment;
    if (padded > dataSize) dataSize = padded;
    if (i > 0 && offset < offsets[i - 1]!) ordered = false;
  }
  checkOverlaps(tensors, offsets, sizes, ordered);

  return {
    version,
    metadata,
    tensors,
    alignment,
    headerSize,
    dataOffset,
    dataSize: BigInt(dataSize),
    fileSize,
  };
}

function checkOverlaps(
  tensors: readonly GgufTensorInfo[],
  offsets: readonly number[],
  sizes: readonly number[],
  ordered: boolean,
): void {
  // Writers lay tensors out in order, so sorting is usually unnecessary.
  const order: number[] = [];
  for (let i = 0; i < tensors.length; i++) if (sizes[i]! > 0) order.push(i);
  if (!ordered) order.sort((a, b) => offsets[a]! - offsets[b]!);
  for (let k = 1; k < order.length; k++) {
    const prev = order[k - 1]!;
    const cur = order[k]!;
    if (offsets[prev]! + sizes[prev]! > offsets[cur]!) {
      const a = tensors[prev]!.name;
      const b = tensors[cur]!.name;
      throw new GgufError(
        "MOESWARM_GGUF_BAD_OFFSET",
        `tensors ${JSON.stringify(a)} and ${JSON.stringify(b)} overlap`,
        {
          details: { tensors: [a, b] },
        },
      );
    }
  }
}

/** Finds a tensor info by name. */
export function findTensor(header: Pick<GgufHeader, "tensors">, name: string): GgufTensorInfo | undefined {
  return header.tensors.find((t) => t.name === name);
}

// The synchronous half of the GGUF reader: parses metadata and tensor infos out of a window of
// bytes already fetched, bounds-checking every read; the reader's driver fetches more on NEED.
import { GgufError } from "@moeswarm/core";
import { ggmlTypeTraits, isGgmlType } from "./ggml-type.js";
import { GGML_MAX_DIMS, GgufValueType, ggufScalarSize, isGgufValueType } from "./gguf-constants.js";
import type { MutableTensorInfo } from "./gguf-header.js";
import type { GgufLimits } from "./gguf-limits.js";
import type { GgufArray, GgufMetadataValue } from "./gguf-metadata.js";

// Returned by a parse step whose item runs past the bytes fetched so far; the driver fetches more
// and parses the item again from its start. Rare (once per read-ahead block), so cheap.
export const NEED: unique symbol = Symbol("need");
export type Need = typeof NEED;

const HOST_LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

interface NodeBufferLike {
  utf8Slice?(start: number, end: number): string;
  toString(encoding: "utf8", start: number, end: number): string;
}

function shorten(s: string): string {
  return s.length > 80 ? `${s.slice(0, 80)}...` : s;
}

export function truncated(what: string, needed: number, have: number): GgufError {
  return new GgufError(
    "MOESWARM_GGUF_TRUNCATED",
    `the file ends at byte ${have}, inside ${what} (needs ${needed})`,
    {
      details: { what, needed, fileSize: have },
    },
  );
}

export function limit(what: string, value: number | bigint, max: number): GgufError {
  return new GgufError("MOESWARM_GGUF_LIMIT", `${what} is ${value}, above the limit ${max}`, {
    details: { what, value: String(value), max },
  });
}

export function badTensor(name: string, message: string, details: Record<string, unknown> = {}): GgufError {
  return new GgufError("MOESWARM_GGUF_BAD_TENSOR", `tensor ${JSON.stringify(name)}: ${message}`, {
    details: { tensor: name, ...details },
  });
}

/**
 * Synchronous parsing over a window of fetched bytes. Every read is bounds-checked against the
 * window first; running past it returns NEED with `need` set, never an out-of-range access.
 */
export class HeaderParser {
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

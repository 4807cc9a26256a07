// Encoding of GGUF metadata values into the header bytes, validating each value against its type.
import { InvalidArgumentError } from "@moeswarm/core";
import { GgufValueType, ggufValueTypeName, isGgufValueType } from "./gguf-constants.js";
import { DEFAULT_GGUF_LIMITS } from "./gguf-limits.js";
import type { GgufArray, GgufMetadataValue } from "./gguf-metadata.js";

const HOST_LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** A growable little-endian byte buffer for the header. */
export class ByteBuilder {
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
      throw new InvalidArgumentError(
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
        throw new InvalidArgumentError(
          `${where}: ${ggufValueTypeName(type)} needs a number, got ${typeof value}`,
        );
      if (type === GgufValueType.FLOAT32) w.f32(value);
      else w.f64(value);
      return;
    case GgufValueType.BOOL:
      if (typeof value !== "boolean")
        throw new InvalidArgumentError(`${where}: bool needs a boolean, got ${typeof value}`);
      w.u8(value ? 1 : 0);
      return;
    case GgufValueType.STRING:
      if (typeof value !== "string")
        throw new InvalidArgumentError(`${where}: str needs a string, got ${typeof value}`);
      w.string(value);
      return;
    case GgufValueType.UINT64:
    case GgufValueType.INT64: {
      const v = typeof value === "number" && Number.isSafeInteger(value) ? BigInt(value) : value;
      const [lo, hi] = type === GgufValueType.UINT64 ? [0n, 2n ** 64n - 1n] : [-(2n ** 63n), 2n ** 63n - 1n];
      if (typeof v !== "bigint" || v < lo || v > hi) {
        throw new InvalidArgumentError(
          `${where}: ${ggufValueTypeName(type)} needs an integer in [${lo}, ${hi}], got ${String(value)}`,
        );
      }
      if (type === GgufValueType.UINT64) w.u64(v);
      else w.i64(v);
      return;
    }
    default:
      throw new InvalidArgumentError(`${where}: value type ${String(type)} is not a GGUF scalar type`);
  }
}

function writeArray(w: ByteBuilder, value: GgufArray, where: string, depth: number): void {
  if (typeof value !== "object" || value === null || value.type !== GgufValueType.ARRAY) {
    throw new InvalidArgumentError(`${where}: expected an array value ({type: ARRAY, itemType, value})`);
  }
  // The reader's default bound; also stops a self-referencing array.
  if (depth > DEFAULT_GGUF_LIMITS.maxArrayDepth) {
    throw new InvalidArgumentError(
      `${where}: arrays nested deeper than ${DEFAULT_GGUF_LIMITS.maxArrayDepth}`,
    );
  }
  const { itemType } = value;
  const items: unknown = value.value;
  if (!isGgufValueType(itemType))
    throw new InvalidArgumentError(`${where}: array item type ${String(itemType)} is not a GGUF type`);
  if (
    typeof items !== "object" ||
    items === null ||
    typeof (items as ArrayLike<unknown>).length !== "number" ||
    (!Array.isArray(items) && !ArrayBuffer.isView(items))
  ) {
    throw new InvalidArgumentError(`${where}: array value must be an array or a typed array`);
  }
  const list = items as ArrayLike<unknown>;
  w.u32(itemType);
  w.u64(BigInt(list.length));
  const ctor = TYPED_FOR[itemType];
  if (ArrayBuffer.isView(list)) {
    if (!ctor || !(list instanceof ctor)) {
      throw new InvalidArgumentError(
        `${where}: a ${list.constructor.name} cannot hold ${ggufValueTypeName(itemType)} items`,
      );
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
      if (typeof s !== "string")
        throw new InvalidArgumentError(`${where}[${i}]: str needs a string, got ${typeof s}`);
      w.string(s);
    }
    return;
  }
  for (let i = 0; i < list.length; i++) writeScalar(w, itemType, list[i], `${where}[${i}]`);
}

export function writeValue(w: ByteBuilder, key: string, value: GgufMetadataValue): void {
  const where = `metadata ${JSON.stringify(key)}`;
  if (typeof value !== "object" || value === null || !isGgufValueType(value.type)) {
    throw new InvalidArgumentError(`${where}: expected {type, value} with a GGUF value type`);
  }
  w.u32(value.type);
  if (value.type === GgufValueType.ARRAY) writeArray(w, value, where, 1);
  else writeScalar(w, value.type, value.value, where);
}

import { InvalidArgumentError } from "./errors.js";
import { decodeBf16, decodeF16 } from "./half.js";
import { Slab } from "./slab.js";

/**
 * Element types a `TensorView` can hold. Half types keep their raw bits in a `Uint16Array`
 * (JavaScript has no 16-bit float array on Node 20); convert with `toF32`.
 */
export type Dtype = "f32" | "f16" | "bf16" | "i32" | "f64";

/** The typed array that stores each dtype. */
export interface DtypeArrayMap {
  f32: Float32Array;
  f16: Uint16Array;
  bf16: Uint16Array;
  i32: Int32Array;
  f64: Float64Array;
}

export type DtypeArray<D extends Dtype = Dtype> = DtypeArrayMap[D];

/** A shaped, typed view over one contiguous row-major typed array (last dimension fastest). */
export interface TensorView<D extends Dtype = Dtype> {
  readonly dtype: D;
  readonly shape: readonly number[];
  readonly data: DtypeArrayMap[D];
}

const SIZES: Readonly<Record<Dtype, number>> = { f32: 4, f16: 2, bf16: 2, i32: 4, f64: 8 };

const CTORS: { readonly [D in Dtype]: { new (n: number): DtypeArrayMap[D]; readonly name: string } } = {
  f32: Float32Array,
  f16: Uint16Array,
  bf16: Uint16Array,
  i32: Int32Array,
  f64: Float64Array,
};

export const DTYPES: readonly Dtype[] = Object.freeze(["f32", "f16", "bf16", "i32", "f64"]);

export function isDtype(value: unknown): value is Dtype {
  return typeof value === "string" && Object.hasOwn(SIZES, value);
}

function checkDtype(dtype: unknown): asserts dtype is Dtype {
  if (!isDtype(dtype)) {
    throw new InvalidArgumentError(
      `unknown dtype ${JSON.stringify(dtype)}; expected one of ${DTYPES.join(", ")}`,
    );
  }
}

/** Bytes per element of `dtype`. */
export function dtypeSize(dtype: Dtype): number {
  checkDtype(dtype);
  return SIZES[dtype];
}

/** Number of elements of a shape (1 for a scalar `[]`); rejects negative, fractional or unsafe dims. */
export function shapeSize(shape: readonly number[]): number {
  if (!Array.isArray(shape)) {
    throw new InvalidArgumentError("a shape must be an array of integers");
  }
  let n = 1;
  for (const d of shape) {
    if (!Number.isSafeInteger(d) || d < 0) {
      throw new InvalidArgumentError(
        `shape [${shape.join(", ")}]: dimension ${String(d)} is not a non-negative integer`,
      );
    }
    n *= d;
    if (!Number.isSafeInteger(n)) {
      throw new InvalidArgumentError(`shape [${shape.join(", ")}] has more than 2^53 elements`);
    }
  }
  return n;
}

/** Bytes a tensor of `dtype` and `shape` occupies. */
export function tensorByteSize(dtype: Dtype, shape: readonly number[]): number {
  const bytes = shapeSize(shape) * dtypeSize(dtype);
  if (!Number.isSafeInteger(bytes)) {
    throw new InvalidArgumentError("tensor byte size exceeds 2^53");
  }
  return bytes;
}

/**
 * Wraps `data` as a tensor of `dtype` and `shape` (no copy). Without `data`, allocates zeros.
 * The array must be the dtype's array type and hold exactly the shape's number of elements.
 */
export function tensor<D extends Dtype>(
  dtype: D,
  shape: readonly number[],
  data?: DtypeArrayMap[D],
): TensorView<D> {
  checkDtype(dtype);
  const n = shapeSize(shape);
  const ctor = CTORS[dtype];
  if (data === undefined) {
    // a zero tensor is an explicit request, but keep it inside what a typed array can hold
    if (n * SIZES[dtype] > 2 ** 32) {
      throw new InvalidArgumentError(
        `shape [${shape.join(", ")}] is too large to allocate (${n * SIZES[dtype]} bytes)`,
      );
    }
    return Object.freeze({ dtype, shape: Object.freeze([...shape]), data: new ctor(n) });
  }
  if (!(data instanceof ctor)) {
    throw new InvalidArgumentError(`dtype ${dtype} needs a ${ctor.name}, got ${describe(data)}`);
  }
  if (data.length !== n) {
    throw new InvalidArgumentError(
      `shape [${shape.join(", ")}] has ${n} elements but the ${ctor.name} holds ${data.length}`,
    );
  }
  return Object.freeze({ dtype, shape: Object.freeze([...shape]), data });
}

function describe(value: unknown): string {
  if (value === null) return "null";
  if (typeof value === "object") return (value as object).constructor?.name ?? "object";
  return typeof value;
}

const copies = new Slab();

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/**
 * Reads little-endian element bytes as the dtype's typed array. The result is a view over `bytes`
 * (no copy) when the host is little-endian and `bytes.byteOffset` is a multiple of the element
 * size; otherwise the elements are copied once into a fresh array. `copy: true` always copies.
 */
export function typedArrayFromBytes<D extends Dtype>(
  dtype: D,
  bytes: Uint8Array,
  options: { copy?: boolean } = {},
): DtypeArrayMap[D] {
  checkDtype(dtype);
  const size = SIZES[dtype];
  if (!(bytes instanceof Uint8Array) || bytes.byteLength % size !== 0) {
    throw new InvalidArgumentError(
      `${dtype} data must be a Uint8Array whose length is a multiple of ${size}`,
    );
  }
  const n = bytes.byteLength / size;
  const ctor = CTORS[dtype] as unknown as new (
    buffer: ArrayBufferLike,
    offset?: number,
    length?: number,
  ) => DtypeArrayMap[D];
  if (LITTLE_ENDIAN) {
    if (!options.copy && bytes.byteOffset % size === 0) return new ctor(bytes.buffer, bytes.byteOffset, n);
    const copy = copies.alloc(bytes.byteLength);
    copy.set(bytes);
    return new ctor(copy.buffer, copy.byteOffset, n);
  }
  const out = new CTORS[dtype](n);
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  for (let i = 0; i < n; i++) {
    const o = i * size;
    if (dtype === "f32") out[i] = dv.getFloat32(o, true);
    else if (dtype === "f64") out[i] = dv.getFloat64(o, true);
    else if (dtype === "i32") out[i] = dv.getInt32(o, true);
    else out[i] = dv.getUint16(o, true);
  }
  return out;
}

/**
 * The little-endian bytes of a typed array: a view (no copy) on little-endian hosts, a
 * byte-swapped copy elsewhere.
 */
export function bytesOf(
  data: Float32Array | Float64Array | Int32Array | Uint16Array | Uint8Array,
): Uint8Array {
  if (LITTLE_ENDIAN || data.BYTES_PER_ELEMENT === 1) {
    return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  }
  const out = new Uint8Array(data.byteLength);
  const dv = new DataView(out.buffer);
  for (let i = 0; i < data.length; i++) {
    if (data instanceof Float32Array) dv.setFloat32(i * 4, data[i]!, true);
    else if (data instanceof Float64Array) dv.setFloat64(i * 8, data[i]!, true);
    else if (data instanceof Int32Array) dv.setInt32(i * 4, data[i]!, true);
    else dv.setUint16(i * 2, data[i]!, true);
  }
  return out;
}

/** The bytes of a tensor's elements (little-endian; see `bytesOf`). */
export function tensorBytes(t: TensorView): Uint8Array {
  return bytesOf(t.data);
}

/**
 * Values of a tensor as f32. An f32 tensor returns its own `data` (no copy) unless `copy` is
 * set; f16/bf16 are decoded exactly; i32 and f64 are rounded to the nearest f32.
 */
export function toF32(t: TensorView, options: { copy?: boolean } = {}): Float32Array {
  checkDtype(t.dtype);
  switch (t.dtype) {
    case "f32":
      return options.copy ? (t.data as Float32Array).slice() : (t.data as Float32Array);
    case "f16":
      return decodeF16(t.data as Uint16Array);
    case "bf16":
      return decodeBf16(t.data as Uint16Array);
    default:
      return Float32Array.from(t.data as Int32Array | Float64Array);
  }
}

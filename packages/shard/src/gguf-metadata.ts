import { GgufError } from "@moeswarm/core";
import { GgufValueType, ggufValueTypeName } from "./gguf-constants.js";

/**
 * One metadata value with its GGUF type, so a file read and written again is byte-identical
 * (a `5` stored as UINT32 stays UINT32). The reader returns numeric arrays as typed arrays (exact
 * bits, compact); the writer also takes plain arrays.
 */
export type GgufMetadataValue = GgufScalarValue | GgufArray;

export type GgufScalarValue =
  | {
      readonly type:
        | GgufValueType.UINT8
        | GgufValueType.INT8
        | GgufValueType.UINT16
        | GgufValueType.INT16
        | GgufValueType.UINT32
        | GgufValueType.INT32
        | GgufValueType.FLOAT32
        | GgufValueType.FLOAT64;
      readonly value: number;
    }
  | { readonly type: GgufValueType.UINT64 | GgufValueType.INT64; readonly value: bigint }
  | { readonly type: GgufValueType.BOOL; readonly value: boolean }
  | { readonly type: GgufValueType.STRING; readonly value: string };

/** Element containers per array item type. */
export interface GgufArrayItems {
  [GgufValueType.UINT8]: Uint8Array | readonly number[];
  [GgufValueType.INT8]: Int8Array | readonly number[];
  [GgufValueType.UINT16]: Uint16Array | readonly number[];
  [GgufValueType.INT16]: Int16Array | readonly number[];
  [GgufValueType.UINT32]: Uint32Array | readonly number[];
  [GgufValueType.INT32]: Int32Array | readonly number[];
  [GgufValueType.FLOAT32]: Float32Array | readonly number[];
  [GgufValueType.BOOL]: readonly boolean[];
  [GgufValueType.STRING]: readonly string[];
  /** Arrays of arrays: each inner array carries its own item type, as on disk. */
  [GgufValueType.ARRAY]: readonly GgufArray[];
  [GgufValueType.UINT64]: BigUint64Array | readonly bigint[];
  [GgufValueType.INT64]: BigInt64Array | readonly bigint[];
  [GgufValueType.FLOAT64]: Float64Array | readonly number[];
}

export type GgufArrayOf<T extends GgufValueType> = {
  readonly type: GgufValueType.ARRAY;
  readonly itemType: T;
  readonly value: GgufArrayItems[T];
};

export type GgufArray = { [T in GgufValueType]: GgufArrayOf<T> }[GgufValueType];

/** Metadata in file order. */
export type GgufMetadata = ReadonlyMap<string, GgufMetadataValue>;

/** Builders for typed values: `ggufValue.u32(5)`, `ggufValue.array(GgufValueType.STRING, tokens)`. */
export const ggufValue = {
  u8: (value: number): GgufMetadataValue => ({ type: GgufValueType.UINT8, value }),
  i8: (value: number): GgufMetadataValue => ({ type: GgufValueType.INT8, value }),
  u16: (value: number): GgufMetadataValue => ({ type: GgufValueType.UINT16, value }),
  i16: (value: number): GgufMetadataValue => ({ type: GgufValueType.INT16, value }),
  u32: (value: number): GgufMetadataValue => ({ type: GgufValueType.UINT32, value }),
  i32: (value: number): GgufMetadataValue => ({ type: GgufValueType.INT32, value }),
  f32: (value: number): GgufMetadataValue => ({ type: GgufValueType.FLOAT32, value }),
  f64: (value: number): GgufMetadataValue => ({ type: GgufValueType.FLOAT64, value }),
  u64: (value: bigint | number): GgufMetadataValue => ({ type: GgufValueType.UINT64, value: BigInt(value) }),
  i64: (value: bigint | number): GgufMetadataValue => ({ type: GgufValueType.INT64, value: BigInt(value) }),
  bool: (value: boolean): GgufMetadataValue => ({ type: GgufValueType.BOOL, value }),
  str: (value: string): GgufMetadataValue => ({ type: GgufValueType.STRING, value }),
  array: <T extends GgufValueType>(itemType: T, value: GgufArrayItems[T]): GgufArrayOf<T> => ({
    type: GgufValueType.ARRAY,
    itemType,
    value,
  }),
} as const;

/** A plain JS value: number, bigint, boolean, string, or (nested) arrays of them. */
export type GgufPlainValue =
  | number
  | bigint
  | boolean
  | string
  | ArrayLike<number>
  | ArrayLike<bigint>
  | readonly GgufPlainValue[];

/** The value without its type tag (typed arrays stay typed arrays). */
export function plainValue(value: GgufMetadataValue): GgufPlainValue {
  if (value.type !== GgufValueType.ARRAY) return value.value;
  if (value.itemType === GgufValueType.ARRAY) return value.value.map(plainValue);
  return value.value;
}

type MetadataHolder = GgufMetadata | { readonly metadata: GgufMetadata };

function metadataOf(holder: MetadataHolder): GgufMetadata {
  return holder instanceof Map ? holder : (holder as { readonly metadata: GgufMetadata }).metadata;
}

function missing(key: string, want: string, got?: GgufMetadataValue): GgufError {
  const found =
    got === undefined
      ? "absent"
      : got.type === GgufValueType.ARRAY
        ? `arr[${ggufValueTypeName(got.itemType)}]`
        : ggufValueTypeName(got.type);
  return new GgufError("MOESWARM_GGUF_MISSING_KEY", `metadata key ${key}: expected ${want}, found ${found}`, {
    details: { key, expected: want, found },
  });
}

function isIntegerType(type: GgufValueType): boolean {
  return type <= GgufValueType.INT32 || type === GgufValueType.UINT64 || type === GgufValueType.INT64;
}

function lookup<T>(
  holder: MetadataHolder,
  key: string,
  want: string,
  convert: (v: GgufMetadataValue) => T | undefined,
  fallback: T | undefined,
  hasFallback: boolean,
): T {
  const v = metadataOf(holder).get(key);
  if (v === undefined) {
    if (hasFallback) return fallback as T;
    throw missing(key, want);
  }
  const out = convert(v);
  if (out === undefined) throw missing(key, want, v);
  return out;
}

function scalarNumber(v: GgufMetadataValue): number | undefined {
  if (v.type === GgufValueType.ARRAY) return undefined;
  const x = v.value;
  if (typeof x === "bigint") return Number.isSafeInteger(Number(x)) ? Number(x) : undefined;
  return typeof x === "number" ? x : undefined;
}

/**
 * Typed getters. Each throws GgufError MOESWARM_GGUF_MISSING_KEY when the key is absent or of an
 * incompatible type; with a `fallback` argument an absent key returns it instead (a present key of
 * the wrong type still throws). Numeric getters accept any numeric GGUF type, since converters
 * disagree on u32/i32/u64 for the same key; 64-bit values must be safe integers.
 */
export function getString(holder: MetadataHolder, key: string, ...fallback: [string?]): string {
  return lookup(
    holder,
    key,
    "str",
    (v) => (v.type === GgufValueType.STRING ? v.value : undefined),
    fallback[0],
    fallback.length > 0,
  );
}

export function getNumber(holder: MetadataHolder, key: string, ...fallback: [number?]): number {
  return lookup(holder, key, "number", scalarNumber, fallback[0], fallback.length > 0);
}

/** An integer-typed value (u8..i64) as a number. */
export function getInteger(holder: MetadataHolder, key: string, ...fallback: [number?]): number {
  return lookup(
    holder,
    key,
    "integer",
    (v) => (isIntegerType(v.type) ? scalarNumber(v) : undefined),
    fallback[0],
    fallback.length > 0,
  );
}

/** An integer-typed value (u8..i64) as a bigint, exact for any 64-bit value. */
export function getBigInt(holder: MetadataHolder, key: string, ...fallback: [bigint?]): bigint {
  return lookup(
    holder,
    key,
    "integer",
    (v) =>
      isIntegerType(v.type) && v.type !== GgufValueType.ARRAY
        ? BigInt(v.value as number | bigint)
        : undefined,
    fallback[0],
    fallback.length > 0,
  );
}

export function getBool(holder: MetadataHolder, key: string, ...fallback: [boolean?]): boolean {
  return lookup(
    holder,
    key,
    "bool",
    (v) => (v.type === GgufValueType.BOOL ? v.value : undefined),
    fallback[0],
    fallback.length > 0,
  );
}

export function getArray(holder: MetadataHolder, key: string): GgufArray {
  return lookup(
    holder,
    key,
    "arr",
    (v) => (v.type === GgufValueType.ARRAY ? v : undefined),
    undefined,
    false,
  );
}

export function getStringArray(
  holder: MetadataHolder,
  key: string,
  ...fallback: [(readonly string[])?]
): readonly string[] {
  return lookup(
    holder,
    key,
    "arr[str]",
    (v) => (v.type === GgufValueType.ARRAY && v.itemType === GgufValueType.STRING ? v.value : undefined),
    fallback[0],
    fallback.length > 0,
  );
}

/**
 * A numeric array (any numeric item type) as numbers; also a single numeric value as a
 * one-element array, since per-layer hyper-parameters are stored either way.
 */
export function getNumberArray(
  holder: MetadataHolder,
  key: string,
  ...fallback: [(readonly number[])?]
): readonly number[] {
  return lookup(
    holder,
    key,
    "number or arr[number]",
    (v): readonly number[] | undefined => {
      if (v.type !== GgufValueType.ARRAY) {
        const n = scalarNumber(v);
        return n === undefined ? undefined : [n];
      }
      if (
        v.itemType === GgufValueType.ARRAY ||
        v.itemType === GgufValueType.STRING ||
        v.itemType === GgufValueType.BOOL
      ) {
        return undefined;
      }
      const out: number[] = [];
      for (const x of v.value as ArrayLike<number | bigint> & Iterable<number | bigint>) {
        const n = Number(x);
        if (typeof x === "bigint" && !Number.isSafeInteger(n)) return undefined;
        out.push(n);
      }
      return out;
    },
    fallback[0],
    fallback.length > 0,
  );
}

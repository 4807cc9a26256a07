/**
 * GGUF format constants, copied from ggml/include/gguf.h and ggml/include/ggml.h of the pinned
 * llama.cpp release (80fb11ac).
 */

/** "GGUF" read as a little-endian u32 (`GGUF_MAGIC` in gguf.h is the 4-byte string). */
export const GGUF_MAGIC = 0x46554747;
/** `GGUF_VERSION`: the version this package writes by default. */
export const GGUF_VERSION = 3;
/** `GGUF_DEFAULT_ALIGNMENT`: tensor data alignment when `general.alignment` is absent. */
export const GGUF_DEFAULT_ALIGNMENT = 32;
/** `GGUF_KEY_GENERAL_ALIGNMENT`: the only key the format itself interprets (must be UINT32). */
export const GGUF_KEY_GENERAL_ALIGNMENT = "general.alignment";
/** `GGML_MAX_DIMS`: a tensor has at most this many dimensions. */
export const GGML_MAX_DIMS = 4;
/** `GGML_MAX_NAME`: ggml keeps tensor names in a char[64], so a name has at most 63 bytes. */
export const GGML_MAX_NAME = 64;

/** Metadata value types, mirroring `enum gguf_type` of gguf.h exactly. */
export enum GgufValueType {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
}

/** `GGUF_TYPE_COUNT`: value types are `0 <= t < GGUF_TYPE_COUNT`. */
export const GGUF_TYPE_COUNT = 13;

export function isGgufValueType(value: number): value is GgufValueType {
  return Number.isInteger(value) && value >= 0 && value < GGUF_TYPE_COUNT;
}

/** ggml's `GGUF_TYPE_NAME` (u8, i8, ..., str, arr), for messages and the CLI. */
export function ggufValueTypeName(type: number): string {
  return VALUE_TYPE_NAMES[type] ?? `unknown(${type})`;
}

const VALUE_TYPE_NAMES: readonly string[] = [
  "u8",
  "i8",
  "u16",
  "i16",
  "u32",
  "i32",
  "f32",
  "bool",
  "str",
  "arr",
  "u64",
  "i64",
  "f64",
];

/**
 * Encoded size in bytes of a fixed-size value type (`GGUF_TYPE_SIZE` in gguf.cpp); 0 for STRING
 * and ARRAY, whose size depends on the value.
 */
export function ggufScalarSize(type: GgufValueType): number {
  return SCALAR_SIZES[type] ?? 0;
}

const SCALAR_SIZES: readonly number[] = [1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8];

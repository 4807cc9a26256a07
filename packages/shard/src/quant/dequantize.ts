import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import { type GgmlType, ggmlTypeName, ggmlTypeTraits, isGgmlType } from "../ggml-type.js";
import { BLOCK_DEQUANTIZERS, type BlockDequantizer } from "./dequantize-blocks.js";

/** Types `dequantize` decodes, in enum order. */
export const DEQUANTIZABLE_TYPES: readonly GgmlType[] = Object.freeze(
  [...BLOCK_DEQUANTIZERS.keys()].sort((a, b) => a - b),
);

/** True if `dequantize` supports the type. */
export function canDequantize(type: number): type is GgmlType {
  return BLOCK_DEQUANTIZERS.has(type);
}

function dequantizerOf(type: number): BlockDequantizer {
  const fn = BLOCK_DEQUANTIZERS.get(type);
  if (!fn) {
    throw new GgufError(
      "MOESWARM_GGUF_UNSUPPORTED_TYPE",
      `no dequantiser for ggml type ${isGgmlType(type) ? ggmlTypeName(type) : type}`,
      { details: { type } },
    );
  }
  return fn;
}

function checkCount(name: string, value: number): void {
  if (!Number.isSafeInteger(value) || value < 0) {
    throw new InvalidArgumentError(`${name} must be a non-negative integer, got ${value}`);
  }
}

/** Blocks of `nElements` values; validates the count against the type and the byte length. */
function blocksOf(type: GgmlType, bytes: Uint8Array, nElements: number): number {
  if (!(bytes instanceof Uint8Array)) {
    throw new InvalidArgumentError("bytes must be a Uint8Array");
  }
  checkCount("nElements", nElements);
  const { blockSize, typeSize, name } = ggmlTypeTraits(type);
  if (nElements % blockSize !== 0) {
    throw new InvalidArgumentError(
      `${nElements} elements are not a whole number of ${name} blocks of ${blockSize}`,
      { details: { type, nElements, blockSize } },
    );
  }
  const nBlocks = nElements / blockSize;
  if (bytes.byteLength !== nBlocks * typeSize) {
    throw new InvalidArgumentError(
      `${nElements} ${name} values take ${nBlocks * typeSize} bytes, got ${bytes.byteLength}`,
      { details: { type, nElements, expected: nBlocks * typeSize, actual: bytes.byteLength } },
    );
  }
  return nBlocks;
}

function checkOut(out: unknown, n: number, ctor: typeof Float32Array | typeof Float64Array): void {
  if (out === undefined) return;
  if (!(out instanceof ctor) || out.length !== n) {
    throw new InvalidArgumentError(`out must be a ${ctor.name} of exactly ${n} elements`);
  }
}

/**
 * Dequantises `nElements` values of a ggml type to f32, bit for bit what ggml's
 * `ggml_get_type_traits(type)->to_float` (`dequantize_row_*`) writes at the pinned llama.cpp release.
 * `bytes` must hold exactly the blocks of those values. `out`, when given, receives them and is
 * returned (exactly `nElements` long).
 */
export function dequantize(
  type: GgmlType,
  bytes: Uint8Array,
  nElements: number,
  out?: Float32Array,
): Float32Array {
  const fn = dequantizerOf(type);
  const nBlocks = blocksOf(type, bytes, nElements);
  checkOut(out, nElements, Float32Array);
  const dst = out ?? new Float32Array(nElements);
  fn(bytes, 0, nBlocks, dst, 0);
  return dst;
}

/**
 * The same values as {@link dequantize}, widened to f64 for an f64 oracle.
 *
 * These are the f32 weights ggml itself materialises (its `to_float` output: what a dequantised
 * copy, get_rows or a dequantise-then-matmul path compute with), not `scale * q` re-derived in f64.
 * The two are the same number for F32/F16/BF16, Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, IQ4_NL, IQ4_XS, TQ1_0,
 * TQ2_0, NVFP4, Q1_0, Q2_0 (every product of an f16 scale and the small integers fits 24 bits) and
 * MXFP4 (short of overflow); they can differ in the last f32 bit for the types with an offset
 * (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K: `d*q + m` is rounded in f32) and for Q8_K (an f32 scale).
 */
export function dequantizeF64(
  type: GgmlType,
  bytes: Uint8Array,
  nElements: number,
  out?: Float64Array,
): Float64Array {
  const fn = dequantizerOf(type);
  const nBlocks = blocksOf(type, bytes, nElements);
  checkOut(out, nElements, Float64Array);
  const tmp = new Float32Array(nElements);
  fn(bytes, 0, nBlocks, tmp, 0);
  const dst = out ?? new Float64Array(nElements);
  dst.set(tmp);
  return dst;
}

/**
 * Dequantises `nRows` contiguous rows of `ne0` values (a 2-D tensor, or any tensor viewed as rows),
 * checking that each row is a whole number of blocks as ggml requires.
 */
export function dequantizeRows(type: GgmlType, bytes: Uint8Array, ne0: number, nRows: number): Float32Array {
  dequantizerOf(type);
  checkCount("ne0", ne0);
  checkCount("nRows", nRows);
  const { blockSize, name } = ggmlTypeTraits(type);
  if (ne0 % blockSize !== 0) {
    throw new InvalidArgumentError(`ne0=${ne0} is not a multiple of ${name}'s block size ${blockSize}`, {
      details: { type, ne0, blockSize },
    });
  }
  const n = ne0 * nRows;
  checkCount("ne0 * nRows", n);
  return dequantize(type, bytes, n);
}

/**
 * Dequantises slab `index` (one expert) of a 3-D tensor `[ne0, ne1, ne2]` whose packed bytes are
 * `tensorBytes`: the `ne0 * ne1` values of `ne[2] = index`. Only that slab's bytes are read.
 */
export function dequantizeSlab(
  type: GgmlType,
  tensorBytes: Uint8Array,
  shape: readonly [number, number, number],
  index: number,
): Float32Array {
  dequantizerOf(type);
  const [ne0, ne1, ne2] = shape;
  for (const [k, v] of [
    ["ne0", ne0],
    ["ne1", ne1],
    ["ne2", ne2],
    ["index", index],
  ] as const) {
    checkCount(k, v);
  }
  if (index >= ne2) {
    throw new InvalidArgumentError(`slab ${index} is out of range 0..${ne2 - 1}`);
  }
  const { blockSize, typeSize, name } = ggmlTypeTraits(type);
  if (ne0 % blockSize !== 0) {
    throw new InvalidArgumentError(`ne0=${ne0} is not a multiple of ${name}'s block size ${blockSize}`);
  }
  const slabBytes = (ne0 / blockSize) * typeSize * ne1;
  checkCount("slab bytes", slabBytes * ne2);
  if (tensorBytes.byteLength !== slabBytes * ne2) {
    throw new InvalidArgumentError(
      `a ${name} tensor [${ne0}, ${ne1}, ${ne2}] takes ${slabBytes * ne2} bytes, got ${tensorBytes.byteLength}`,
    );
  }
  return dequantize(type, tensorBytes.subarray(index * slabBytes, (index + 1) * slabBytes), ne0 * ne1);
}

import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import { GgmlType, ggmlTypeName, ggmlTypeTraits, isGgmlType } from "../ggml-type.js";
import { BLOCK_QUANTIZERS, type BlockQuantizer } from "./quantize-blocks.js";

/** Types `quantize` encodes, in enum order. */
export const QUANTIZABLE_TYPES: readonly GgmlType[] = Object.freeze(
  [...BLOCK_QUANTIZERS.keys()].sort((a, b) => a - b),
);

/** True if `quantize` supports the type. */
export function canQuantize(type: number): type is GgmlType {
  return BLOCK_QUANTIZERS.has(type);
}

// Float types convert any value, NaN and infinities included, exactly as ggml does.
const FLOAT_TYPES = new Set<number>([GgmlType.F32, GgmlType.F16, GgmlType.BF16]);

function quantizerOf(type: number): BlockQuantizer {
  const fn = BLOCK_QUANTIZERS.get(type);
  if (!fn) {
    throw new GgufError(
      "MOESWARM_GGUF_UNSUPPORTED_TYPE",
      `no quantiser for ggml type ${isGgmlType(type) ? ggmlTypeName(type) : type}`,
      { details: { type } },
    );
  }
  return fn;
}

/**
 * Quantises f32 values to a ggml type, byte for byte what `ggml_quantize_chunk(type, values, dst,
 * 0, nRows, ne0, NULL)` writes at the pinned llama.cpp release (the reference quantisers, no
 * importance matrix; Q8_K, which ggml_quantize_chunk does not take, as `quantize_row_q8_K_ref`).
 * A reference implementation for building test and demo models, not a fast one.
 *
 * `ne0` is the row length (default: all values are one row); it must be a multiple of the type's
 * block size and divide `values.length`. Block types reject NaN and infinities, for which ggml's
 * arithmetic is undefined behaviour; F32/F16/BF16 convert them.
 */
export function quantize(type: GgmlType, values: Float32Array, ne0?: number): Uint8Array {
  const fn = quantizerOf(type);
  if (!(values instanceof Float32Array)) {
    throw new InvalidArgumentError("values must be a Float32Array");
  }
  const { blockSize, typeSize, name } = ggmlTypeTraits(type);
  const rowLength = ne0 ?? values.length;
  if (values.length === 0 && ne0 === undefined) return new Uint8Array(0);
  if (!Number.isSafeInteger(rowLength) || rowLength <= 0 || values.length % rowLength !== 0) {
    throw new InvalidArgumentError(
      `ne0=${rowLength} must be a positive integer dividing the ${values.length} values`,
      { details: { ne0: rowLength, length: values.length } },
    );
  }
  if (rowLength % blockSize !== 0) {
    throw new InvalidArgumentError(
      `ne0=${rowLength} is not a multiple of ${name}'s block size ${blockSize}`,
      { details: { type, ne0: rowLength, blockSize } },
    );
  }
  if (!FLOAT_TYPES.has(type)) {
    for (let i = 0; i < values.length; i++) {
      if (!Number.isFinite(values[i]!)) {
        throw new InvalidArgumentError(
          "MOESWARM_NUMERIC",
          `values[${i}] is ${values[i]}: ${name} quantisation needs finite values`,
          { details: { index: i } },
        );
      }
    }
  }
  const nBlocks = values.length / blockSize;
  const dst = new Uint8Array(nBlocks * typeSize);
  fn(values, 0, nBlocks, dst, 0);
  return dst;
}

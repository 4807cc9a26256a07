import { GgufError } from "@moeswarm/core";

/**
 * ggml tensor types, mirroring `enum ggml_type` of ggml/include/ggml.h at the pinned llama.cpp
 * release (v0.4.0, 80fb11ac). Removed values are kept as comments, as in the header.
 */
export enum GgmlType {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  // Q4_2 = 4, support has been removed
  // Q4_3 = 5, support has been removed
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  // Q4_0_4_4 = 31, Q4_0_4_8 = 32, Q4_0_8_8 = 33: removed from gguf files (runtime repacking)
  TQ1_0 = 34,
  TQ2_0 = 35,
  // IQ4_NL_4_4 = 36, IQ4_NL_4_8 = 37, IQ4_NL_8_8 = 38: removed (runtime repacking)
  MXFP4 = 39,
  NVFP4 = 40,
  Q1_0 = 41,
  Q2_0 = 42,
}

/** Block size (elements) and type size (bytes per block) of one ggml type. */
export interface GgmlTypeTraits {
  readonly type: GgmlType;
  /** ggml's `type_name`. */
  readonly name: string;
  readonly blockSize: number;
  readonly typeSize: number;
  readonly quantized: boolean;
}

const QK_K = 256;

// (block size, type size) copied from GGML_QUANT_SIZES in gguf-py/gguf/constants.py of the
// pinned release, which mirrors type_traits in ggml/src/ggml.c.
const SIZES: ReadonlyArray<[GgmlType, string, number, number]> = [
  [GgmlType.F32, "f32", 1, 4],
  [GgmlType.F16, "f16", 1, 2],
  [GgmlType.Q4_0, "q4_0", 32, 2 + 16],
  [GgmlType.Q4_1, "q4_1", 32, 2 + 2 + 16],
  [GgmlType.Q5_0, "q5_0", 32, 2 + 4 + 16],
  [GgmlType.Q5_1, "q5_1", 32, 2 + 2 + 4 + 16],
  [GgmlType.Q8_0, "q8_0", 32, 2 + 32],
  // gguf-py lists 4 + 4 + 32 here, which is stale: ggml.c says sizeof(block_q8_1) = 2 f16 + 32
  [GgmlType.Q8_1, "q8_1", 32, 2 + 2 + 32],
  [GgmlType.Q2_K, "q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4],
  [GgmlType.Q3_K, "q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12],
  [GgmlType.Q4_K, "q4_K", QK_K, 2 + 2 + QK_K / 2 + 12],
  [GgmlType.Q5_K, "q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12],
  [GgmlType.Q6_K, "q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16],
  [GgmlType.Q8_K, "q8_K", QK_K, 4 + QK_K + QK_K / 8],
  [GgmlType.IQ2_XXS, "iq2_xxs", QK_K, 2 + QK_K / 4],
  [GgmlType.IQ2_XS, "iq2_xs", QK_K, 2 + QK_K / 4 + QK_K / 32],
  [GgmlType.IQ3_XXS, "iq3_xxs", QK_K, 2 + QK_K / 4 + QK_K / 8],
  [GgmlType.IQ1_S, "iq1_s", QK_K, 2 + QK_K / 8 + QK_K / 16],
  [GgmlType.IQ4_NL, "iq4_nl", 32, 2 + 16],
  [GgmlType.IQ3_S, "iq3_s", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4],
  [GgmlType.IQ2_S, "iq2_s", QK_K, 2 + QK_K / 4 + QK_K / 16],
  [GgmlType.IQ4_XS, "iq4_xs", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64],
  [GgmlType.I8, "i8", 1, 1],
  [GgmlType.I16, "i16", 1, 2],
  [GgmlType.I32, "i32", 1, 4],
  [GgmlType.I64, "i64", 1, 8],
  [GgmlType.F64, "f64", 1, 8],
  [GgmlType.IQ1_M, "iq1_m", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32],
  [GgmlType.BF16, "bf16", 1, 2],
  [GgmlType.TQ1_0, "tq1_0", QK_K, 2 + 4 * 13],
  [GgmlType.TQ2_0, "tq2_0", QK_K, 2 + 64],
  [GgmlType.MXFP4, "mxfp4", 32, 1 + 16],
  [GgmlType.NVFP4, "nvfp4", 64, 4 + 32],
  [GgmlType.Q1_0, "q1_0", 128, 2 + 16],
  [GgmlType.Q2_0, "q2_0", 64, 2 + 16],
];

const UNQUANTIZED = new Set([
  GgmlType.F32,
  GgmlType.F16,
  GgmlType.BF16,
  GgmlType.F64,
  GgmlType.I8,
  GgmlType.I16,
  GgmlType.I32,
  GgmlType.I64,
]);

const TRAITS = new Map<number, GgmlTypeTraits>(
  SIZES.map(([type, name, blockSize, typeSize]) => [
    type,
    Object.freeze({ type, name, blockSize, typeSize, quantized: !UNQUANTIZED.has(type) }),
  ]),
);

/** Every type a GGUF file may hold at the pinned release. */
export const GGML_TYPES: readonly GgmlTypeTraits[] = [...TRAITS.values()];

export function isGgmlType(value: number): value is GgmlType {
  return TRAITS.has(value);
}

/** Traits of a type; a typed error for a removed or unknown value. */
export function ggmlTypeTraits(type: number): GgmlTypeTraits {
  const t = TRAITS.get(type);
  if (!t)
    throw new GgufError("MOESWARM_GGUF_BAD_TENSOR", `unknown or removed ggml type ${type}`, {
      details: { type },
    });
  return t;
}

export function ggmlTypeName(type: number): string {
  return TRAITS.get(type)?.name ?? `unknown(${type})`;
}

/**
 * Bytes of a contiguous tensor of this type and shape (`ggml_nbytes` for a packed tensor):
 * `ne[0]` must be a multiple of the block size. Exact in bigint, so a 100+ GB file is right.
 */
export function ggmlTensorBytes(type: number, shape: readonly (number | bigint)[]): bigint {
  const { blockSize, typeSize, name } = ggmlTypeTraits(type);
  if (shape.length === 0) return BigInt(typeSize);
  const ne0 = BigInt(shape[0]!);
  if (ne0 % BigInt(blockSize) !== 0n) {
    throw new GgufError(
      "MOESWARM_GGUF_BAD_TENSOR",
      `ne[0]=${ne0} is not a multiple of ${name}'s block size ${blockSize}`,
    );
  }
  let rows = 1n;
  for (let i = 1; i < shape.length; i++) rows *= BigInt(shape[i]!);
  return (ne0 / BigInt(blockSize)) * BigInt(typeSize) * rows;
}

/** Bytes of one row of `ne0` elements. */
export function ggmlRowBytes(type: number, ne0: number): number {
  return Number(ggmlTensorBytes(type, [ne0]));
}

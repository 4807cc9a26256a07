// Reference quantisers, one per ggml type, each a transcription of what `ggml_quantize_chunk`
// runs without an importance matrix at the pinned llama.cpp release (`quantize_row_*_ref` in
// ggml/src/ggml-quants.c; `quantize_iq4_nl`/`quantize_iq4_xs` with ntry 7; the row converters of
// ggml.c for F16/BF16), so the bytes are identical to ggml's. Every float expression is replayed in
// f32 in C's evaluation order; C's float -> integer conversions are replayed as x86 does them, and
// C's truth tests on floats are written as comparisons with 0 (a NaN is true in C, false in JS).
import { GgmlType } from "../ggml-type.js";
import type { BlockQuantizer } from "./quantize-common.js";
import { mxfp4, nvfp4 } from "./quantize-fp4.js";
import { iq4_nl, iq4_xs, tq1_0, tq2_0 } from "./quantize-iq-ternary.js";
import { q2_K, q3_K, q4_K, q5_K, q6_K, q8_K } from "./quantize-k.js";
import { bf16, f16, f32, q1_0, q2_0, q4_0, q4_1, q5_0, q5_1, q8_0 } from "./quantize-legacy.js";

export type { BlockQuantizer } from "./quantize-common.js";

/** The reference quantiser of each supported type. */
export const BLOCK_QUANTIZERS: ReadonlyMap<GgmlType, BlockQuantizer> = new Map<GgmlType, BlockQuantizer>([
  [GgmlType.F32, f32],
  [GgmlType.F16, f16],
  [GgmlType.BF16, bf16],
  [GgmlType.Q4_0, q4_0],
  [GgmlType.Q4_1, q4_1],
  [GgmlType.Q5_0, q5_0],
  [GgmlType.Q5_1, q5_1],
  [GgmlType.Q8_0, q8_0],
  [GgmlType.Q2_K, q2_K],
  [GgmlType.Q3_K, q3_K],
  [GgmlType.Q4_K, q4_K],
  [GgmlType.Q5_K, q5_K],
  [GgmlType.Q6_K, q6_K],
  [GgmlType.Q8_K, q8_K],
  [GgmlType.IQ4_NL, iq4_nl],
  [GgmlType.IQ4_XS, iq4_xs],
  [GgmlType.TQ1_0, tq1_0],
  [GgmlType.TQ2_0, tq2_0],
  [GgmlType.MXFP4, mxfp4],
  [GgmlType.NVFP4, nvfp4],
  [GgmlType.Q1_0, q1_0],
  [GgmlType.Q2_0, q2_0],
]);

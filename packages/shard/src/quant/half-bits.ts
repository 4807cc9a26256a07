// f16/bf16 at the bit level, as ggml converts them (ggml/src/ggml-impl.h). The values agree with
// @moeswarm/core's conversions; these work on raw bits so that NaN payloads and signs come out
// exactly as ggml writes them (core's value-level helpers canonicalise NaN).

let f16Bits: Uint32Array | undefined;
let f16Values: Float32Array | undefined;

function buildTable(): Uint32Array {
  const t = new Uint32Array(65536);
  const v = new Float32Array(t.buffer);
  for (let h = 0; h < 65536; h++) {
    const sign = (h & 0x8000) << 16;
    const e = (h >>> 10) & 0x1f;
    const m = h & 0x3ff;
    if (e === 31) {
      // ggml_compute_fp16_to_fp32 scales by 2^-112 in float, which quiets a signalling NaN
      t[h] = (sign | 0x7f800000 | (m << 13) | (m !== 0 ? 0x400000 : 0)) >>> 0;
    } else {
      v[h] = (sign ? -1 : 1) * (e === 0 ? m * 2 ** -24 : (1 + m / 1024) * 2 ** (e - 15));
    }
  }
  return t;
}

/** f32 bits of every f16 value, indexed by the f16 bits (ggml's GGML_FP16_TO_FP32). */
export function f16ToF32BitsTable(): Uint32Array {
  f16Bits ??= buildTable();
  return f16Bits;
}

/** The same table viewed as values. */
export function f16ToF32Table(): Float32Array {
  f16Values ??= new Float32Array(f16ToF32BitsTable().buffer);
  return f16Values;
}

/** ggml_compute_fp32_to_bf16 on f32 bits: round to nearest even, NaN keeps its top half, made quiet. */
export function f32BitsToBf16Bits(bits: number): number {
  if ((bits & 0x7fffffff) >>> 0 > 0x7f800000) return ((bits >>> 16) | 64) & 0xffff;
  return ((bits + (0x7fff + ((bits >>> 16) & 1))) >>> 16) & 0xffff;
}

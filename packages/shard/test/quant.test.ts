// Quantiser/dequantiser API behaviour that does not need ggml: validation, helpers, known answers
// and error bounds. Bit-exactness against ggml is in quant-ggml.test.ts.

import { encodeBf16, encodeF16, GgufError, InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import {
  canDequantize,
  canQuantize,
  DEQUANTIZABLE_TYPES,
  dequantize,
  dequantizeF64,
  dequantizeRows,
  dequantizeSlab,
  GgmlType,
  ggmlTypeName,
  ggmlTypeTraits,
  QUANTIZABLE_TYPES,
  quantize,
} from "../src/index.js";
import { gaussian, rng } from "./quant-inputs.js";

const g = gaussian(rng(42));
const gaussianValues = (n: number) => Float32Array.from({ length: n }, () => g());
const names = (types: readonly GgmlType[]) => types.map((type) => ({ type, name: ggmlTypeName(type) }));

function expectCode(fn: () => unknown, cls: typeof GgufError | typeof InvalidArgumentError, code: string) {
  try {
    fn();
  } catch (err) {
    expect(err).toBeInstanceOf(cls);
    expect(isMoeswarmError(err) && err.code).toBe(code);
    return;
  }
  throw new Error("expected a throw");
}

describe("supported types", () => {
  it("dequantises at least the types the project relies on", () => {
    const required = [
      GgmlType.F32,
      GgmlType.F16,
      GgmlType.BF16,
      GgmlType.Q8_0,
      GgmlType.Q4_0,
      GgmlType.Q4_1,
      GgmlType.Q5_0,
      GgmlType.Q5_1,
      GgmlType.Q2_K,
      GgmlType.Q3_K,
      GgmlType.Q4_K,
      GgmlType.Q5_K,
      GgmlType.Q6_K,
      GgmlType.Q8_K,
      GgmlType.MXFP4,
      GgmlType.IQ4_NL,
      GgmlType.IQ4_XS,
    ];
    for (const t of required) expect(canDequantize(t), ggmlTypeName(t)).toBe(true);
    for (const t of [
      GgmlType.F16,
      GgmlType.BF16,
      GgmlType.Q8_0,
      GgmlType.Q4_0,
      GgmlType.Q4_K,
      GgmlType.Q6_K,
    ]) {
      expect(canQuantize(t), ggmlTypeName(t)).toBe(true);
    }
    expect(DEQUANTIZABLE_TYPES).toEqual([...DEQUANTIZABLE_TYPES].sort((a, b) => a - b));
    expect(QUANTIZABLE_TYPES.every((t) => canDequantize(t))).toBe(true);
  });

  it("rejects types without a (de)quantiser with MOESWARM_GGUF_UNSUPPORTED_TYPE", () => {
    for (const t of [GgmlType.IQ2_XXS, GgmlType.IQ1_M, GgmlType.I32, GgmlType.Q8_1, 4, 99, -1]) {
      expect(canDequantize(t)).toBe(false);
      expectCode(() => dequantize(t, new Uint8Array(0), 0), GgufError, "MOESWARM_GGUF_UNSUPPORTED_TYPE");
      expectCode(() => quantize(t, new Float32Array(0)), GgufError, "MOESWARM_GGUF_UNSUPPORTED_TYPE");
      expectCode(
        () => dequantizeRows(t, new Uint8Array(0), 256, 0),
        GgufError,
        "MOESWARM_GGUF_UNSUPPORTED_TYPE",
      );
    }
  });
});

describe("dequantize validation", () => {
  const bad = "MOESWARM_INVALID_ARGUMENT";
  it("needs exactly the blocks of nElements", () => {
    expectCode(() => dequantize(GgmlType.Q4_0, new Uint8Array(17), 32), InvalidArgumentError, bad);
    expectCode(() => dequantize(GgmlType.Q4_0, new Uint8Array(19), 32), InvalidArgumentError, bad);
    expectCode(() => dequantize(GgmlType.Q4_0, new Uint8Array(18), 31), InvalidArgumentError, bad);
    expectCode(() => dequantize(GgmlType.Q4_K, new Uint8Array(144), 32), InvalidArgumentError, bad);
    expectCode(() => dequantize(GgmlType.F16, new Uint8Array(3), 2), InvalidArgumentError, bad);
    expect(dequantize(GgmlType.Q4_0, new Uint8Array(0), 0)).toEqual(new Float32Array(0));
  });

  it("rejects bad counts without allocating what they ask for", () => {
    for (const n of [-32, 32.5, Number.NaN, Number.POSITIVE_INFINITY, 2 ** 53 + 32]) {
      expectCode(() => dequantize(GgmlType.Q8_0, new Uint8Array(34), n), InvalidArgumentError, bad);
    }
    // 2^50 values of 34-byte blocks would be petabytes: refused from the byte length alone
    expectCode(() => dequantize(GgmlType.Q8_0, new Uint8Array(34), 2 ** 50), InvalidArgumentError, bad);
    expectCode(
      () => dequantizeRows(GgmlType.Q8_0, new Uint8Array(34), 2 ** 30, 2 ** 22),
      InvalidArgumentError,
      bad,
    );
  });

  it("rejects non-byte input and a wrong out buffer", () => {
    const bytes = quantize(GgmlType.Q8_0, gaussianValues(64));
    expectCode(
      () => dequantize(GgmlType.Q8_0, [...bytes] as unknown as Uint8Array, 64),
      InvalidArgumentError,
      bad,
    );
    expectCode(() => dequantize(GgmlType.Q8_0, bytes, 64, new Float32Array(63)), InvalidArgumentError, bad);
    expectCode(
      () => dequantize(GgmlType.Q8_0, bytes, 64, new Float64Array(64) as unknown as Float32Array),
      InvalidArgumentError,
      bad,
    );
    expectCode(
      () => dequantizeF64(GgmlType.Q8_0, bytes, 64, new Float64Array(65)),
      InvalidArgumentError,
      bad,
    );
  });
});

describe("quantize validation", () => {
  it("checks the row length against the block size and the values", () => {
    const v = gaussianValues(512);
    expectCode(() => quantize(GgmlType.Q4_K, v, 128), InvalidArgumentError, "MOESWARM_INVALID_ARGUMENT");
    expectCode(() => quantize(GgmlType.Q4_0, v, 96), InvalidArgumentError, "MOESWARM_INVALID_ARGUMENT");
    expectCode(() => quantize(GgmlType.Q4_0, v, 0), InvalidArgumentError, "MOESWARM_INVALID_ARGUMENT");
    expectCode(
      () => quantize(GgmlType.Q4_0, v.subarray(0, 48)),
      InvalidArgumentError,
      "MOESWARM_INVALID_ARGUMENT",
    );
    expectCode(
      () => quantize(GgmlType.Q8_0, [1, 2] as unknown as Float32Array),
      InvalidArgumentError,
      "MOESWARM_INVALID_ARGUMENT",
    );
    expect(quantize(GgmlType.Q4_K, new Float32Array(0))).toEqual(new Uint8Array(0));
  });

  it("rejects NaN and infinities for block types, converts them for float types", () => {
    for (const bad of [Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY]) {
      const v = gaussianValues(256);
      v[77] = bad;
      for (const t of [GgmlType.Q8_0, GgmlType.Q4_K, GgmlType.Q6_K, GgmlType.IQ4_NL]) {
        expectCode(() => quantize(t, v), InvalidArgumentError, "MOESWARM_NUMERIC");
      }
      expect(quantize(GgmlType.F16, v).length).toBe(512);
      expect(quantize(GgmlType.BF16, v).length).toBe(512);
    }
  });
});

describe("known answers", () => {
  it("Q8_0: a block whose absmax is 127 gets scale 1 and the values as quants", () => {
    const v = new Float32Array(32);
    v[0] = 127;
    v[1] = -64;
    v[2] = 2.5; // roundf: half away from zero
    v[3] = -2.5;
    v[31] = 1;
    const q = quantize(GgmlType.Q8_0, v);
    expect([...q.subarray(0, 2)]).toEqual([0x00, 0x3c]); // f16 1.0
    const qs = new Int8Array(q.buffer, 2, 32);
    expect([qs[0], qs[1], qs[2], qs[3], qs[4], qs[31]]).toEqual([127, -64, 3, -3, 0, 1]);
    expect([...dequantize(GgmlType.Q8_0, q, 32)]).toEqual(
      [...v].map((x) => Math.sign(x) * Math.round(Math.abs(x))),
    );
  });

  it("Q4_0: scale from the signed absmax, nibbles offset by 8", () => {
    const v = Float32Array.from({ length: 32 }, (_, i) => i - 16); // max |.| is -16 -> d = 2
    const q = quantize(GgmlType.Q4_0, v);
    expect([...q.subarray(0, 2)]).toEqual([0x00, 0x40]); // f16 2.0
    const y = dequantize(GgmlType.Q4_0, q, 32);
    for (let i = 0; i < 32; i++) expect(Math.abs(y[i]! - v[i]!)).toBeLessThanOrEqual(1);
    expect(y[0]).toBe(-16);
  });

  it("F16 and BF16 match @moeswarm/core's ggml-compatible conversions", () => {
    const v = gaussianValues(1000).map((x) => x * 1000);
    const f16 = quantize(GgmlType.F16, v);
    expect(new Uint16Array(f16.buffer)).toEqual(encodeF16(v));
    const bf16 = quantize(GgmlType.BF16, v);
    expect(new Uint16Array(bf16.buffer)).toEqual(encodeBf16(v));
    expect(dequantize(GgmlType.F32, quantize(GgmlType.F32, v), v.length)).toEqual(v);
  });
});

// Relative RMS error of quantise -> dequantise on N(0, 1) data: loose bounds that catch a broken
// packing or scale (which gives errors of order 1), independent of ggml.
const RMS_BOUND: Partial<Record<GgmlType, number>> = {
  [GgmlType.F32]: 0,
  [GgmlType.F16]: 0.001,
  [GgmlType.BF16]: 0.005,
  [GgmlType.Q8_0]: 0.01,
  [GgmlType.Q8_K]: 0.01,
  [GgmlType.Q6_K]: 0.03,
  [GgmlType.Q5_0]: 0.06,
  [GgmlType.Q5_1]: 0.06,
  [GgmlType.Q5_K]: 0.06,
  [GgmlType.Q4_0]: 0.12,
  [GgmlType.Q4_1]: 0.12,
  [GgmlType.Q4_K]: 0.1,
  [GgmlType.IQ4_NL]: 0.1,
  [GgmlType.IQ4_XS]: 0.1,
  [GgmlType.NVFP4]: 0.13,
  [GgmlType.MXFP4]: 0.15,
  [GgmlType.Q3_K]: 0.2,
  [GgmlType.Q2_K]: 0.4,
  [GgmlType.Q2_0]: 0.8,
  [GgmlType.Q1_0]: 0.7,
  [GgmlType.TQ1_0]: 0.9,
  [GgmlType.TQ2_0]: 0.9,
};

describe.each(names(QUANTIZABLE_TYPES))("$name round trip", ({ type }) => {
  const { blockSize, typeSize } = ggmlTypeTraits(type);
  const v = gaussianValues(4096);
  const q = quantize(type, v, 1024);

  it("has the block size, is deterministic and independent of the row split", () => {
    expect(q.length).toBe((v.length / blockSize) * typeSize);
    expect(quantize(type, v, 1024)).toEqual(q);
    expect(quantize(type, v)).toEqual(q);
  });

  it("reconstructs within its error bound", () => {
    const y = dequantize(type, q, v.length);
    let err = 0;
    let sig = 0;
    for (let i = 0; i < v.length; i++) {
      err += (y[i]! - v[i]!) ** 2;
      sig += v[i]! ** 2;
    }
    const bound = RMS_BOUND[type];
    expect(bound, "every quantisable type has a bound").toBeDefined();
    expect(Math.sqrt(err / sig)).toBeLessThanOrEqual(bound!);
  });

  it("dequantises all-zero input to zeros", () => {
    const zeros = new Float32Array(1024);
    expect(dequantize(type, quantize(type, zeros), 1024).every((x) => x === 0)).toBe(true);
  });
});

describe("helpers", () => {
  const v = gaussianValues(6 * 512);
  const q4k = quantize(GgmlType.Q4_K, v, 512);

  it("writes into `out` and returns it", () => {
    const out = new Float32Array(v.length);
    expect(dequantize(GgmlType.Q4_K, q4k, v.length, out)).toBe(out);
    expect(out).toEqual(dequantize(GgmlType.Q4_K, q4k, v.length));
  });

  it("reads blocks at any byte offset", () => {
    for (const t of QUANTIZABLE_TYPES) {
      const bytes = quantize(t, v.subarray(0, 512));
      const shifted = new Uint8Array(bytes.length + 3);
      shifted.set(bytes, 3);
      expect(dequantize(t, shifted.subarray(3), 512), ggmlTypeName(t)).toEqual(dequantize(t, bytes, 512));
    }
  });

  it("dequantizeF64 is dequantize widened", () => {
    for (const t of QUANTIZABLE_TYPES) {
      const bytes = quantize(t, v.subarray(0, 1024));
      expect(dequantizeF64(t, bytes, 1024)).toEqual(Float64Array.from(dequantize(t, bytes, 1024)));
    }
    const out = new Float64Array(v.length);
    expect(dequantizeF64(GgmlType.Q4_K, q4k, v.length, out)).toBe(out);
  });

  it("dequantizeRows decodes rows and checks the row length", () => {
    expect(dequantizeRows(GgmlType.Q4_K, q4k, 512, 6)).toEqual(dequantize(GgmlType.Q4_K, q4k, v.length));
    expectCode(
      () => dequantizeRows(GgmlType.Q4_K, q4k, 128, 24),
      InvalidArgumentError,
      "MOESWARM_INVALID_ARGUMENT",
    );
    expectCode(
      () => dequantizeRows(GgmlType.Q4_K, q4k, 512, 5),
      InvalidArgumentError,
      "MOESWARM_INVALID_ARGUMENT",
    );
  });

  it("dequantizeSlab decodes one expert of a [ne0, ne1, ne2] tensor", () => {
    const shape = [512, 2, 3] as const; // three experts of 2 rows
    const all = dequantize(GgmlType.Q4_K, q4k, v.length);
    for (let e = 0; e < 3; e++) {
      expect(dequantizeSlab(GgmlType.Q4_K, q4k, shape, e)).toEqual(all.subarray(e * 1024, (e + 1) * 1024));
    }
    const bad = "MOESWARM_INVALID_ARGUMENT";
    expectCode(() => dequantizeSlab(GgmlType.Q4_K, q4k, shape, 3), InvalidArgumentError, bad);
    expectCode(() => dequantizeSlab(GgmlType.Q4_K, q4k, shape, -1), InvalidArgumentError, bad);
    expectCode(() => dequantizeSlab(GgmlType.Q4_K, q4k, [512, 2, 4], 0), InvalidArgumentError, bad);
    expectCode(() => dequantizeSlab(GgmlType.Q4_K, q4k, [256 + 32, 2, 3], 0), InvalidArgumentError, bad);
  });
});

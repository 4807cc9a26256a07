// Our quantisers and dequantisers against ggml itself (libggml-base of the pinned release, through
// test/ggml-ref), bit for bit.

import { describe, expect, it } from "vitest";
import {
  DEQUANTIZABLE_TYPES,
  dequantize,
  GGML_TYPES,
  GgmlType,
  ggmlTypeName,
  ggmlTypeTraits,
  QUANTIZABLE_TYPES,
  quantize,
} from "../src/index.js";
import { ggmlRefOrSkipReason } from "./ggml-ref/ggml-ref.js";
import { caseOfRow, quantInputs, rng } from "./quant-inputs.js";

const ref = await ggmlRefOrSkipReason();
const NE0 = 512;
const { cases, values } = quantInputs(NE0, 0x5eed);

function firstByteDiff(a: Uint8Array, b: Uint8Array): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}

function firstBitsDiff(a: Float32Array, b: Float32Array): number {
  const x = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const y = new Uint32Array(b.buffer, b.byteOffset, b.length);
  const n = Math.min(x.length, y.length);
  for (let i = 0; i < n; i++) if (x[i] !== y[i]) return i;
  return x.length === y.length ? -1 : n;
}

function hex(bits: number): string {
  return `0x${(bits >>> 0).toString(16).padStart(8, "0")}`;
}

function describeValueDiff(ours: Float32Array, theirs: Float32Array, at: number, ne0: number): string {
  const o = new Uint32Array(ours.buffer, ours.byteOffset, ours.length)[at]!;
  const t = new Uint32Array(theirs.buffer, theirs.byteOffset, theirs.length)[at]!;
  return `value ${at} (${caseOfRow(cases, Math.floor(at / ne0))}): ours ${ours[at]} ${hex(o)}, ggml ${theirs[at]} ${hex(t)}`;
}

const names = (types: readonly GgmlType[]) => types.map((t) => ({ type: t, name: ggmlTypeName(t) }));

describe.skipIf(typeof ref === "string")("bit-exact against ggml", () => {
  const oracle = typeof ref === "string" ? undefined : ref;

  it("the ggml type table matches ggml's type traits", () => {
    const info = oracle!.info();
    expect(info.length).toBeGreaterThan(30);
    for (const t of info) {
      const ours = ggmlTypeTraits(t.type);
      expect({ name: ours.name, blockSize: ours.blockSize, typeSize: ours.typeSize }).toEqual({
        name: t.name,
        blockSize: t.blockSize,
        typeSize: t.typeSize,
      });
    }
    expect(new Set(info.map((t) => t.type))).toEqual(new Set(GGML_TYPES.map((t) => t.type)));
  });

  it("every type we dequantise has a ggml to_float, and quantises without an imatrix", () => {
    const info = new Map(oracle!.info().map((t) => [t.type, t]));
    for (const t of DEQUANTIZABLE_TYPES) expect(info.get(t)?.hasToFloat || t === GgmlType.F32).toBe(true);
    for (const t of QUANTIZABLE_TYPES) expect(info.get(t)?.requiresImatrix).toBe(false);
  });

  describe.each(names(QUANTIZABLE_TYPES))("quantize $name", ({ type, name }) => {
    it("writes ggml's bytes for every input case", () => {
      const theirs = oracle!.quantize(type, values, NE0);
      const ours = quantize(type, values, NE0);
      const at = firstByteDiff(ours, theirs);
      const rowBytes = ours.length / (values.length / NE0);
      const where =
        at < 0
          ? ""
          : `${name}: first differing byte ${at} in ${caseOfRow(cases, Math.floor(at / rowBytes))}, block byte ${
              at % ggmlTypeTraits(type).typeSize
            }: ours ${ours[at]}, ggml ${theirs[at]}`;
      expect(where).toBe("");
      expect(ours.length).toBe(theirs.length);
    });
  });

  describe.each(names(DEQUANTIZABLE_TYPES))("dequantize $name", ({ type, name }) => {
    it("decodes ggml-quantised blocks to ggml's f32 bits", () => {
      const bytes = oracle!.quantize(type, values, NE0);
      const theirs = oracle!.dequantize(type, bytes, values.length);
      const ours = dequantize(type, bytes, values.length);
      const at = firstBitsDiff(ours, theirs);
      expect(at < 0 ? "" : `${name}: ${describeValueDiff(ours, theirs, at, NE0)}`).toBe("");
    });

    it("decodes random block bytes to ggml's f32 bits", () => {
      const { blockSize, typeSize } = ggmlTypeTraits(type);
      const nBlocks = Math.max(64, Math.ceil(4096 / blockSize));
      const next = rng(0xb10c + type);
      const bytes = Uint8Array.from({ length: nBlocks * typeSize }, () => Math.floor(next() * 256));
      const n = nBlocks * blockSize;
      const theirs = oracle!.dequantize(type, bytes, n);
      const ours = dequantize(type, bytes, n);
      const at = firstBitsDiff(ours, theirs);
      expect(at < 0 ? "" : `${name}: ${describeValueDiff(ours, theirs, at, n)}`).toBe("");
    });
  });

  it.each(names([GgmlType.F16, GgmlType.BF16, GgmlType.F32]))(
    "quantize $name converts special and random-bit f32 values as ggml does",
    ({ type }) => {
      const next = rng(0xf16 + type);
      const specials = [
        0,
        -0,
        1,
        -1,
        Infinity,
        -Infinity,
        Number.NaN,
        65504,
        65519.996,
        65520,
        -65520,
        2 ** -24,
        2 ** -25,
        3 * 2 ** -26,
        2 ** -14,
        2 ** -15 + 2 ** -25,
        3.4028234663852886e38,
        1e-45,
        1.0009765625,
        1.00048828125,
        1.00146484375,
        256.5,
        0.1,
        -0.3,
      ];
      const bits = new Uint32Array(4096 + 64);
      const asF32 = new Float32Array(bits.buffer);
      asF32.set(specials);
      // NaNs with payloads and both signs, then random bit patterns (every class of f32)
      bits.set([0x7f800001, 0xff800001, 0x7fc00001, 0xffc12345, 0x7fbfffff, 0x7f810000], specials.length);
      for (let i = 64; i < bits.length; i++) bits[i] = Math.floor(next() * 2 ** 32);
      const ours = quantize(type, asF32);
      const theirs = oracle!.quantize(type, asF32, asF32.length);
      expect(firstByteDiff(ours, theirs)).toBe(-1);
      // and back: to_float of every f16/bf16 bit pattern
      if (type !== GgmlType.F32) {
        const all = Uint8Array.from({ length: 65536 * 2 }, (_, i) => (i & 1 ? i >>> 9 : (i >>> 1) & 0xff));
        const a = dequantize(type, all, 65536);
        const b = oracle!.dequantize(type, all, 65536);
        expect(firstBitsDiff(a, b)).toBe(-1);
      }
    },
  );
});

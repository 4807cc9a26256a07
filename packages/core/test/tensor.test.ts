import { describe, expect, it } from "vitest";
import {
  bytesOf,
  dtypeSize,
  encodeBf16,
  encodeF16,
  InvalidArgumentError,
  shapeSize,
  tensor,
  tensorByteSize,
  tensorBytes,
  toF32,
  typedArrayFromBytes,
} from "../src/index.js";

describe("TensorView", () => {
  it("wraps typed arrays whose length matches the shape", () => {
    const data = new Float32Array(6);
    const t = tensor("f32", [2, 3], data);
    expect(t.data).toBe(data);
    expect(t.shape).toEqual([2, 3]);
    expect(tensor("i32", [], new Int32Array(1)).shape).toEqual([]);
    expect(tensor("f16", [4, 0], new Uint16Array(0)).data.length).toBe(0);
    expect(tensor("f64", [3]).data).toEqual(new Float64Array(3));
    expect(tensor("bf16", [2, 2]).data).toBeInstanceOf(Uint16Array);
  });

  it("copies and freezes the shape", () => {
    const shape = [2, 2];
    const t = tensor("f32", shape, new Float32Array(4));
    shape[0] = 9;
    expect(t.shape).toEqual([2, 2]);
    expect(Object.isFrozen(t.shape)).toBe(true);
  });

  it("rejects a length mismatch, the wrong array type, bad dims and unknown dtypes", () => {
    expect(() => tensor("f32", [2, 3], new Float32Array(5))).toThrow(InvalidArgumentError);
    expect(() => tensor("f32", [2], new Float64Array(2) as unknown as Float32Array)).toThrow(/Float32Array/);
    expect(() => tensor("f16", [2], new Int16Array(2) as unknown as Uint16Array)).toThrow(
      InvalidArgumentError,
    );
    expect(() => tensor("f32", [-1])).toThrow(InvalidArgumentError);
    expect(() => tensor("f32", [1.5])).toThrow(InvalidArgumentError);
    expect(() => tensor("f32", [2 ** 40, 2 ** 20])).toThrow(InvalidArgumentError);
    expect(() => tensor("f32", [2 ** 31])).toThrow(/too large/);
    expect(() => tensor("q4" as "f32", [1])).toThrow(InvalidArgumentError);
  });

  it("knows element and byte sizes", () => {
    expect([
      dtypeSize("f32"),
      dtypeSize("f16"),
      dtypeSize("bf16"),
      dtypeSize("i32"),
      dtypeSize("f64"),
    ]).toEqual([4, 2, 2, 4, 8]);
    expect(shapeSize([])).toBe(1);
    expect(shapeSize([3, 0, 5])).toBe(0);
    expect(tensorByteSize("bf16", [3, 5])).toBe(30);
    expect(() => dtypeSize("u8" as "f32")).toThrow(InvalidArgumentError);
  });

  it("converts to f32 exactly for half types and with rounding for i32/f64", () => {
    const values = [1, -2, 0.5, 65504, 2 ** -24];
    expect(Array.from(toF32(tensor("f16", [5], encodeF16(values))))).toEqual(values);
    expect(Array.from(toF32(tensor("bf16", [3], encodeBf16([1, -2, 3.5]))))).toEqual([1, -2, 3.5]);
    expect(Array.from(toF32(tensor("i32", [2], Int32Array.of(16777217, -3))))).toEqual([16777216, -3]);
    expect(Array.from(toF32(tensor("f64", [1], Float64Array.of(0.1))))).toEqual([Math.fround(0.1)]);
    const f = new Float32Array([1, 2]);
    expect(toF32(tensor("f32", [2], f))).toBe(f);
    expect(toF32(tensor("f32", [2], f), { copy: true })).not.toBe(f);
  });

  it("views little-endian bytes as typed arrays when aligned and copies otherwise", () => {
    const buf = new Uint8Array(20);
    new DataView(buf.buffer).setFloat32(4, 1.5, true);
    new DataView(buf.buffer).setFloat32(9, -3, true);
    const aligned = typedArrayFromBytes("f32", buf.subarray(4, 8));
    expect(aligned.buffer).toBe(buf.buffer);
    expect(Array.from(aligned)).toEqual([1.5]);
    const unaligned = typedArrayFromBytes("f32", buf.subarray(9, 13));
    expect(unaligned.buffer).not.toBe(buf.buffer);
    expect(Array.from(unaligned)).toEqual([-3]);
    expect(typedArrayFromBytes("f32", buf.subarray(4, 8), { copy: true }).buffer).not.toBe(buf.buffer);
    expect(() => typedArrayFromBytes("i32", buf.subarray(0, 6))).toThrow(InvalidArgumentError);
    const t = tensor("i32", [2], Int32Array.of(1, -1));
    expect(Array.from(tensorBytes(t))).toEqual([1, 0, 0, 0, 255, 255, 255, 255]);
    expect(bytesOf(t.data).buffer).toBe(t.data.buffer);
  });
});

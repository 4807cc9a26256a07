import { encode as msgpackEncode } from "@msgpack/msgpack";
import { describe, expect, it } from "vitest";
import {
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  encodeLengthPrefixed,
  errorFrame,
  type Frame,
  LENGTH_PREFIX_BYTES,
  pingFrame,
  registerFrame,
  resultFrame,
} from "../src/index.js";
import { hex, padded, plainObject, valueHex } from "./codec-helpers.js";

describe("canonical encoding", () => {
  it("writes unsigned integers in the shortest unsigned format", () => {
    const cases: Array<[number, string]> = [
      [0, "00"],
      [127, "7f"],
      [128, "cc80"],
      [255, "ccff"],
      [256, "cd0100"],
      [65535, "cdffff"],
      [65536, "ce00010000"],
      [2 ** 32 - 1, "ceffffffff"],
      [2 ** 32, "cf0000000100000000"],
      [2 ** 53 - 1, "cf001fffffffffffff"],
    ];
    for (const [value, expected] of cases) {
      // `ts` is the last key of a ping, so its encoding ends the frame
      expect(valueHex(pingFrame({ seq: 0, ts: value }), "ts"), String(value)).toBe(expected);
      expect(hex(encodeFrame(pingFrame({ seq: value, ts: 0 }))), String(value)).toContain(
        `a3736571${expected}a27473`,
      );
    }
  });

  it("writes negative integers in the shortest signed format", () => {
    const cases: Array<[number, string]> = [
      [-1, "ff"],
      [-32, "e0"],
      [-33, "d0df"],
      [-128, "d080"],
      [-129, "d1ff7f"],
      [-32768, "d18000"],
      [-32769, "d2ffff7fff"],
      [-(2 ** 31), "d280000000"],
      [-(2 ** 31) - 1, "d3ffffffff7fffffff"],
      [-(2 ** 53 - 1), "d3ffe0000000000001"],
    ];
    for (const [value, expected] of cases) {
      expect(valueHex(pingFrame({ seq: 0, ts: value }), "ts"), String(value)).toBe(expected);
    }
  });

  it("writes every other number as float64, never float32, and -0 as the integer 0", () => {
    expect(valueHex(pingFrame({ seq: 0, ts: 0.5 }), "ts")).toBe("cb3fe0000000000000");
    expect(valueHex(pingFrame({ seq: 0, ts: 2 ** 53 }), "ts")).toBe("cb4340000000000000");
    expect(valueHex(pingFrame({ seq: 0, ts: -(2 ** 60) }), "ts")).toBe("cbc3b0000000000000");
    expect(valueHex(pingFrame({ seq: 0, ts: 1.1 }), "ts")).toBe("cb3ff199999999999a");
    expect(valueHex(pingFrame({ seq: 0, ts: -0 }), "ts")).toBe("00");
  });

  it("writes strings with the shortest header", () => {
    const at = (s: string) => valueHex(errorFrame({ code: "MOESWARM_X", msg: s }), "msg");
    expect(at("")).toBe("a0");
    expect(at("a".repeat(31))).toBe(`bf${"61".repeat(31)}`);
    expect(at("a".repeat(32))).toBe(`d920${"61".repeat(32)}`);
    expect(at("a".repeat(255))).toBe(`d9ff${"61".repeat(255)}`);
    expect(at("a".repeat(256))).toBe(`da0100${"61".repeat(256)}`);
    // lengths are UTF-8 bytes: 11 x "é" (2 bytes) = 22 bytes
    expect(at("é".repeat(11)).slice(0, 2)).toBe("b6");
    // a leading BOM is kept, not stripped
    const bom = errorFrame({ code: "MOESWARM_X", msg: "\uFEFFx" });
    expect((decodeFrame(encodeFrame(bom)) as typeof bom).msg).toBe("\uFEFFx");
  });

  it("writes tensors as bin 8/16/32 by size", () => {
    const d = (embd: number) =>
      encodeFrame(
        dispatchFrame({
          id: 0,
          model: "m",
          layer: 0,
          n: 1,
          embd,
          dtype: "f16",
          x: new Uint16Array(embd),
          k: 1,
          ids: new Int32Array(1),
          mode: "each",
        }),
      );
    expect(hex(d(127))).toContain(`a178c4fe${"00".repeat(254)}a16b`);
    expect(hex(d(128))).toContain(`a178c50100${"00".repeat(256)}a16b`);
    expect(hex(d(32768))).toContain(`a178c600010000${"0000".repeat(100)}`);
  });

  it("writes maps and arrays with the shortest header, keys in canonical order", () => {
    const r = registerFrame({
      model: "m",
      layers: Array.from({ length: 15 }, (_, i) => i),
      experts: Array.from({ length: 16 }, (_, i) => i),
    });
    const h = hex(encodeFrame(r));
    expect(h.startsWith("85a174a8")).toBe(true);
    expect(h).toContain(`a66c6179657273 9f${"000102030405060708090a0b0c0d0e"}`.replace(" ", ""));
    expect(h).toContain(`a7657870657274 73dc0010`.replace(" ", ""));
    // keys are written in the table's order whatever the object's order
    const shuffled = { experts: [1], layers: [2], model: "m", t: "register", v: 1 } as unknown as Frame;
    expect(hex(encodeFrame(shuffled))).toBe(
      hex(encodeFrame(registerFrame({ model: "m", layers: [2], experts: [1] }))),
    );
  });

  it("matches @msgpack/msgpack's encoding of the same object", () => {
    const frame = dispatchFrame({
      id: 2 ** 32 - 1,
      to: "w",
      from: "b",
      model: "qwen3",
      layer: 300,
      n: 3,
      embd: 5,
      dtype: "f32",
      x: new Float32Array(15).map((_, i) => i / 7),
      k: 4,
      ids: new Int32Array([0, 1, 2, 3, 4, 5, 6, 7, -1, -1, 100000, 7]),
      w: new Float32Array(12).fill(0.25),
      mode: "sum",
      deadline: 70000,
    });
    expect(hex(encodeFrame(frame))).toBe(hex(msgpackEncode(padded(plainObject(frame)))));
  });

  it("returns bytes no later encode overwrites", () => {
    const big = dispatchFrame({
      id: 1,
      model: "m",
      layer: 0,
      n: 8,
      embd: 1024,
      dtype: "f32",
      x: new Float32Array(8 * 1024).fill(3),
      k: 1,
      ids: new Int32Array(8),
      mode: "each",
    });
    const a = encodeFrame(big);
    const b = encodeFrame(pingFrame({ seq: 1, ts: 2 }));
    const aCopy = a.slice();
    const bCopy = b.slice();
    for (let i = 0; i < 200; i++) {
      encodeFrame(pingFrame({ seq: i, ts: i }));
      encodeFrame(big);
    }
    expect(hex(a)).toBe(hex(aCopy));
    expect(hex(b)).toBe(hex(bCopy));
  });

  it("assembles frames with large tensors byte for byte as @msgpack/msgpack encodes them", () => {
    // 16 keys (a map 16 header), bin 32 / bin 16 / bin 8 tensors, ids after a tensor
    const n = 100;
    const dispatch = dispatchFrame({
      id: 2 ** 32 - 1,
      to: "worker-1",
      from: "backbone",
      model: "qwen3-30b-a3b",
      layer: 47,
      n,
      embd: 700,
      dtype: "bf16",
      x: new Uint16Array(n * 700).map((_, i) => (i * 2654435761) >>> 16),
      k: 1,
      ids: new Int32Array(n).map((_, i) => (i % 9) - 1),
      w: new Float32Array(n).fill(1),
      mode: "sum",
      deadline: 2 ** 32 - 1,
    });
    // a float field holding an integer above 2^32 (uint 64), a result above the slab's range
    const result = resultFrame({
      id: 7,
      mode: "each",
      n: 4,
      k: 8,
      embd: 2048,
      y: new Float32Array(4 * 8 * 2048).map((_, i) => Math.sin(i)),
      ms: 2 ** 40,
    });
    const small = dispatchFrame({
      ...dispatch,
      dtype: "bf16",
      n: 1,
      x: new Uint16Array(700).fill(0x3f80),
      ids: new Int32Array(1),
      w: new Float32Array(1),
    });
    for (const frame of [dispatch, result, small]) {
      const payload = encodeFrame(frame);
      expect(payload.constructor).toBe(Uint8Array);
      expect(hex(payload)).toBe(hex(msgpackEncode(padded(plainObject(frame)))));
      // the memory around the view holds nothing but zeros (no stale bytes behind `.buffer`)
      if (payload.buffer.byteLength - payload.byteLength < 16) {
        const whole = new Uint8Array(payload.buffer);
        expect(whole.subarray(0, payload.byteOffset).every((b) => b === 0)).toBe(true);
      }
      // the main tensor is 8-byte aligned, framed or not, and decodes as a view
      for (const framed of [payload, encodeLengthPrefixed(frame).subarray(LENGTH_PREFIX_BYTES)]) {
        const decoded = decodeFrame(framed) as unknown as Record<string, ArrayBufferView>;
        const main = frame.t === "dispatch" ? decoded.x! : decoded.y!;
        expect(main.buffer === framed.buffer).toBe(true);
        expect(main.byteOffset % 8).toBe(0);
      }
    }
  });

  it("sends only the frame type's fields", () => {
    const f = { ...pingFrame({ seq: 1, ts: 2 }), extra: "x" } as Frame;
    expect(hex(encodeFrame(f))).toBe(hex(encodeFrame(pingFrame({ seq: 1, ts: 2 }))));
  });
});

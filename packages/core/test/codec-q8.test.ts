// The q8_0 / q8_K activation dtypes of a dispatch: x is n rows of ggml blocks, kept as bytes, with
// its length checked against n, embd and the block size, on both sides of the codec.
import { describe, expect, it } from "vitest";
import {
  type DispatchFrame,
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  quantizedActivationBytes,
} from "../src/index.js";

function frame(dtype: "q8_0" | "q8_K", n: number, embd: number, bytes: number): DispatchFrame {
  const x = new Uint8Array(bytes).map((_, i) => (i * 37) & 0xff);
  return {
    t: "dispatch",
    v: 1,
    id: 7,
    model: "m",
    layer: 3,
    n,
    embd,
    dtype,
    x,
    k: 2,
    ids: new Int32Array(n * 2).fill(1),
    mode: "each",
  };
}

const codeOf = (f: () => unknown): string | undefined => {
  try {
    f();
    return undefined;
  } catch (error) {
    return (error as { code?: string }).code;
  }
};

describe("q8 activations in dispatch frames", () => {
  it("block sizes: q8_0 34 bytes per 32 values, q8_K 292 per 256; 0 when embd is not whole blocks", () => {
    expect(quantizedActivationBytes("q8_0", 3, 64)).toBe(3 * 2 * 34);
    expect(quantizedActivationBytes("q8_K", 2, 512)).toBe(2 * 2 * 292);
    expect(quantizedActivationBytes("q8_0", 1, 48)).toBe(0);
    expect(quantizedActivationBytes("q8_K", 1, 128)).toBe(0);
  });

  for (const [dtype, embd] of [
    ["q8_0", 64],
    ["q8_K", 512],
  ] as const) {
    it(`${dtype}: encodes and decodes to the same bytes, x stays a Uint8Array`, () => {
      const f = frame(dtype, 3, embd, quantizedActivationBytes(dtype, 3, embd));
      expect(dispatchFrame(f).dtype).toBe(dtype);
      const back = decodeFrame(encodeFrame(f)) as DispatchFrame;
      expect(back.dtype).toBe(dtype);
      expect(back.x).toBeInstanceOf(Uint8Array);
      expect(Buffer.from(back.x as Uint8Array).equals(Buffer.from(f.x as Uint8Array))).toBe(true);
    });

    it(`${dtype}: a wrong length or a Float32Array x is refused`, () => {
      const bytes = quantizedActivationBytes(dtype, 3, embd);
      expect(codeOf(() => encodeFrame(frame(dtype, 3, embd, bytes - 1)))).toBe("MOESWARM_INVALID_ARGUMENT");
      expect(
        codeOf(() => encodeFrame({ ...frame(dtype, 1, embd, 0), x: new Float32Array(embd) } as never)),
      ).toBe("MOESWARM_INVALID_ARGUMENT");
    });
  }

  it("decoding with copy: true copies x out of a Buffer (whose slice() is a view)", () => {
    const sent = frame("q8_0", 1, 32, 34);
    const input = Buffer.from(encodeFrame(sent));
    const copied = decodeFrame(input, { copy: true }) as DispatchFrame;
    input.fill(0);
    expect(Array.from(copied.x as Uint8Array)).toEqual(Array.from(sent.x as Uint8Array));
    expect(copied.x.buffer === input.buffer).toBe(false);
  });

  it("embd that is not whole blocks is refused", () => {
    expect(codeOf(() => encodeFrame(frame("q8_K", 1, 128, 146)))).toBe("MOESWARM_INVALID_ARGUMENT");
  });

  it("decoding: bf16 bytes relabelled q8_0 (same key length) fail BAD_LENGTH", () => {
    const bf16 = encodeFrame({ ...frame("q8_0", 1, 64, 0), dtype: "bf16", x: new Uint16Array(64) });
    const bytes = Buffer.from(bf16);
    const at = bytes.indexOf(Buffer.from("bf16"));
    expect(at).toBeGreaterThan(0);
    bytes.write("q8_0", at, "latin1");
    expect(codeOf(() => decodeFrame(bytes))).toBe("MOESWARM_PROTOCOL_BAD_LENGTH");
    // and the same bytes with x cut to 2*34 decode as q8_0
    const ok = encodeFrame(frame("q8_0", 1, 64, 68));
    expect((decodeFrame(ok) as DispatchFrame).dtype).toBe("q8_0");
  });
});

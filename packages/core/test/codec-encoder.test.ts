import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  type Frame,
  FrameEncoder,
  ProtocolError,
  pingFrame,
} from "../src/index.js";
import { validFrame } from "./arbitraries.js";
import { hex, msgpackHex } from "./codec-helpers.js";

/** A dispatch whose activations are all `fill`, `n` tokens of `embd` values. */
function dispatch(n: number, embd: number, fill: number, model = "m") {
  const k = 2;
  return dispatchFrame({
    id: n * 1000 + fill,
    model,
    layer: 3,
    n,
    embd,
    dtype: "f32",
    x: new Float32Array(n * embd).fill(fill),
    k,
    ids: new Int32Array(n * k).fill(1),
    w: new Float32Array(n * k).fill(0.5),
    mode: "sum",
  });
}

const lent = (encoder: FrameEncoder, frame: Frame) => encoder.encode(frame, (bytes) => Buffer.from(bytes));

describe("FrameEncoder", () => {
  it("lends exactly encodeFrame's bytes, frame after frame, whatever came before", () => {
    const encoder = new FrameEncoder();
    // large then small, tensors then none, over and over in one encoder: the memory is reused and
    // each frame must still be exactly its own encoding (no byte of an earlier, larger frame)
    const frames: Frame[] = [
      dispatch(64, 512, 7), // 128 KiB of 7.0: more than OWN_MEMORY_BYTES
      dispatch(1, 4, 1),
      pingFrame({ seq: 1, ts: 2 }),
      dispatch(8, 64, 9, "a-much-longer-model-name"),
      pingFrame({ seq: 300, ts: 0.5 }),
      dispatch(2, 3, -1),
    ];
    for (const frame of [...frames, ...frames]) {
      expect(hex(lent(encoder, frame))).toBe(hex(encodeFrame(frame)));
    }
  });

  it("lends what @msgpack/msgpack encodes, for random frames through one reused encoder", () => {
    const encoder = new FrameEncoder();
    fc.assert(
      fc.property(validFrame, (frame) => {
        const expected = msgpackHex(frame);
        expect(hex(lent(encoder, frame))).toBe(expected);
      }),
      { numRuns: 400 },
    );
  });

  it("reuses its memory once the bytes are given back", () => {
    const encoder = new FrameEncoder();
    const first = encoder.encode(dispatch(4, 64, 1), (bytes) => bytes.buffer);
    const second = encoder.encode(dispatch(4, 64, 2), (bytes) => bytes.buffer);
    // the point of the encoder (what makes it fast): the second frame went into the first's memory
    expect(second).toBe(first);
  });

  it("never overwrites bytes still lent: an encode inside `use` gets memory of its own", () => {
    const encoder = new FrameEncoder();
    const outer = dispatch(16, 64, 5);
    const inner = dispatch(16, 64, 6);
    const seen = encoder.encode(outer, (outerBytes) => {
      const before = Buffer.from(outerBytes);
      const innerHex = encoder.encode(inner, (innerBytes) => {
        expect(innerBytes.buffer).not.toBe(outerBytes.buffer);
        return hex(innerBytes);
      });
      expect(innerHex).toBe(hex(encodeFrame(inner)));
      // the outer frame's bytes are untouched by the nested encode
      expect(Buffer.from(outerBytes).equals(before)).toBe(true);
      return decodeFrame(outerBytes);
    });
    expect(seen).toEqual(outer);
    // and once both are back, the encoder's own memory serves again
    const buffers = new Set<ArrayBufferLike>();
    for (let i = 0; i < 3; i++) encoder.encode(inner, (bytes) => buffers.add(bytes.buffer));
    expect(buffers.size).toBe(1);
  });

  it("takes the bytes back when `use` throws", () => {
    const encoder = new FrameEncoder();
    const a = encoder.encode(dispatch(2, 8, 1), (bytes) => bytes.buffer);
    expect(() =>
      encoder.encode(dispatch(2, 8, 2), () => {
        throw new Error("send failed");
      }),
    ).toThrow("send failed");
    // not left marked as lent: the next frame is encoded into the same memory again
    expect(encoder.encode(dispatch(2, 8, 3), (bytes) => bytes.buffer)).toBe(a);
  });

  it("validates and enforces maxFrameBytes before lending anything", () => {
    const encoder = new FrameEncoder({ maxFrameBytes: 1024 });
    let called = false;
    const use = () => {
      called = true;
    };
    expect(() => encoder.encode(dispatch(4, 64, 1), use)).toThrow(ProtocolError);
    expect(() => encoder.encode({ t: "ping", v: 1, seq: -1, ts: 0 } as Frame, use)).toThrow();
    expect(called).toBe(false);
    // a frame within the limit after a refused one is still exact
    const frame = dispatch(1, 8, 4);
    expect(hex(lent(encoder, frame))).toBe(hex(encodeFrame(frame)));
    expect(() => new FrameEncoder({ maxFrameBytes: -1 })).toThrow();
  });

  it("aligns the main tensor as encodeFrame does, so decoding it is a view", () => {
    const encoder = new FrameEncoder();
    encoder.encode(dispatch(1, 3, 1), () => undefined);
    encoder.encode(dispatch(8, 64, 2), (bytes) => {
      const decoded = decodeFrame(bytes) as ReturnType<typeof dispatch>;
      expect(decoded.x.buffer).toBe(bytes.buffer);
      expect(decoded.x[0]).toBe(2);
    });
  });
});

// rerouteFrame: a relay's forwarding without re-encoding. On every valid dispatch and result the
// rerouted bytes are exactly encodeFrame's for the frame with the new routing fields (so peers see
// no difference), the payload bytes are copied untouched, and decodeFrame's `raw` mode leaves
// x and y as the frame's bytes.
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { decodeFrame, encodeFrame, type Frame, FrameRerouter, rerouteFrame } from "../src/index.js";
import { validFrame } from "./arbitraries.js";

const MAX = 64 * 1024 * 1024;
const peerId = fc.string({ minLength: 1, maxLength: 40 });

describe("rerouteFrame", () => {
  it("gives encodeFrame's bytes for the frame with the new id, to and from", () => {
    fc.assert(
      fc.property(
        validFrame.filter((f) => f.t === "dispatch" || f.t === "result" || f.t === "error"),
        fc.integer({ min: 0, max: 0xffff_ffff }),
        fc.option(peerId, { nil: undefined }),
        fc.option(peerId, { nil: undefined }),
        (frame, id, to, from) => {
          const bytes = encodeFrame(frame);
          const want = encodeFrame({ ...frame, id, to, from } as Frame);
          const got = rerouteFrame(bytes, { id, to, from }, MAX);
          expect(Buffer.from(got).equals(Buffer.from(want))).toBe(true);
        },
      ),
      { numRuns: 300 },
    );
  });

  it("copies a 64-token activation payload untouched and refuses to grow past the limit", () => {
    const n = 64;
    const embd = 3072;
    const x = new Float32Array(n * embd).map((_, i) => Math.sin(i) * 1e3);
    const frame: Frame = {
      t: "dispatch",
      v: 1,
      id: 5,
      to: "w",
      from: "spoofed",
      model: "m",
      layer: 3,
      n,
      embd,
      dtype: "f32",
      x,
      k: 1,
      ids: new Int32Array(n).fill(2),
      mode: "each",
    };
    const bytes = encodeFrame(frame);
    const raw = decodeFrame(bytes, { raw: true }) as unknown as { x: Uint8Array };
    expect(raw.x).toBeInstanceOf(Uint8Array);
    expect(raw.x.buffer).toBe(bytes.buffer); // a view: never decoded nor copied
    const out = rerouteFrame(bytes, { id: 9, to: "w", from: "bb" }, MAX);
    const back = decodeFrame(out);
    expect(back).toMatchObject({ id: 9, to: "w", from: "bb", layer: 3, n, embd });
    expect(
      Buffer.from(
        (back as { x: Float32Array }).x.buffer,
        (back as { x: Float32Array }).x.byteOffset,
        x.byteLength,
      ).equals(Buffer.from(x.buffer)),
    ).toBe(true);
    expect(() =>
      rerouteFrame(bytes, { id: 9, to: "w", from: "b".repeat(100) }, bytes.byteLength + 10),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_PROTOCOL_FRAME_TOO_LARGE" }));
  });
});

describe("FrameRerouter", () => {
  it("gives rerouteFrame's bytes frame after frame in reused memory, larger and smaller", () => {
    const rerouter = new FrameRerouter();
    const buffers = new Set<ArrayBufferLike>();
    fc.assert(
      fc.property(
        validFrame.filter((f) => f.t === "dispatch" || f.t === "result"),
        fc.integer({ min: 0, max: 0xffff_ffff }),
        fc.option(peerId, { nil: undefined }),
        (frame, id, to) => {
          const bytes = encodeFrame(frame);
          const want = rerouteFrame(bytes, { id, to, from: "bb" }, MAX);
          const got = rerouter.reroute(bytes, { id, to, from: "bb" }, MAX);
          try {
            expect(Buffer.from(got).equals(Buffer.from(want))).toBe(true);
            buffers.add(got.buffer);
          } finally {
            rerouter.release(false);
          }
        },
      ),
      { numRuns: 200 },
    );
    // the memory grew a few times, never once per frame
    expect(buffers.size).toBeLessThan(20);
  });

  it("never overwrites bytes that are lent (nested) or kept (released with kept = true)", () => {
    const frame = (id: number, fill: number): Uint8Array =>
      encodeFrame({
        t: "result",
        v: 1,
        id,
        mode: "sum",
        n: 1,
        k: 1,
        embd: 256,
        y: new Float32Array(256).fill(fill),
      });
    const rerouter = new FrameRerouter();
    const outer = rerouter.reroute(frame(1, 1), { id: 10 }, MAX);
    const copyOuter = Buffer.from(outer);
    // a reroute while `outer` is lent gets memory of its own
    const inner = rerouter.reroute(frame(2, 2), { id: 20 }, MAX);
    expect(inner.buffer).not.toBe(outer.buffer);
    rerouter.release(false);
    expect(Buffer.from(outer).equals(copyOuter)).toBe(true);
    // kept by a socket: the next frame goes elsewhere and `outer` stays intact
    rerouter.release(true);
    const next = rerouter.reroute(frame(3, 3), { id: 30 }, MAX);
    expect(next.buffer).not.toBe(outer.buffer);
    expect(Buffer.from(outer).equals(copyOuter)).toBe(true);
    rerouter.release(false);
    // not kept: the memory is reused
    const again = rerouter.reroute(frame(4, 4), { id: 40 }, MAX);
    expect(again.buffer).toBe(next.buffer);
    expect(decodeFrame(again)).toMatchObject({ id: 40 });
    rerouter.release(false);
    // a frame it cannot reroute throws before anything is lent
    expect(() => rerouter.reroute(frame(5, 5), { id: -1 }, MAX)).toThrow();
    const after = rerouter.reroute(frame(6, 6), { id: 60 }, MAX);
    expect(after.buffer).toBe(next.buffer);
    rerouter.release(false);
  });
});

// rerouteFrame: a relay's forwarding without re-encoding. On every valid dispatch and result the
// rerouted bytes are exactly encodeFrame's for the frame with the new routing fields (so peers see
// no difference), the payload bytes are copied untouched, and decodeFrame's `raw` mode leaves
// x and y as the frame's bytes.
import fc from "fast-check";
import { pack, unpack } from "msgpackr";
import { describe, expect, it } from "vitest";
import {
  decodeFrame,
  encodeFrame,
  type Frame,
  FrameEncoder,
  FrameRerouter,
  relayHeadroom,
  rerouteFrame,
} from "../src/index.js";
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

describe("rerouteFrame: which keys are routing", () => {
  it("keeps keys that only look like routing, padding or tensor keys, in their order and bytes", () => {
    // one letter or byte away from t, v, id, to, from, _, x, y: none of them is rewritten or dropped
    const lookalikes = { tt: 1, i: 2, idx: 3, tO: 4, fro: 5, froM: 6, fromm: 7, __: 8, xx: 9, Y: 10, u: 11 };
    const x = Buffer.from(new Float32Array(8).fill(0.25).buffer);
    const bytes = pack({
      t: "dispatch",
      v: 1,
      id: 1,
      ...lookalikes,
      to: "w",
      from: "spoofed",
      model: "m",
      layer: 0,
      n: 1,
      embd: 8,
      dtype: "f32",
      k: 1,
      ids: Buffer.from(new Int32Array([0]).buffer),
      x,
      mode: "each",
    });
    const out = unpack(rerouteFrame(bytes, { id: 9, to: "w", from: "b" }, MAX)) as Record<string, unknown>;
    expect(out).toMatchObject({ t: "dispatch", v: 1, id: 9, to: "w", from: "b", ...lookalikes });
    const keys = Object.keys(out);
    expect(keys.slice(0, 5)).toEqual(["t", "v", "id", "to", "from"]);
    expect(keys.slice(5, 5 + Object.keys(lookalikes).length)).toEqual(Object.keys(lookalikes));
    // the one padding entry, right before x
    expect(keys.filter((k) => k === "_")).toHaveLength(1);
    expect(keys[keys.indexOf("x") - 1]).toBe("_");
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

describe("FrameRerouter.rerouteReceived (in place)", () => {
  const mainKey = (f: Frame) => (f.t === "dispatch" ? "x" : "y");
  /** Offset in `bytes` of the main tensor's data, read back through a decode. */
  const mainAt = (bytes: Uint8Array, f: Frame): number => {
    const t = (decodeFrame(bytes, { raw: true }) as unknown as Record<string, Uint8Array>)[mainKey(f)]!;
    return t.byteOffset - bytes.byteOffset;
  };

  it("a frame sent with relayHeadroom is rerouted in its own memory: rerouteFrame's frame, the payload never moved", () => {
    const rerouter = new FrameRerouter();
    fc.assert(
      fc.property(
        validFrame.filter((f) => f.t === "dispatch" || f.t === "result"),
        fc.integer({ min: 0, max: 0xffff_ffff }),
        peerId,
        (frame, id, from) => {
          const sent = encodeFrame(frame, { headroom: relayHeadroom(from) });
          const patch = { id, to: frame.to, from };
          const want = decodeFrame(rerouteFrame(sent, patch, MAX));
          const received = Uint8Array.from(sent);
          const tensorAt = mainAt(received, frame);
          const got = rerouter.rerouteReceived(received, patch, MAX);
          try {
            expect(got.buffer).toBe(received.buffer);
            // the main tensor's data stays where it arrived, aligned in the new frame
            expect(got.byteOffset + mainAt(got, frame)).toBe(received.byteOffset + tensorAt);
            expect(mainAt(got, frame) % 8).toBe(0);
            expect(decodeFrame(got)).toEqual(want);
          } finally {
            rerouter.release(false);
          }
        },
      ),
      { numRuns: 300 },
    );
  });

  it("in place writes only the bytes it forwards before the main tensor: any headroom, any patch", () => {
    const rerouter = new FrameRerouter();
    fc.assert(
      fc.property(
        validFrame.filter((f) => f.t === "dispatch" || f.t === "result"),
        fc.integer({ min: 0, max: 31 }).map((k) => k * 8),
        fc.integer({ min: 0, max: 0xffff_ffff }),
        fc.option(peerId, { nil: undefined }),
        fc.option(peerId, { nil: undefined }),
        (frame, headroom, id, to, from) => {
          const received = Uint8Array.from(encodeFrame(frame, { headroom }));
          const before = Uint8Array.from(received);
          const patch = { id, to, from };
          const want = decodeFrame(rerouteFrame(before, patch, MAX));
          const tensorAt = mainAt(received, frame);
          const got = rerouter.rerouteReceived(received, patch, MAX);
          try {
            expect(decodeFrame(got)).toEqual(want);
            if (got.buffer !== received.buffer) {
              expect(Buffer.from(received).equals(Buffer.from(before))).toBe(true); // copied: untouched
              return;
            }
            const at = got.byteOffset - received.byteOffset;
            // the bytes before the forwarded frame, and the main tensor's data and all after it, are as they came
            expect(Buffer.from(received.subarray(0, at)).equals(Buffer.from(before.subarray(0, at)))).toBe(
              true,
            );
            expect(
              Buffer.from(received.subarray(tensorAt)).equals(Buffer.from(before.subarray(tensorAt))),
            ).toBe(true);
          } finally {
            rerouter.release(false);
          }
        },
      ),
      { numRuns: 300 },
    );
  });

  it("a frame without room, or with a bin before its main tensor, is copied as reroute does and left as it came", () => {
    const rerouter = new FrameRerouter();
    const y = new Float32Array(64).map((_, i) => i);
    const result: Frame = { t: "result", v: 1, id: 7, to: "b", mode: "sum", n: 1, k: 1, embd: 64, y };
    const tight = encodeFrame(result); // no headroom: `from` does not fit
    const before = Buffer.from(tight);
    const got = rerouter.rerouteReceived(tight, { id: 9, to: "b", from: "worker-with-a-long-id" }, MAX);
    expect(got.buffer).not.toBe(tight.buffer);
    expect(
      Buffer.from(got).equals(
        Buffer.from(rerouteFrame(before, { id: 9, to: "b", from: "worker-with-a-long-id" }, MAX)),
      ),
    ).toBe(true);
    expect(Buffer.from(tight).equals(before)).toBe(true);
    rerouter.release(false);

    // ids (a bin) before x: a decoded frame's ids may be a view of those bytes, so they stay put
    const ids = Buffer.from(new Int32Array([3, 1]).buffer);
    const x = Buffer.from(new Float32Array(8).fill(0.5).buffer);
    const odd = pack({
      t: "dispatch",
      v: 1,
      id: 1,
      to: "w",
      _: Buffer.alloc(200),
      model: "m",
      layer: 0,
      n: 1,
      embd: 8,
      dtype: "f32",
      k: 2,
      ids,
      x,
      mode: "each",
    });
    const oddBefore = Buffer.from(odd);
    const decoded = decodeFrame(odd, { raw: true }) as unknown as { ids: Int32Array };
    const moved = rerouter.rerouteReceived(odd, { id: 2, to: "w", from: "b" }, MAX);
    expect(moved.buffer).not.toBe(odd.buffer);
    expect(Buffer.from(odd).equals(oddBefore)).toBe(true);
    expect([...decoded.ids]).toEqual([3, 1]);
    expect(decodeFrame(moved)).toMatchObject({ id: 2, from: "b", ids: new Int32Array([3, 1]) });
    rerouter.release(false);
  });

  it("an in-place reroute lends no memory: a reroute under it still gets the reused memory", () => {
    const rerouter = new FrameRerouter();
    const frame = (id: number): Uint8Array =>
      new FrameEncoder({ headroom: relayHeadroom("bb") }).encode(
        { t: "result", v: 1, id, mode: "sum", n: 1, k: 1, embd: 32, y: new Float32Array(32).fill(id) },
        (bytes) => Uint8Array.from(bytes),
      );
    const first = rerouter.reroute(frame(1), { id: 1 }, MAX);
    rerouter.release(false);
    const received = frame(2);
    const inPlace = rerouter.rerouteReceived(received, { id: 2, from: "bb" }, MAX);
    expect(inPlace.buffer).toBe(received.buffer);
    const under = rerouter.reroute(frame(3), { id: 3 }, MAX);
    expect(under.buffer).toBe(first.buffer);
    rerouter.release(true); // kept: the reused memory is given up
    rerouter.release(true); // the in-place one: nothing to give up
    const next = rerouter.reroute(frame(4), { id: 4 }, MAX);
    expect(next.buffer).not.toBe(first.buffer);
    rerouter.release(false);
  });

  it("headroom: relayHeadroom fits any peer id; encoders refuse what is not a multiple of 8 up to 248", () => {
    expect(relayHeadroom("b")).toBe(16);
    expect(relayHeadroom("x".repeat(128))).toBe(144);
    // the tightest case: 15 entries (the relay's `from` makes 16, a map16 header), the id 1 -> 5
    // bytes, every id length
    const rerouter = new FrameRerouter();
    for (let length = 1; length <= 128; length++) {
      const from = "b".repeat(length);
      const tight: Frame = {
        t: "dispatch",
        v: 1,
        id: 1,
        to: "worker7",
        model: "m",
        layer: 0,
        n: 1,
        embd: 8,
        dtype: "f32",
        x: new Float32Array(8).fill(1),
        k: 1,
        ids: new Int32Array([0]),
        mode: "each",
        deadline: 100,
      };
      const received = encodeFrame(tight, { headroom: relayHeadroom(from) });
      const got = rerouter.rerouteReceived(received, { id: 0xffff_fff0, to: "worker7", from }, MAX);
      expect(got.buffer, `a ${length}-byte id`).toBe(received.buffer);
      expect(decodeFrame(got)).toEqual({ ...tight, id: 0xffff_fff0, from });
      rerouter.release(false);
    }
    for (const headroom of [1, 250, 256, -8, 0.5])
      expect(() => new FrameEncoder({ headroom })).toThrow(
        expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
      );
    const y = new Float32Array(16).fill(2);
    const frame: Frame = { t: "result", v: 1, id: 1, mode: "sum", n: 1, k: 1, embd: 16, y };
    const padded = encodeFrame(frame, { headroom: 248 });
    expect(padded.byteLength).toBe(encodeFrame(frame).byteLength + 248);
    expect(decodeFrame(padded)).toEqual(decodeFrame(encodeFrame(frame)));
  });
});

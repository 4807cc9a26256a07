// The padding entry `_` (docs/protocol.md section 8, rule 9): every dispatch and result that an
// encoder writes or the relay reroutes has its main tensor (`x`, `y`) at a multiple of 8 from the
// payload's first byte, so that a receiver holding the payload aligned decodes it as a view; frames
// without the entry (older encoders) and with odd ones still decode to the same values.
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { encodeFrameWithPrefixSpace } from "../src/codec-encode.js";
import {
  decodeFrame,
  encodeFrame,
  type Frame,
  FrameEncoder,
  FrameRerouter,
  rerouteFrame,
} from "../src/index.js";
import { Kind, MsgpackReader } from "../src/msgpack-read.js";
import { validFrame } from "./arbitraries.js";
import { fromHex } from "./codec-helpers.js";

const MAX = 64 * 1024 * 1024;
const peerId = fc.string({ minLength: 1, maxLength: 140 }).filter((s) => Buffer.byteLength(s) <= 128);
const tensorFrame = validFrame.filter((f) => f.t === "dispatch" || f.t === "result");

interface Entry {
  key: string;
  /** Offsets of the entry's key header, its value's header and the end of its value. */
  start: number;
  valueAt: number;
  end: number;
  /** For a bin: where its data starts, and its length. */
  dataAt: number;
  length: number;
}

/** The top-level entries of a payload, read with the strict reader (not the writer). */
function entries(bytes: Uint8Array): Entry[] {
  const r = new MsgpackReader(bytes);
  expect(r.head()).toBe(Kind.map);
  const count = r.num;
  const out: Entry[] = [];
  for (let i = 0; i < count; i++) {
    const start = r.pos;
    expect(r.head()).toBe(Kind.str);
    const key = Buffer.from(bytes.subarray(r.pos, r.pos + r.num)).toString("utf8");
    r.pos += r.num;
    const valueAt = r.pos;
    const kind = r.head();
    const dataAt = kind === Kind.bin ? r.pos : -1;
    const length = kind === Kind.bin ? r.num : 0;
    r.pos = valueAt;
    const end = r.skip();
    out.push({ key, start, valueAt, end, dataAt, length });
  }
  expect(r.pos).toBe(bytes.byteLength);
  return out;
}

/** Checks the canonical padding of a dispatch or result payload: one `_`, 0..7 zeros, right before the tensor. */
function expectPadded(payload: Uint8Array, t: string): void {
  const list = entries(payload);
  const main = t === "dispatch" ? "x" : "y";
  const pads = list.filter((e) => e.key === "_");
  expect(pads).toHaveLength(1);
  const at = list.indexOf(pads[0]!);
  expect(list[at + 1]!.key).toBe(main);
  expect(pads[0]!.dataAt).toBeGreaterThan(0);
  expect(pads[0]!.length).toBeLessThanOrEqual(7);
  expect([...payload.subarray(pads[0]!.dataAt, pads[0]!.end)].every((b) => b === 0)).toBe(true);
  expect(list[at + 1]!.dataAt % 8).toBe(0);
}

/** The payload without its `_` entries, the map header's count lowered: what an older encoder wrote. */
function unpadded(payload: Uint8Array): Uint8Array {
  const list = entries(payload);
  const kept = list.filter((e) => e.key !== "_");
  const count = kept.length;
  const head = count < 16 ? [0x80 | count] : [0xde, count >> 8, count & 0xff];
  return Uint8Array.from([...head, ...kept.flatMap((e) => [...payload.subarray(e.start, e.end)])]);
}

/** The payload copied to `offset` bytes past an 8-aligned address. */
function placed(payload: Uint8Array, offset: number): Uint8Array {
  const out = new Uint8Array(new ArrayBuffer(payload.byteLength + offset), offset, payload.byteLength);
  out.set(payload);
  return out;
}

describe("the padding entry", () => {
  it("puts x or y at a multiple of 8 in every encoded dispatch and result, with and without a length prefix", () => {
    const encoder = new FrameEncoder();
    fc.assert(
      fc.property(tensorFrame, (frame) => {
        expectPadded(encodeFrame(frame), frame.t);
        expectPadded(encodeFrameWithPrefixSpace(frame).subarray(4), frame.t);
        encoder.encode(frame, (bytes) => expectPadded(bytes, frame.t));
      }),
      { numRuns: 400 },
    );
  });

  it("puts y at a multiple of 8 in a result written in place, whatever ms the fill returns", () => {
    fc.assert(
      fc.property(
        tensorFrame.filter((f) => f.t === "result"),
        fc.option(fc.oneof(fc.nat(), fc.double({ min: 0, max: 1e9, noNaN: true })), { nil: undefined }),
        (frame, ms) => {
          const y = (frame as { y: Float32Array }).y;
          const { ms: _, ...rest } = frame as Frame & { ms?: number };
          const bytes = encodeFrame({
            ...rest,
            y: {
              values: y.length,
              fill: (into: Float32Array) => {
                into.set(y);
                return ms;
              },
            },
          } as never);
          expectPadded(bytes, "result");
          expect(Buffer.from(bytes).equals(Buffer.from(encodeFrame({ ...rest, ms } as Frame)))).toBe(true);
        },
      ),
      { numRuns: 200 },
    );
  });

  it("is written anew by rerouteFrame: from padded frames, from older unpadded ones, and over odd padding", () => {
    const rerouter = new FrameRerouter();
    fc.assert(
      fc.property(
        tensorFrame,
        fc.integer({ min: 0, max: 0xffff_ffff }),
        fc.option(peerId, { nil: undefined }),
        fc.option(peerId, { nil: undefined }),
        fc.integer({ min: 0, max: 40 }),
        (frame, id, to, from, junk) => {
          const want = encodeFrame({ ...frame, id, to, from } as Frame);
          const padded = encodeFrame(frame);
          const old = unpadded(padded);
          // an older sender's frame: valid, no padding, the same values
          expect(decodeFrame(old)).toEqual(decodeFrame(padded));
          // odd padding: a longer bin of junk at the end, after the tensor
          const odd = withEntryAtEnd(
            old,
            "_",
            Uint8Array.from({ length: junk }, (_, i) => i + 1),
          );
          for (const input of [padded, old, odd]) {
            const out = rerouteFrame(input, { id, to, from }, MAX);
            expectPadded(out, frame.t);
            expect(Buffer.from(out).equals(Buffer.from(want))).toBe(true);
            const reused = rerouter.reroute(input, { id, to, from }, MAX);
            try {
              expect(Buffer.from(reused).equals(Buffer.from(want))).toBe(true);
            } finally {
              rerouter.release(false);
            }
          }
        },
      ),
      { numRuns: 300 },
    );
  });

  it("is forwarded as any unknown key by rerouteFrame in frames of other types", () => {
    const error = encodeFrame({ t: "error", v: 1, id: 3, code: "MOESWARM_X", msg: "m" });
    const odd = withEntryAtEnd(error, "_", Uint8Array.of(1, 2, 3));
    const out = rerouteFrame(odd, { id: 4, to: "bb" }, MAX);
    expect(entries(out).map((e) => e.key)).toEqual(["t", "v", "id", "to", "code", "msg", "_"]);
    expect(decodeFrame(out)).toEqual({ t: "error", v: 1, id: 4, to: "bb", code: "MOESWARM_X", msg: "m" });
  });

  it("gives views of x and y to a decoder that holds the payload aligned, at every header width", () => {
    for (const embd of [1, 3, 40, 63, 64, 16_383, 16_384, 20_000]) {
      for (const id of [0, 200, 70_000, 0xffff_ffff]) {
        const result: Frame = {
          t: "result",
          ...{ v: 1, id, mode: "sum", n: 1, k: 1, embd },
          y: new Float32Array(embd).map((_, i) => i - 0.5),
          ms: 0.25,
        };
        for (const frame of [result, dispatchOf(embd, id)]) {
          const bytes = placed(encodeFrame(frame), 8);
          const decoded = decodeFrame(bytes) as unknown as Record<string, Float32Array>;
          const tensor = frame.t === "dispatch" ? decoded.x! : decoded.y!;
          expect(tensor.buffer).toBe(bytes.buffer); // a view, not a copy
          expect(tensor).toEqual(frame.t === "dispatch" ? (frame as { x: Float32Array }).x : result.y);
          // at 4 mod 8 (after a 4-byte WebSocket header) still a view of f32
          const at4 = decodeFrame(placed(encodeFrame(frame), 4)) as unknown as Record<string, Float32Array>;
          expect((frame.t === "dispatch" ? at4.x! : at4.y!).byteOffset % 8).toBe(4);
        }
      }
    }
  });

  it("decodes the protocol's test vectors as written before the padding (no `_`) to the same values", () => {
    // dispatch-f32-each and result-each as docs/protocol.md had them before rule 9
    const dispatch = fromHex(`8c a1 74 a8 64 69 73 70 61 74 63 68 a1 76 01 a2 69 64 07 a5 6d 6f 64 65 6c a1 6d
      a5 6c 61 79 65 72 03 a1 6e 02 a4 65 6d 62 64 04 a5 64 74 79 70 65 a3 66 33 32 a1 78 c4 20 00 00 80 3f 00 00
      00 40 00 00 40 40 00 00 80 40 00 00 00 3f 00 00 80 bf 00 00 00 00 00 00 20 c0 a1 6b 02 a3 69 64 73 c4 10 00
      00 00 00 05 00 00 00 03 00 00 00 ff ff ff ff a4 6d 6f 64 65 a4 65 61 63 68`);
    const result =
      fromHex(`89 a1 74 a6 72 65 73 75 6c 74 a1 76 01 a2 69 64 07 a4 6d 6f 64 65 a4 65 61 63 68 a1
      6e 02 a1 6b 02 a4 65 6d 62 64 04 a1 79 c4 40 00 00 80 3f 00 00 00 40 00 00 40 40 00 00 80 40 00 00 80 c0 00
      00 00 41 00 00 00 3f 00 00 00 00 00 00 80 3e 00 00 80 bf 00 00 00 40 00 00 80 41 00 00 00 00 00 00 00 00 00
      00 00 00 00 00 00 00 a2 6d 73 cb 3f f8 00 00 00 00 00 00`);
    for (const old of [dispatch, result]) {
      // at every alignment: a copy where the tensor is not aligned, the same values
      for (const offset of [0, 1, 2, 3, 4, 5, 6, 7]) {
        const frame = decodeFrame(placed(old, offset));
        const again = encodeFrame(frame);
        expectPadded(again, frame.t);
        expect(unpadded(again)).toEqual(old);
        expect(decodeFrame(again)).toEqual(frame);
      }
    }
    expect((decodeFrame(dispatch) as { x: Float32Array }).x).toEqual(
      new Float32Array([1, 2, 3, 4, 0.5, -1, 0, -2.5]),
    );
  });
});

function dispatchOf(embd: number, id: number): Frame {
  return {
    t: "dispatch",
    v: 1,
    id,
    to: "w",
    model: "m",
    layer: 0,
    n: 1,
    embd,
    dtype: "f32",
    x: new Float32Array(embd).map((_, i) => i * 2),
    k: 1,
    ids: Int32Array.of(0),
    w: Float32Array.of(1),
    mode: "sum",
  };
}

/** `payload` with one more entry at the end: `key` with a bin value. */
function withEntryAtEnd(payload: Uint8Array, key: string, value: Uint8Array): Uint8Array {
  const list = entries(payload);
  const count = list.length + 1;
  const head = count < 16 ? [0x80 | count] : [0xde, count >> 8, count & 0xff];
  const body = payload.subarray(list[0]!.start);
  return Uint8Array.from([
    ...head,
    ...body,
    0xa0 | key.length,
    ...Buffer.from(key),
    0xc4,
    value.length,
    ...value,
  ]);
}

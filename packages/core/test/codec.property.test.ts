import { encode as msgpackEncode } from "@msgpack/msgpack";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { decodeFrame, encodeFrame, type Frame, ProtocolError, validateFrame } from "../src/index.js";
import { Kind, MsgpackReader } from "../src/msgpack-read.js";
import { validFrame } from "./arbitraries.js";
import { padded } from "./codec-helpers.js";

/** The frame as the decoder returns it: -0 becomes 0 (it is encoded as the integer 0). */
function normalised(frame: Frame): Frame {
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(frame)) out[k] = Object.is(v, -0) ? 0 : v;
  return out as unknown as Frame;
}

function wire(frame: Frame): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(frame)) {
    out[k] = ArrayBuffer.isView(v) ? new Uint8Array(v.buffer, v.byteOffset, v.byteLength) : v;
  }
  return out;
}

/** decodeFrame either returns a frame that is itself valid, or throws a ProtocolError. */
function decodesOrProtocolError(bytes: Uint8Array): void {
  let frame: Frame;
  try {
    frame = decodeFrame(bytes);
  } catch (error) {
    if (!(error instanceof ProtocolError)) throw error;
    return;
  }
  validateFrame(frame);
}

/** Offsets of every msgpack value header in a well-formed encoding (where lengths live). */
function headerOffsets(bytes: Uint8Array): number[] {
  const r = new MsgpackReader(bytes);
  const offsets: number[] = [];
  const walk = (): void => {
    offsets.push(r.pos);
    const kind = r.head();
    if (kind === Kind.str || kind === Kind.bin) r.pos += r.num;
    else if (kind === Kind.array || kind === Kind.map) {
      const items = kind === Kind.map ? r.num * 2 : r.num;
      for (let i = 0; i < items; i++) walk();
    }
  };
  walk();
  return offsets;
}

describe("encode/decode properties", () => {
  it("round-trips random valid frames of every type", () => {
    fc.assert(
      fc.property(validFrame, (frame) => {
        const bytes = encodeFrame(frame);
        expect(decodeFrame(bytes)).toEqual(normalised(frame));
        // the decoded frame encodes to the same bytes
        expect(Buffer.from(encodeFrame(decodeFrame(bytes))).equals(Buffer.from(bytes))).toBe(true);
      }),
      { numRuns: 700 },
    );
  });

  it("encodes exactly what @msgpack/msgpack encodes for the same values in canonical order", () => {
    fc.assert(
      fc.property(validFrame, (frame) => {
        // builders put keys in canonical order; arbitraries already do, so this is an independent check
        const expected = Buffer.from(msgpackEncode(padded(wire(normalised(frame)))));
        expect(Buffer.from(encodeFrame(frame)).toString("hex")).toBe(expected.toString("hex"));
      }),
      { numRuns: 500 },
    );
  });

  it("random bytes never throw anything but ProtocolError", () => {
    fc.assert(
      fc.property(
        fc.oneof(
          fc.uint8Array({ maxLength: 64 }),
          // a map header first, to get past the first check more often
          fc
            .tuple(fc.integer({ min: 0x80, max: 0x8f }), fc.uint8Array({ maxLength: 200 }))
            .map(([h, rest]) => Uint8Array.from([h, ...rest])),
        ),
        (bytes) => decodesOrProtocolError(bytes),
      ),
      { numRuns: 3000 },
    );
  });

  it("truncations, bit flips, byte overwrites and length-field mutations of valid frames never throw anything but ProtocolError", () => {
    fc.assert(
      fc.property(
        validFrame,
        fc.integer({ min: 0, max: 2 ** 31 }),
        fc.integer({ min: 0, max: 7 }),
        fc.uint32Array({ minLength: 1, maxLength: 1 }),
        fc.constantFrom("truncate", "flip", "overwrite", "length", "insert", "delete"),
        (frame, at, bit, [rand], how) => {
          const bytes = encodeFrame(frame).slice();
          const i = at % bytes.length;
          let mutated: Uint8Array;
          switch (how) {
            case "truncate":
              mutated = bytes.subarray(0, i);
              break;
            case "flip":
              bytes[i]! ^= 1 << bit;
              mutated = bytes;
              break;
            case "overwrite":
              bytes[i] = rand! & 0xff;
              mutated = bytes;
              break;
            case "length": {
              // rewrite the bytes right after a header byte (a length or count) with a random u32
              const headers = headerOffsets(bytes);
              const h = headers[at % headers.length]!;
              const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
              const room = bytes.length - h - 1;
              if (room >= 4) dv.setUint32(h + 1, rand!);
              else if (room >= 1) bytes[h + 1] = rand! & 0xff;
              // and sometimes the header byte itself to a wider str/bin/array/map header
              if (bit < 4) bytes[h] = [0xc6, 0xdb, 0xdd, 0xdf][bit]!;
              mutated = bytes;
              break;
            }
            case "insert":
              mutated = Uint8Array.from([...bytes.subarray(0, i), rand! & 0xff, ...bytes.subarray(i)]);
              break;
            default:
              mutated = Uint8Array.from([...bytes.subarray(0, i), ...bytes.subarray(i + 1)]);
          }
          decodesOrProtocolError(mutated);
        },
      ),
      { numRuns: 2500 },
    );
  });

  it("every strict prefix of a valid frame is rejected", () => {
    fc.assert(
      fc.property(validFrame, (frame) => {
        const bytes = encodeFrame(frame);
        for (let cut = 0; cut < bytes.length; cut += Math.max(1, bytes.length >> 4)) {
          expect(() => decodeFrame(bytes.subarray(0, cut))).toThrow(ProtocolError);
        }
      }),
      { numRuns: 150 },
    );
  });
});

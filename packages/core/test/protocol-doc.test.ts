import { decode as msgpackDecode, encode as msgpackEncode } from "@msgpack/msgpack";
import { Unpackr } from "msgpackr";
import { describe, expect, it } from "vitest";
import {
  CAPS_FIELDS,
  decodeFrame,
  encodeFrame,
  FRAME_FIELDS,
  FRAME_TYPES,
  type Frame,
} from "../src/index.js";
import { padded } from "./codec-helpers.js";
import { docKeyOrder, docVectors } from "./doc-vectors.js";
import { frameToJson, VECTORS } from "./vectors.js";

const vectors = docVectors();
const msgpackr = new Unpackr({ useRecords: false, int64AsType: "number" });

/**
 * What another msgpack library sees: bins as byte arrays, numbers as numbers, and the padding entry
 * `_` of a dispatch or result (which decodeFrame skips), as the test helper computes it on its own.
 */
function wireJson(frame: Frame): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(frame)) {
    out[k] = ArrayBuffer.isView(v) ? new Uint8Array(v.buffer, v.byteOffset, v.byteLength) : v;
  }
  return padded(out);
}

describe("docs/protocol.md test vectors", () => {
  it("has a vector for every frame type, each appearing once", () => {
    const names = vectors.map((v) => v.name);
    expect(new Set(names).size).toBe(names.length);
    const types = new Set(vectors.map((v) => v.json.t));
    expect([...types].sort()).toEqual([...FRAME_TYPES].sort());
    expect(vectors.length).toBe(VECTORS.length);
  });

  for (const vector of vectors) {
    it(`${vector.name}: decodes to the values shown and re-encodes byte for byte`, () => {
      const frame = decodeFrame(vector.bytes);
      expect(frameToJson(frame)).toEqual(vector.json);
      expect(Buffer.from(encodeFrame(frame)).toString("hex")).toBe(Buffer.from(vector.bytes).toString("hex"));
    });

    it(`${vector.name}: decodes the same with @msgpack/msgpack and with msgpackr`, () => {
      const frame = decodeFrame(vector.bytes);
      const expected = wireJson(frame);
      expect(msgpackDecode(vector.bytes)).toEqual(expected);
      const viaMsgpackr = msgpackr.unpack(vector.bytes) as Record<string, unknown>;
      for (const [k, v] of Object.entries(viaMsgpackr)) {
        if (v instanceof Uint8Array) viaMsgpackr[k] = new Uint8Array(v);
      }
      expect(viaMsgpackr).toEqual(expected);
    });

    it(`${vector.name}: is what @msgpack/msgpack encodes for the same values`, () => {
      const frame = decodeFrame(vector.bytes);
      expect(Buffer.from(msgpackEncode(wireJson(frame))).toString("hex")).toBe(
        Buffer.from(vector.bytes).toString("hex"),
      );
    });
  }

  it("matches the frames of test/vectors.ts (regenerate with scripts/protocol-vectors.ts)", () => {
    for (const v of VECTORS) {
      const doc = vectors.find((d) => d.name === v.name);
      expect(doc, v.name).toBeDefined();
      expect(Buffer.from(encodeFrame(v.frame)).toString("hex")).toBe(Buffer.from(doc!.bytes).toString("hex"));
    }
  });
});

describe("docs/protocol.md field tables", () => {
  it("list the fields of every frame type in the encoder's canonical order", () => {
    const order = docKeyOrder();
    for (const t of FRAME_TYPES) {
      expect(order[t], t).toEqual(FRAME_FIELDS[t].map((f) => f.key));
    }
    expect(order.caps).toEqual(CAPS_FIELDS.map((f) => f.key));
  });
});

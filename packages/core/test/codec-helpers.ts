// Shared by the codec tests (encoding, decoding, the encoder and the writer): byte helpers, an
// independent encoder's bytes and hand-made frames.
import { encode as msgpackEncode } from "@msgpack/msgpack";
import { expect } from "vitest";
import { decodeFrame, encodeFrame, type Frame, ProtocolError } from "../src/index.js";

export const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");
export const fromHex = (h: string) => Uint8Array.from(Buffer.from(h.replace(/\s+/g, ""), "hex"));

/** A valid dispatch as a plain object with byte bins, for hand-made (in)valid variants. */
export function rawDispatch(overrides: Record<string, unknown> = {}): Record<string, unknown> {
  return {
    t: "dispatch",
    v: 1,
    id: 42,
    model: "m",
    layer: 1,
    n: 2,
    embd: 3,
    dtype: "f32",
    x: bytes(new Float32Array([1, 2, 3, 4, 5, 6])),
    k: 2,
    ids: bytes(new Int32Array([0, 1, 2, -1])),
    w: bytes(new Float32Array([0.5, 0.5, 1, 0])),
    mode: "sum",
    ...overrides,
  };
}
export function bytes(a: ArrayBufferView): Uint8Array {
  return new Uint8Array(a.buffer, a.byteOffset, a.byteLength).slice();
}
/** The frame as a plain object with byte bins, as @msgpack/msgpack encodes it independently. */
export function plainObject(frame: Frame): Record<string, unknown> {
  const o: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(frame)) o[k] = ArrayBuffer.isView(v) ? bytes(v) : v;
  return o;
}
/**
 * The frame's bytes as @msgpack/msgpack (an independent encoder) writes it, in hex: tensors as byte
 * bins, -0 as the integer 0 (which the canonical form writes for it), and the padding entry
 * (`padded`).
 */
export function msgpackHex(frame: Frame): string {
  const o: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(frame))
    o[k] = ArrayBuffer.isView(v) ? bytes(v) : Object.is(v, -0) ? 0 : v;
  return hex(msgpackEncode(padded(o)));
}

const MAIN: Record<string, string> = { dispatch: "x", result: "y" };

/**
 * A dispatch or result as a plain object in canonical order (bins as bytes) with the padding entry
 * `_` of the canonical form (docs/protocol.md section 8) inserted right before `x` / `y`: an oracle
 * for the encoders that knows nothing of them. Where the tensor's data starts is measured on
 * @msgpack/msgpack's own encoding of the entries before it; the map header is that of the whole
 * map. Other frames come back as they are.
 */
export function padded(o: Record<string, unknown>): Record<string, unknown> {
  const main = MAIN[o.t as string];
  if (main === undefined || !(main in o)) return o;
  const keys = Object.keys(o).filter((k) => k !== "_");
  const before: Record<string, unknown> = {};
  for (const k of keys.slice(0, keys.indexOf(main))) before[k] = o[k];
  before._ = new Uint8Array(0);
  const mapHeader = (n: number) => (n < 16 ? 1 : 3);
  const tensor = o[main] as Uint8Array;
  const entries = msgpackEncode(before).byteLength - mapHeader(Object.keys(before).length);
  const dataAt =
    mapHeader(keys.length + 1) +
    entries +
    msgpackEncode(main).byteLength +
    (msgpackEncode(tensor).byteLength - tensor.byteLength);
  const out: Record<string, unknown> = {};
  for (const k of keys) {
    if (k === main) out._ = new Uint8Array((8 - (dataAt % 8)) % 8);
    out[k] = o[k];
  }
  return out;
}
export function pack(o: unknown): Uint8Array {
  return msgpackEncode(o);
}

export function protocolError(fn: () => unknown): ProtocolError {
  try {
    fn();
  } catch (error) {
    expect(error).toBeInstanceOf(ProtocolError);
    return error as ProtocolError;
  }
  throw new Error("expected a ProtocolError");
}
export const codeOf = (b: Uint8Array, options?: Parameters<typeof decodeFrame>[1]) =>
  protocolError(() => decodeFrame(b, options)).code;

/** The encoded bytes of the value of `key` in a ping/pong/etc frame (value is the map's last entry). */
export function valueHex(frame: Frame, key: string): string {
  const h = hex(encodeFrame(frame));
  const k = hex(new TextEncoder().encode(key));
  const keyHeader = (0xa0 | key.length).toString(16) + k;
  const at = h.lastIndexOf(keyHeader);
  return h.slice(at + keyHeader.length);
}

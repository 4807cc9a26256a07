import { ProtocolError } from "./errors.js";
import { PROTOCOL_VERSION } from "./frames.js";
import { Kind, MsgpackReader } from "./msgpack-read.js";

// Forwarding a frame with new routing fields without decoding or re-encoding its payload: the
// relay patches `id`, `to` and `from` of a dispatch or result it has validated (decodeFrame with
// `raw: true`) and copies every other entry's bytes as they came. On a canonical frame the output
// is byte for byte what encodeFrame would write for `{ ...frame, id, to, from }`.

/** The routing fields a relay sets on a frame it forwards. */
export interface RoutePatch {
  id: number;
  to?: string | undefined;
  from?: string | undefined;
}

const ROUTING_KEYS = ["t", "v", "id", "to", "from"] as const;
const TE = new TextEncoder();
const strBytes = (s: string): Uint8Array => TE.encode(s);

const KEY_T = strBytes("t");
const KEY_V = strBytes("v");
const KEY_ID = strBytes("id");
const KEY_TO = strBytes("to");
const KEY_FROM = strBytes("from");

/** msgpack str header + bytes; peer ids and type names are short (< 2^16 bytes). */
function strSize(n: number): number {
  return n < 32 ? 1 + n : n < 0x100 ? 2 + n : 3 + n;
}

function writeStr(out: Uint8Array, at: number, b: Uint8Array): number {
  const n = b.byteLength;
  if (n < 32) out[at++] = 0xa0 | n;
  else if (n < 0x100) {
    out[at++] = 0xd9;
    out[at++] = n;
  } else {
    out[at++] = 0xda;
    out[at++] = n >>> 8;
    out[at++] = n & 0xff;
  }
  out.set(b, at);
  return at + n;
}

function uintSize(v: number): number {
  return v < 0x80 ? 1 : v < 0x100 ? 2 : v < 0x1_0000 ? 3 : 5;
}

function writeUint(out: Uint8Array, at: number, v: number): number {
  if (v < 0x80) out[at++] = v;
  else if (v < 0x100) {
    out[at++] = 0xcc;
    out[at++] = v;
  } else if (v < 0x1_0000) {
    out[at++] = 0xcd;
    out[at++] = v >>> 8;
    out[at++] = v & 0xff;
  } else {
    out[at++] = 0xce;
    out[at++] = v >>> 24;
    out[at++] = (v >>> 16) & 0xff;
    out[at++] = (v >>> 8) & 0xff;
    out[at++] = v & 0xff;
  }
  return at;
}

function isKey(bytes: Uint8Array, pos: number, length: number, key: string): boolean {
  if (length !== key.length) return false;
  for (let i = 0; i < length; i++) if (bytes[pos + i] !== key.charCodeAt(i)) return false;
  return true;
}

/**
 * `frame` (one frame's msgpack bytes, already validated by decodeFrame) with its `id`, `to` and
 * `from` replaced by `patch` (an undefined `to` or `from` is left out), `t` and `v` first, then
 * `id`, `to`, `from`, then every other entry's bytes unchanged in their order. The payload is
 * copied once, never decoded. A ProtocolError MOESWARM_PROTOCOL_FRAME_TOO_LARGE when the new
 * fields push it over `maxFrameBytes`.
 */
export function rerouteFrame(frame: Uint8Array, patch: RoutePatch, maxFrameBytes: number): Uint8Array {
  const plan = planReroute(frame, patch, maxFrameBytes);
  return writeReroute(plan, Buffer.allocUnsafe(plan.size));
}

/** What a rerouted frame is made of: checked, sized, not yet written. */
interface ReroutePlan {
  frame: Uint8Array;
  patch: RoutePatch;
  keys: number;
  t: Uint8Array;
  to: Uint8Array | undefined;
  from: Uint8Array | undefined;
  /** The kept entries as [start, end) byte ranges of `frame`. */
  ranges: number[];
  size: number;
}

function planReroute(frame: Uint8Array, patch: RoutePatch, maxFrameBytes: number): ReroutePlan {
  if (!Number.isInteger(patch.id) || patch.id < 0 || patch.id > 0xffff_ffff) {
    throw new ProtocolError("MOESWARM_PROTOCOL_BAD_FIELD", `id ${patch.id} is outside 0..2^32-1`);
  }
  const r = new MsgpackReader(frame);
  if (r.head() !== Kind.map) throw new ProtocolError("a frame is a msgpack map");
  const count = r.num;
  // the kept entries as [start, end) byte ranges, adjacent ones merged
  const ranges: number[] = [];
  let kept = 0;
  let t: Uint8Array | undefined;
  for (let i = 0; i < count; i++) {
    const start = r.pos;
    if (r.head() !== Kind.str) throw new ProtocolError(`map key at offset ${start} is not a string`);
    const keyAt = r.pos;
    const keyLength = r.num;
    r.pos += keyLength;
    const valueAt = r.pos;
    const end = r.skip(2);
    let routing = false;
    for (const key of ROUTING_KEYS) {
      if (!isKey(frame, keyAt, keyLength, key)) continue;
      routing = true;
      if (key === "t") {
        r.pos = valueAt;
        r.head();
        t = frame.subarray(r.pos, r.pos + r.num);
        r.pos = end;
      }
      break;
    }
    if (routing) continue;
    kept++;
    if (ranges.length > 0 && ranges[ranges.length - 1] === start) ranges[ranges.length - 1] = end;
    else ranges.push(start, end);
  }
  if (t === undefined)
    throw new ProtocolError("MOESWARM_PROTOCOL_MISSING_FIELD", "the frame type `t` is missing");
  const to = patch.to === undefined ? undefined : strBytes(patch.to);
  const from = patch.from === undefined ? undefined : strBytes(patch.from);
  const keys = kept + 3 + (to ? 1 : 0) + (from ? 1 : 0);
  let size = keys < 16 ? 1 : 3;
  size += 2 + strSize(t.byteLength) + 2 + uintSize(PROTOCOL_VERSION) + 3 + uintSize(patch.id);
  if (to) size += 3 + strSize(to.byteLength);
  if (from) size += 5 + strSize(from.byteLength);
  for (let i = 0; i < ranges.length; i += 2) size += ranges[i + 1]! - ranges[i]!;
  if (size > maxFrameBytes) {
    throw new ProtocolError(
      "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
      `frame of ${size} bytes exceeds the maximum of ${maxFrameBytes}`,
      { details: { size, max: maxFrameBytes } },
    );
  }
  return { frame, patch, keys, t, to, from, ranges, size };
}

/** Writes a planned frame into `out` (at least `plan.size` bytes); returns its first `size` bytes. */
function writeReroute(plan: ReroutePlan, out: Uint8Array): Uint8Array {
  const { frame, patch, keys, t, to, from, ranges } = plan;
  let at = 0;
  if (keys < 16) out[at++] = 0x80 | keys;
  else {
    out[at++] = 0xde;
    out[at++] = keys >>> 8;
    out[at++] = keys & 0xff;
  }
  at = writeStr(out, at, KEY_T);
  at = writeStr(out, at, t);
  at = writeStr(out, at, KEY_V);
  at = writeUint(out, at, PROTOCOL_VERSION);
  at = writeStr(out, at, KEY_ID);
  at = writeUint(out, at, patch.id);
  if (to) {
    at = writeStr(out, at, KEY_TO);
    at = writeStr(out, at, to);
  }
  if (from) {
    at = writeStr(out, at, KEY_FROM);
    at = writeStr(out, at, from);
  }
  for (let i = 0; i < ranges.length; i += 2) {
    out.set(frame.subarray(ranges[i]!, ranges[i + 1]!), at);
    at += ranges[i + 1]! - ranges[i]!;
  }
  return out.byteLength === at ? out : out.subarray(0, at);
}

/**
 * `rerouteFrame` into memory it reuses, for a relay that forwards frame after frame: writing into
 * memory already in use is several times faster than into fresh memory, most of what rerouting a
 * large frame costs. The bytes are lent: `reroute` returns them and `release` takes them back,
 * once per successful `reroute`, in a `finally`. Give `release` `kept = true` when something may
 * still hold them (a socket that has not written them yet): the memory is then left to it and the
 * next frame gets new memory. A `reroute` while bytes are lent gets memory of its own.
 */
export class FrameRerouter {
  #buffer = new Uint8Array(0);
  #lent = 0;

  /** The frame with new routing fields (ProtocolError as `rerouteFrame`, before anything is lent). */
  reroute(frame: Uint8Array, patch: RoutePatch, maxFrameBytes: number): Uint8Array {
    const plan = planReroute(frame, patch, maxFrameBytes);
    if (this.#lent++ > 0) return writeReroute(plan, Buffer.allocUnsafe(plan.size));
    if (this.#buffer.byteLength < plan.size) {
      // zero-filled: no stale process memory is ever reachable through the view's .buffer
      this.#buffer = new Uint8Array(Math.max(4096, plan.size + (plan.size >> 3)));
    }
    return writeReroute(plan, this.#buffer);
  }

  /** Takes back the bytes of the last `reroute`; `kept`: something may still read them. */
  release(kept: boolean): void {
    if (this.#lent === 0) return;
    if (--this.#lent === 0 && kept) this.#buffer = new Uint8Array(0);
  }
}

import { PAD_ENTRY_BYTES, padBytes, writePad } from "./codec-write.js";
import { ProtocolError } from "./errors.js";
import { MAIN_TENSOR_KEY, MAX_HEADROOM, PAD_KEY, PROTOCOL_VERSION } from "./frames.js";
import { Kind, MsgpackReader } from "./msgpack-read.js";

// Forwarding a frame with new routing fields without decoding or re-encoding its payload: the
// relay patches `id`, `to` and `from` of a dispatch or result it has validated (decodeFrame with
// `raw: true`) and copies every other entry's bytes as they came. The new routing fields change the
// length of what comes before the main tensor (`x`, `y`), so the padding entry that aligns it
// (protocol section 8) is written anew: any padding the frame came with is dropped, and one of the
// right length goes right before the main tensor, also into a frame that came without one (an
// older sender's). On a canonical frame the output is byte for byte what encodeFrame would write
// for `{ ...frame, id, to, from }`.

/** The routing fields a relay sets on a frame it forwards. */
export interface RoutePatch {
  id: number;
  to?: string | undefined;
  from?: string | undefined;
}

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

/** Writes a msgpack str of `b` (or its `n` bytes from `start`) at `at`; returns the offset after it. */
function writeStr(out: Uint8Array, at: number, b: Uint8Array, start = 0, n = b.byteLength): number {
  if (n < 32) out[at++] = 0xa0 | n;
  else if (n < 0x100) {
    out[at++] = 0xd9;
    out[at++] = n;
  } else {
    out[at++] = 0xda;
    out[at++] = n >>> 8;
    out[at++] = n & 0xff;
  }
  return copyBytes(out, at, b, start, start + n);
}

/**
 * Copies `src[start, end)` to `out` at `at`; returns the offset after it. Short runs (the routing
 * fields, the small entries before a main tensor) byte by byte: a subarray for `set` costs more
 * than copying a few dozen bytes.
 */
function copyBytes(out: Uint8Array, at: number, src: Uint8Array, start: number, end: number): number {
  if (end - start > 64) {
    out.set(src.subarray(start, end), at);
    return at + end - start;
  }
  for (let i = start; i < end; i++) out[at++] = src[i]!;
  return at;
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

// the frame types with a main tensor, as their bytes, with its `what` (2 `x`, 3 `y`)
const MAIN_TENSORS = Object.entries(MAIN_TENSOR_KEY).map(
  ([type, key]) => [strBytes(type), key === "x" ? 2 : 3] as const,
);

/** The `what` (2 `x`, 3 `y`) of the main tensor of the frame type `b[at, at + length)`, or 0 for none. */
function mainTensorOf(b: Uint8Array, at: number, length: number): number {
  next: for (const [type, what] of MAIN_TENSORS) {
    if (type.byteLength !== length) continue;
    for (let i = 0; i < length; i++) if (b[at + i] !== type[i]) continue next;
    return what;
  }
  return 0;
}

// Peer ids as UTF-8, the last ones used: the same few ids are written frame after frame.
const PEER_ID_BYTES = new Map<string, Uint8Array>();
const PEER_IDS_KEPT = 256;

function peerIdBytes(id: string): Uint8Array {
  let bytes = PEER_ID_BYTES.get(id);
  if (bytes === undefined) {
    if (PEER_ID_BYTES.size >= PEER_IDS_KEPT) PEER_ID_BYTES.clear();
    bytes = strBytes(id);
    PEER_ID_BYTES.set(id, bytes);
  }
  return bytes;
}

/**
 * `frame` (one frame's msgpack bytes, already validated by decodeFrame) with its `id`, `to` and
 * `from` replaced by `patch` (an undefined `to` or `from` is left out), `t` and `v` first, then
 * `id`, `to`, `from`, then every other entry's bytes unchanged in their order, except that a
 * `dispatch` or `result` gets a new padding entry `_` right before its main tensor (any padding it
 * had is dropped) so that the tensor's data starts at a multiple of 8 in the new frame. The payload
 * is copied once, never decoded. A ProtocolError MOESWARM_PROTOCOL_FRAME_TOO_LARGE when the new
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
  /** The frame type's bytes: `frame[tAt, tAt + tLength)`. */
  tAt: number;
  tLength: number;
  to: Uint8Array | undefined;
  from: Uint8Array | undefined;
  /**
   * The kept entries as [start, end) byte ranges of `frame`; a pair [-1, pad] stands for the
   * padding entry with `pad` padding bytes.
   */
  ranges: number[];
  size: number;
  /** No main tensor, or a bin entry before it (whose bytes a decoded frame may view). */
  binBeforeMain: boolean;
}

// the entries of the frame being planned, [start, end, what] each (see planReroute); reused, as a
// relay plans one frame at a time and writes it before planning the next
let entries = new Int32Array(3 * 32);

const T_BYTE = KEY_T[0];
const V_BYTE = KEY_V[0];
const PAD_BYTE = PAD_KEY.charCodeAt(0);

/**
 * What a key is to rerouting, from its bytes: 1 `t`, 2 another routing key (`v`, `id`, `to`,
 * `from`), 3 the padding key `_`, 4 `x` or `y`, 0 any other. The one-byte keys by one switch on
 * that byte: this runs per entry of every forwarded frame.
 */
function keyRole(b: Uint8Array, at: number, length: number): number {
  if (length === 1) {
    const c = b[at];
    if (c === T_BYTE) return 1;
    if (c === V_BYTE) return 2;
    if (c === PAD_BYTE) return 3;
    return c === 0x78 || c === 0x79 ? 4 : 0; // x, y
  }
  if (length === 2) return isKey(b, at, 2, "id") || isKey(b, at, 2, "to") ? 2 : 0;
  return length === 4 && isKey(b, at, 4, "from") ? 2 : 0;
}

function planReroute(frame: Uint8Array, patch: RoutePatch, maxFrameBytes: number): ReroutePlan {
  if (!Number.isInteger(patch.id) || patch.id < 0 || patch.id > 0xffff_ffff) {
    throw new ProtocolError("MOESWARM_PROTOCOL_BAD_FIELD", `id ${patch.id} is outside 0..2^32-1`);
  }
  const r = new MsgpackReader(frame);
  if (r.head() !== Kind.map) throw new ProtocolError("a frame is a msgpack map");
  const count = r.num;
  if (entries.length < 3 * count) entries = new Int32Array(3 * count);
  // every entry but the routing fields as [start, end, what] (0 any, 1 padding, 2 `x`, 3 `y`, with
  // the tensor's byte length in `tensorBytes`, 4 another bin); which ones are padding and main is
  // known once `t` is
  let n = 0;
  const tensorBytes = [0, 0];
  let tAt = -1;
  let tLength = 0;
  for (let i = 0; i < count; i++) {
    const start = r.pos;
    if (r.head() !== Kind.str) throw new ProtocolError(`map key at offset ${start} is not a string`);
    const keyAt = r.pos;
    const role = keyRole(frame, keyAt, r.num);
    r.pos += r.num;
    const valueAt = r.pos;
    const end = r.skip(2);
    if (role === 1) {
      r.pos = valueAt;
      r.head();
      tAt = r.pos;
      tLength = r.num;
      r.pos = end;
    }
    if (role === 1 || role === 2) continue;
    // (any other bin is 4: a decoded frame's views may point at it, so it is never written over)
    let what = frame[valueAt]! >= 0xc4 && frame[valueAt]! <= 0xc6 ? 4 : 0;
    if (role === 3) what = 1;
    else if (role === 4) {
      // `x` or `y`: its length, from its bin header (a main tensor of another type is refused below)
      r.pos = valueAt;
      if (r.head() === Kind.bin) {
        what = frame[keyAt] === 0x78 ? 2 : 3;
        tensorBytes[what - 2] = r.num;
      }
      r.pos = end;
    }
    entries[n++] = start;
    entries[n++] = end;
    entries[n++] = what;
  }
  if (tAt < 0) throw new ProtocolError("MOESWARM_PROTOCOL_MISSING_FIELD", "the frame type `t` is missing");
  const to = patch.to === undefined ? undefined : peerIdBytes(patch.to);
  const from = patch.from === undefined ? undefined : peerIdBytes(patch.from);
  let main = mainTensorOf(frame, tAt, tLength);
  // (a validated dispatch or result has its main tensor; without one, padding is any other entry)
  let found = false;
  for (let i = 2; i < n; i += 3) found ||= entries[i] === main;
  if (!found) main = 0;
  let kept = 0;
  for (let i = 2; i < n; i += 3) kept += main !== 0 && entries[i] === 1 ? 0 : 1;
  let binBeforeMain = main === 0;
  for (let i = 2; i < n && entries[i] !== main; i += 3) binBeforeMain ||= entries[i]! >= 2;
  const keys = kept + 3 + (to ? 1 : 0) + (from ? 1 : 0) + (main !== 0 ? 1 : 0);
  let size = keys < 16 ? 1 : 3;
  size += 2 + strSize(tLength) + 2 + uintSize(PROTOCOL_VERSION) + 3 + uintSize(patch.id);
  if (to) size += 3 + strSize(to.byteLength);
  if (from) size += 5 + strSize(from.byteLength);
  // the kept entries as ranges, adjacent ones merged, the new padding entry before the main tensor
  const ranges: number[] = [];
  for (let i = 0; i < n; i += 3) {
    const start = entries[i]!;
    const end = entries[i + 1]!;
    const what = entries[i + 2]!;
    if (what === 1 && main !== 0) continue;
    if (what === main && main !== 0) {
      const pad = padBytes(size, main === 2 ? "x" : "y", tensorBytes[main - 2]!);
      ranges.push(-1, pad);
      size += PAD_ENTRY_BYTES + pad;
    } else if (ranges.length > 0 && ranges[ranges.length - 1] === start) {
      ranges[ranges.length - 1] = end;
      size += end - start;
      continue;
    }
    ranges.push(start, end);
    size += end - start;
  }
  if (size > maxFrameBytes) {
    throw new ProtocolError(
      "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
      `frame of ${size} bytes exceeds the maximum of ${maxFrameBytes}`,
      { details: { size, max: maxFrameBytes } },
    );
  }
  return { frame, patch, keys, tAt, tLength, to, from, ranges, size, binBeforeMain };
}

/**
 * Writes a planned frame into `out` (at least `plan.size` bytes), its ranges up to `upTo`; returns
 * the bytes written.
 */
function writeReroute(plan: ReroutePlan, out: Uint8Array, upTo = plan.ranges.length): Uint8Array {
  const { frame, patch, keys, to, from, ranges } = plan;
  let at = 0;
  if (keys < 16) out[at++] = 0x80 | keys;
  else {
    out[at++] = 0xde;
    out[at++] = keys >>> 8;
    out[at++] = keys & 0xff;
  }
  at = writeStr(out, at, KEY_T);
  at = writeStr(out, at, frame, plan.tAt, plan.tLength);
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
  for (let i = 0; i < upTo; i += 2) {
    if (ranges[i]! < 0) {
      at = writePad(out, at, ranges[i + 1]!);
      continue;
    }
    at = copyBytes(out, at, frame, ranges[i]!, ranges[i + 1]!);
  }
  return out.byteLength === at ? out : out.subarray(0, at);
}

/**
 * Where in `plan.frame` the rerouted frame starts when it can be written over the frame's own
 * bytes, or -1. Only what comes before the main tensor's entry is written anew (the routing
 * fields, the entries before it, the padding), ending where that entry starts, so the entry and all
 * after it stay where they are. It can when that is all that changes (nothing after the main
 * tensor is dropped), no bin comes before it (a decoded frame's tensors may be views of those
 * bytes), and the new fields fit in front of it: a sender that leaves `relayHeadroom` padding
 * bytes makes sure they do.
 */
function inPlaceStart(plan: ReroutePlan): number {
  const { frame, ranges } = plan;
  if (plan.binBeforeMain) return -1;
  // (the padding marker [-1, pad], then the main tensor's entry through the frame's end)
  const m = ranges.indexOf(-1);
  if (m < 0 || ranges.length !== m + 4 || ranges[m + 3] !== frame.byteLength) return -1;
  const mainAt = ranges[m + 2]!;
  const at = mainAt - (plan.size - (frame.byteLength - mainAt));
  return at >= 0 ? at : -1;
}

// the new bytes before the main tensor, written here first (they are made of the old ones)
let scratch = new Uint8Array(1024);

function writeInPlace(plan: ReroutePlan, at: number): Uint8Array {
  const upTo = plan.ranges.indexOf(-1) + 2;
  const length = plan.ranges[upTo]! - at;
  if (scratch.byteLength < length) scratch = new Uint8Array(length * 2);
  writeReroute(plan, scratch, upTo);
  copyBytes(plan.frame, at, scratch, 0, length);
  return plan.frame.subarray(at);
}

/**
 * The padding bytes a sender whose peer id is `id` leaves before a dispatch's or result's main
 * tensor (EncodeOptions `headroom`) so that a relay can forward the frame in its own memory: room
 * for the `from` entry the relay adds (the sender's id), a request id up to 4 bytes longer, and a
 * map header 2 bytes longer (15 entries and `from` make 16: fixmap to map16). A multiple of 8, so
 * the main tensor stays aligned (the alignment itself needs no room: both frames have it).
 */
export function relayHeadroom(id: string): number {
  const room = 1 + KEY_FROM.byteLength + strSize(strBytes(id).byteLength) + 4 + 2;
  return Math.min(MAX_HEADROOM, (room + 7) & ~7);
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
  /** Per lend not yet released, innermost last: whether it lent `#buffer`. */
  readonly #lends: boolean[] = [];
  #bufferLent = false;

  /** The frame with new routing fields (ProtocolError as `rerouteFrame`, before anything is lent). */
  reroute(frame: Uint8Array, patch: RoutePatch, maxFrameBytes: number): Uint8Array {
    return this.#write(planReroute(frame, patch, maxFrameBytes));
  }

  /**
   * As `reroute`, for a frame that is the caller's to change and that it will not read again (a
   * message just received): when the sender left room (`relayHeadroom`) the frame is rerouted in
   * its own memory, its bytes before the main tensor written over, and the result is a view of it.
   * Nothing of its payload is then copied. Release it as any other.
   */
  rerouteReceived(frame: Uint8Array, patch: RoutePatch, maxFrameBytes: number): Uint8Array {
    const plan = planReroute(frame, patch, maxFrameBytes);
    const at = inPlaceStart(plan);
    if (at < 0) return this.#write(plan);
    this.#lends.push(false);
    return writeInPlace(plan, at);
  }

  #write(plan: ReroutePlan): Uint8Array {
    if (this.#bufferLent) {
      this.#lends.push(false);
      return writeReroute(plan, Buffer.allocUnsafe(plan.size));
    }
    if (this.#buffer.byteLength < plan.size) {
      // zero-filled: no stale process memory is ever reachable through the view's .buffer
      this.#buffer = new Uint8Array(Math.max(4096, plan.size + (plan.size >> 3)));
    }
    this.#lends.push(true);
    this.#bufferLent = true;
    return writeReroute(plan, this.#buffer);
  }

  /** Takes back the bytes of the last `reroute`; `kept`: something may still read them. */
  release(kept: boolean): void {
    if (this.#lends.pop() !== true) return;
    this.#bufferLent = false;
    if (kept) this.#buffer = new Uint8Array(0);
  }
}

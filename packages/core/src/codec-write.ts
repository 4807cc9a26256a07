import {
  FRAME_FIELDS,
  type Frame,
  type FrameType,
  MAIN_TENSOR_ALIGN,
  MAIN_TENSOR_KEY,
  PAD_KEY,
  PROTOCOL_VERSION,
} from "./frames.js";
import { bytesOf } from "./tensor.js";

// The writer of frames with tensors (dispatch, result): their other fields are numbers, short
// strings and booleans, written here straight into the frame's memory in one pass after a sizing
// pass, in the canonical form of docs/protocol.md that msgpackr emits for the other frames
// (the smallest int for every safe integer, float64 for any other number, the smallest str
// header). Packing the runs between tensors with msgpackr cost four calls and their views per
// frame, most of a small frame's encoding. The padding entry `_` (protocol section 8, rule 9) is
// written right before the main tensor (`x`, `y`) with the length that puts the tensor's data at a
// multiple of 8 from the payload's first byte; the payload's first byte is placed 8-byte aligned in
// memory, so the tensor is aligned there too and stays so within the frame as it travels.

/** Frame types that carry tensors: written here. */
export const TENSOR_FRAME_TYPES: ReadonlySet<FrameType> = new Set(
  (Object.keys(FRAME_FIELDS) as FrameType[]).filter((t) =>
    FRAME_FIELDS[t].some((s) => s.rule.type === "bin"),
  ),
);

const SCALAR_RULES: ReadonlySet<string> = new Set(["uint", "float", "str", "bool", "bin"]);
for (const t of TENSOR_FRAME_TYPES) {
  for (const spec of FRAME_FIELDS[t]) {
    // the writer knows these rules only; a frame type with tensors and lists needs more of it
    if (!SCALAR_RULES.has(spec.rule.type) || spec.key.length >= 32) {
      throw new Error(`codec-write cannot write ${t}.${spec.key} (${spec.rule.type})`);
    }
  }
}

const fixstr = (s: string): number[] => [0xa0 | s.length, ...Array.from(s, (c) => c.charCodeAt(0))];

interface Layout {
  /** The entries `t` and `v`, encoded (as a string of byte values). */
  readonly head: string;
  /** Each field's key as its fixstr header byte and characters (ASCII), in canonical order. */
  readonly keys: readonly string[];
  /** Each field's rule type, in canonical order. */
  readonly types: readonly string[];
  readonly names: readonly string[];
  /** Index of the main tensor's field (`x`, `y`): the padding entry is written before it. */
  readonly main: number;
}

const LAYOUTS = new Map<FrameType, Layout>();
for (const t of TENSOR_FRAME_TYPES) {
  const specs = FRAME_FIELDS[t];
  LAYOUTS.set(t, {
    head: String.fromCharCode(...fixstr("t"), ...fixstr(t), ...fixstr("v"), PROTOCOL_VERSION),
    keys: specs.map((s) => String.fromCharCode(0xa0 | s.key.length) + s.key),
    types: specs.map((s) => s.rule.type),
    names: specs.map((s) => s.key),
    main: specs.findIndex((s) => s.key === MAIN_TENSOR_KEY[t]),
  });
  if (LAYOUTS.get(t)!.main < 0) throw new Error(`codec-write knows no main tensor of ${t}`);
}

// A tensor not yet computed (a result's y written in place, see codec-encode's InPlaceTensor) is
// encoded as a view of this buffer: validation sees a Float32Array of the right length, and the
// writer leaves its bytes for the caller to fill. Never read or written (untouched pages of a
// zero-filled allocation are not even resident); grown as needed.
let holeBuffer = new ArrayBuffer(0);

/** A stand-in Float32Array of `values` values for a tensor the caller writes in place. */
export function holeOf(values: number): Float32Array {
  if (holeBuffer.byteLength < values * 4) holeBuffer = new ArrayBuffer(values * 4);
  return new Float32Array(holeBuffer, 0, values);
}

// Per-field scratch of one encoding (encoding is synchronous: never two at once).
const MAX_FIELDS = Math.max(...[...TENSOR_FRAME_TYPES].map((t) => FRAME_FIELDS[t].length));
const lengths = new Int32Array(MAX_FIELDS);
const tensors: Array<Uint8Array | undefined> = new Array(MAX_FIELDS).fill(undefined);
// the frame's values, read once (a keyed load by a field's name is a generic lookup)
const values: unknown[] = new Array(MAX_FIELDS).fill(undefined);

const TWO_32 = 0x1_0000_0000;

/** Bytes of a number in canonical msgpack. */
function numberSize(x: number): number {
  if (!Number.isSafeInteger(x)) return 9;
  if (x >= 0) return x < 0x80 ? 1 : x < 0x100 ? 2 : x < 0x1_0000 ? 3 : x < TWO_32 ? 5 : 9;
  return x >= -0x20 ? 1 : x >= -0x80 ? 2 : x >= -0x8000 ? 3 : x >= -0x8000_0000 ? 5 : 9;
}

/** Writes a number in canonical msgpack at `at`; returns the offset after it. */
export function writeNumber(out: Buffer, at: number, x: number): number {
  if (!Number.isSafeInteger(x)) {
    out[at] = 0xcb;
    out.writeDoubleBE(x, at + 1);
    return at + 9;
  }
  if (x >= 0) {
    // (-0 lands here and is written as the integer 0)
    if (x < 0x80) {
      out[at] = x;
      return at + 1;
    }
    if (x < 0x100) {
      out[at] = 0xcc;
      out[at + 1] = x;
      return at + 2;
    }
    if (x < 0x1_0000) {
      out[at] = 0xcd;
      out.writeUInt16BE(x, at + 1);
      return at + 3;
    }
    if (x < TWO_32) {
      out[at] = 0xce;
      out.writeUInt32BE(x, at + 1);
      return at + 5;
    }
    out[at] = 0xcf;
    out.writeUInt32BE(Math.floor(x / TWO_32), at + 1);
    out.writeUInt32BE(x % TWO_32, at + 5);
    return at + 9;
  }
  if (x >= -0x20) {
    out[at] = x & 0xff;
    return at + 1;
  }
  if (x >= -0x80) {
    out[at] = 0xd0;
    out.writeInt8(x, at + 1);
    return at + 2;
  }
  if (x >= -0x8000) {
    out[at] = 0xd1;
    out.writeInt16BE(x, at + 1);
    return at + 3;
  }
  if (x >= -0x8000_0000) {
    out[at] = 0xd2;
    out.writeInt32BE(x, at + 1);
    return at + 5;
  }
  out[at] = 0xd3;
  // two's complement over 64 bits: the high word is floor(x / 2^32), the low word what is left
  const hi = Math.floor(x / TWO_32);
  out.writeInt32BE(hi, at + 1);
  out.writeUInt32BE(x - hi * TWO_32, at + 5);
  return at + 9;
}

/** UTF-8 bytes of a validated string (no lone surrogates). */
function utf8Length(s: string): number {
  const n = s.length;
  if (n <= 64) {
    let i = 0;
    while (i < n && s.charCodeAt(i) < 0x80) i++;
    if (i === n) return n;
  }
  return Buffer.byteLength(s, "utf8");
}

const strHeaderSize = (n: number): number => (n < 32 ? 1 : n < 0x100 ? 2 : n < 0x1_0000 ? 3 : 5);
/** Bytes of the smallest bin header for `n` bytes of data. */
export const binHeaderSize = (n: number): number => (n < 0x100 ? 2 : n < 0x1_0000 ? 3 : 5);

/** The padding entry without padding bytes: its key (fixstr `_`) and a bin 8 header. */
export const PAD_ENTRY_BYTES = 2 + 2;
const PAD_ENTRY_HEAD = [0xa0 | PAD_KEY.length, PAD_KEY.charCodeAt(0), 0xc4];

/**
 * The padding bytes (0..7) of the entry that starts `at` bytes into a payload and is followed by
 * the main tensor's entry, key `key` (a fixstr) and `bytes` bytes of data: the number that puts
 * that data at a multiple of MAIN_TENSOR_ALIGN from the payload's first byte.
 */
export function padBytes(at: number, key: string, bytes: number): number {
  const dataAt = at + PAD_ENTRY_BYTES + 1 + key.length + binHeaderSize(bytes);
  return (MAIN_TENSOR_ALIGN - (dataAt % MAIN_TENSOR_ALIGN)) % MAIN_TENSOR_ALIGN;
}

/** Writes the padding entry of `pad` zero bytes at `at`; returns the offset after it. */
export function writePad(out: Uint8Array, at: number, pad: number): number {
  out[at] = PAD_ENTRY_HEAD[0]!;
  out[at + 1] = PAD_ENTRY_HEAD[1]!;
  out[at + 2] = PAD_ENTRY_HEAD[2]!;
  out[at + 3] = pad;
  out.fill(0, at + 4, at + 4 + pad);
  return at + 4 + pad;
}

function writeStr(out: Buffer, at: number, s: string, n: number): number {
  if (n < 32) out[at++] = 0xa0 | n;
  else if (n < 0x100) {
    out[at++] = 0xd9;
    out[at++] = n;
  } else if (n < 0x1_0000) {
    out[at] = 0xda;
    out.writeUInt16BE(n, at + 1);
    at += 3;
  } else {
    out[at] = 0xdb;
    out.writeUInt32BE(n, at + 1);
    at += 5;
  }
  if (n === s.length) {
    for (let i = 0; i < n; i++) out[at + i] = s.charCodeAt(i);
  } else out.write(s, at, n, "utf8");
  return at + n;
}

function writeBin(out: Buffer, at: number, tensor: Uint8Array): number {
  at = writeBinHeader(out, at, tensor.byteLength);
  out.set(tensor, at);
  return at + tensor.byteLength;
}

function writeBinHeader(out: Buffer, at: number, n: number): number {
  if (n < 0x100) {
    out[at++] = 0xc4;
    out[at++] = n;
  } else if (n < 0x1_0000) {
    out[at] = 0xc5;
    out.writeUInt16BE(n, at + 1);
    at += 3;
  } else {
    out[at] = 0xc6;
    out.writeUInt32BE(n, at + 1);
    at += 5;
  }
  return at;
}

/** Where `writeTensorFrame` places a frame. */
export interface FrameMemory {
  /** At least `bytes` writable bytes from offset 0 (contents unspecified). */
  alloc(bytes: number): Buffer;
}

export interface Written {
  /** The payload (after `reserve` zero bytes), a view of the memory `alloc` returned. */
  bytes: Uint8Array;
  /**
   * Offset in `bytes` of the main tensor's data (`x`, `y`): at a multiple of 8 from the payload's
   * first byte (the padding entry before it sees to that) and 8-byte aligned in memory.
   */
  mainAt: number;
  /** Offset in `bytes` of the hole's data (bytes left unwritten), or -1. */
  holeAt: number;
}

/**
 * Writes a validated frame with tensors, `reserve` zero bytes first, into `memory`;
 * `tooLarge` throws when the payload exceeds `max` (before anything is allocated). Every byte of
 * the returned view is written. `headroom` (a multiple of 8 up to MAX_HEADROOM) more padding
 * bytes go before the main tensor.
 */
export function writeTensorFrame(
  frame: Frame,
  reserve: number,
  max: number,
  memory: FrameMemory,
  tooLarge: (size: number, max: number) => Error,
  headroom = 0,
): Written {
  const o = frame as unknown as Record<string, unknown>;
  const layout = LAYOUTS.get(frame.t)!;
  const { keys, types, names, main } = layout;
  const count = names.length;
  // the padding entry and the main tensor are always there (the tensor is a required field)
  let entries = 3;
  let size = layout.head.length;
  let tensorAt = -1;
  for (let i = 0; i < count; i++) {
    const value = o[names[i]!];
    values[i] = value;
    if (value === undefined) continue;
    entries++;
    // the padding entry without its padding bytes, counted once the map header is known
    if (i === main) size += PAD_ENTRY_BYTES;
    size += keys[i]!.length;
    switch (types[i]) {
      case "uint":
      case "float":
        size += numberSize(value as number);
        break;
      case "bool":
        size += 1;
        break;
      case "str": {
        const n = utf8Length(value as string);
        lengths[i] = n;
        size += strHeaderSize(n) + n;
        break;
      }
      default: {
        const tensor = bytesOf(value as Float32Array | Uint16Array | Int32Array);
        tensors[i] = tensor;
        const n = tensor.byteLength;
        size += binHeaderSize(n);
        // (offset counted from after the map header and without padding bytes, corrected below)
        if (i === main) tensorAt = size;
        size += n;
      }
    }
  }
  const mapHeader = entries < 16 ? 1 : 3;
  const pad =
    ((MAIN_TENSOR_ALIGN - ((mapHeader + tensorAt) % MAIN_TENSOR_ALIGN)) % MAIN_TENSOR_ALIGN) + headroom;
  size += mapHeader + pad;
  tensorAt += mapHeader + pad;
  if (size > max) {
    tensors.fill(undefined);
    values.fill(undefined);
    throw tooLarge(size, max);
  }
  // shift the payload so that its first byte, and so the main tensor's data, lands 8-byte aligned
  // (buffers start so)
  const shift = (MAIN_TENSOR_ALIGN - (reserve % MAIN_TENSOR_ALIGN)) % MAIN_TENSOR_ALIGN;
  const out = memory.alloc(shift + reserve + size);
  // every byte after shift + reserve is written below; the ones before are not, and memory that
  // is not zero-filled (fresh or reused) would show old bytes there
  out.fill(0, 0, shift + reserve);
  let at = shift + reserve;
  let holeAt = -1;
  if (mapHeader === 1) out[at++] = 0x80 | entries;
  else {
    out[at] = 0xde;
    out.writeUInt16BE(entries, at + 1);
    at += 3;
  }
  const head = layout.head;
  for (let j = 0; j < head.length; j++) out[at + j] = head.charCodeAt(j);
  at += head.length;
  for (let i = 0; i < count; i++) {
    const value = values[i];
    if (value === undefined) continue;
    // no reference to the caller's values outlives the call
    values[i] = undefined;
    if (i === main) at = writePad(out, at, pad);
    const key = keys[i]!;
    for (let j = 0; j < key.length; j++) out[at + j] = key.charCodeAt(j);
    at += key.length;
    switch (types[i]) {
      case "uint":
      case "float":
        at = writeNumber(out, at, value as number);
        break;
      case "bool":
        out[at++] = value === true ? 0xc3 : 0xc2;
        break;
      case "str":
        at = writeStr(out, at, value as string, lengths[i]!);
        break;
      default:
        if (tensors[i]!.buffer === holeBuffer) {
          at = writeBinHeader(out, at, tensors[i]!.byteLength);
          holeAt = at - shift;
          at += tensors[i]!.byteLength;
        } else at = writeBin(out, at, tensors[i]!);
        // no reference to the caller's tensor outlives the call
        tensors[i] = undefined;
    }
  }
  return {
    bytes: new Uint8Array(out.buffer, out.byteOffset + shift, reserve + size),
    mainAt: reserve + tensorAt,
    holeAt,
  };
}

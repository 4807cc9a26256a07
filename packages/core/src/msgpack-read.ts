import { ProtocolError } from "./errors.js";

// A strict, allocation-free msgpack reader for untrusted frames. It accepts exactly the plain
// msgpack types (nil, bool, int, float, str, bin, array, map) and rejects extension types and the
// reserved byte 0xc1, so that what decodes here decodes the same in any msgpack library. It reads
// headers and skips values without materialising them: a frame's unknown keys cost no memory,
// and every declared length is checked against the bytes that are actually there before anyone
// allocates for it.

/** msgpack type families (the spec's "types"; encodings of one family are interchangeable). */
export const Kind = {
  nil: 0,
  bool: 1,
  int: 2,
  float: 3,
  str: 4,
  bin: 5,
  array: 6,
  map: 7,
} as const;
export type Kind = (typeof Kind)[keyof typeof Kind];

export const KIND_NAMES: readonly string[] = ["nil", "bool", "int", "float", "str", "bin", "array", "map"];

/** Deepest nesting of arrays/maps a frame may contain anywhere (a frame itself is depth 1). */
export const MAX_DEPTH = 16;

function u16(b: Uint8Array, p: number): number {
  return (b[p]! << 8) | b[p + 1]!;
}

function u32(b: Uint8Array, p: number): number {
  return ((b[p]! << 24) | (b[p + 1]! << 16) | (b[p + 2]! << 8) | b[p + 3]!) >>> 0;
}

function float(b: Uint8Array, p: number, size: 4 | 8): number {
  for (let i = 0; i < size; i++) scratch.setUint8(i, b[p + i]!);
  return size === 4 ? scratch.getFloat32(0) : scratch.getFloat64(0);
}

function malformed(message: string, offset: number): never {
  throw new ProtocolError(message, { details: { offset } });
}

/**
 * A cursor over msgpack bytes. `head()` reads one value header at `pos` and leaves what it found
 * in `kind` and `num`: the value for nil/bool/int/float (bool as 0/1), the byte length for
 * str/bin (with `pos` at the first data byte), the element or pair count for array/map.
 */
// floats are read through one shared scratch buffer: a DataView per frame costs more than the frame
const scratch = new DataView(new ArrayBuffer(8));

export class MsgpackReader {
  readonly bytes: Uint8Array;
  readonly end: number;
  pos = 0;
  kind: Kind = Kind.nil;
  num = 0;
  /** For kind int: false when the value is outside the safe-integer range (then `num` is rounded). */
  exact = true;

  constructor(bytes: Uint8Array) {
    this.bytes = bytes;
    this.end = bytes.byteLength;
  }

  private need(n: number, what: string): void {
    if (n > this.end - this.pos) {
      malformed(
        `msgpack ${what} at offset ${this.pos} needs ${n} bytes but only ${this.end - this.pos} remain`,
        this.pos,
      );
    }
  }

  // biome-ignore lint/complexity/noExcessiveLinesPerFunction: the one-byte type switch runs once per decoded value; split into helpers it would cost a call per value on the decoder's hot path, and each case is a few lines of the msgpack spec's table.
  head(): Kind {
    const start = this.pos;
    this.need(1, "value");
    const bytes = this.bytes;
    const b = bytes[this.pos++]!;
    this.exact = true;
    if (b <= 0x7f) return this.set(Kind.int, b);
    if (b >= 0xe0) return this.set(Kind.int, b - 0x100);
    if (b <= 0x8f) return this.set(Kind.map, b & 0x0f);
    if (b <= 0x9f) return this.set(Kind.array, b & 0x0f);
    if (b <= 0xbf) return this.data(Kind.str, b & 0x1f, start);
    let n: number;
    switch (b) {
      case 0xc0:
        return this.set(Kind.nil, 0);
      case 0xc2:
        return this.set(Kind.bool, 0);
      case 0xc3:
        return this.set(Kind.bool, 1);
      case 0xc4:
      case 0xd9:
        this.need(1, "length");
        n = bytes[this.pos]!;
        this.pos += 1;
        return this.data(b === 0xc4 ? Kind.bin : Kind.str, n, start);
      case 0xc5:
      case 0xda:
        this.need(2, "length");
        n = u16(bytes, this.pos);
        this.pos += 2;
        return this.data(b === 0xc5 ? Kind.bin : Kind.str, n, start);
      case 0xc6:
      case 0xdb:
        this.need(4, "length");
        n = u32(bytes, this.pos);
        this.pos += 4;
        return this.data(b === 0xc6 ? Kind.bin : Kind.str, n, start);
      case 0xca:
        this.need(4, "float32");
        n = float(bytes, this.pos, 4);
        this.pos += 4;
        return this.set(Kind.float, n);
      case 0xcb:
        this.need(8, "float64");
        n = float(bytes, this.pos, 8);
        this.pos += 8;
        return this.set(Kind.float, n);
      case 0xcc:
        this.need(1, "uint8");
        return this.set(Kind.int, bytes[this.pos++]!);
      case 0xcd:
        this.need(2, "uint16");
        n = u16(bytes, this.pos);
        this.pos += 2;
        return this.set(Kind.int, n);
      case 0xce:
        this.need(4, "uint32");
        n = u32(bytes, this.pos);
        this.pos += 4;
        return this.set(Kind.int, n);
      case 0xcf: {
        this.need(8, "uint64");
        const hi = u32(bytes, this.pos);
        n = hi * 0x1_0000_0000 + u32(bytes, this.pos + 4);
        this.pos += 8;
        this.set(Kind.int, n);
        this.exact = hi < 0x20_0000;
        return Kind.int;
      }
      case 0xd0:
        this.need(1, "int8");
        n = (bytes[this.pos]! << 24) >> 24;
        this.pos += 1;
        return this.set(Kind.int, n);
      case 0xd1:
        this.need(2, "int16");
        n = (u16(bytes, this.pos) << 16) >> 16;
        this.pos += 2;
        return this.set(Kind.int, n);
      case 0xd2:
        this.need(4, "int32");
        n = u32(bytes, this.pos) | 0;
        this.pos += 4;
        return this.set(Kind.int, n);
      case 0xd3: {
        this.need(8, "int64");
        const hi = u32(bytes, this.pos) | 0;
        n = hi * 0x1_0000_0000 + u32(bytes, this.pos + 4);
        this.pos += 8;
        this.set(Kind.int, n);
        this.exact = hi < 0x20_0000 && hi >= -0x20_0000;
        return Kind.int;
      }
      case 0xdc:
        this.need(2, "array16 count");
        n = u16(bytes, this.pos);
        this.pos += 2;
        return this.set(Kind.array, n);
      case 0xdd:
        this.need(4, "array32 count");
        n = u32(bytes, this.pos);
        this.pos += 4;
        return this.set(Kind.array, n);
      case 0xde:
        this.need(2, "map16 count");
        n = u16(bytes, this.pos);
        this.pos += 2;
        return this.set(Kind.map, n);
      case 0xdf:
        this.need(4, "map32 count");
        n = u32(bytes, this.pos);
        this.pos += 4;
        return this.set(Kind.map, n);
      case 0xc1:
        return malformed(`msgpack byte 0xc1 (never used) at offset ${start}`, start);
      default:
        // 0xc7-0xc9 and 0xd4-0xd8: extension types are not part of the protocol
        return malformed(
          `msgpack extension type (0x${b.toString(16)}) at offset ${start}: frames are plain msgpack`,
          start,
        );
    }
  }

  private set(kind: Kind, num: number): Kind {
    this.kind = kind;
    this.num = num;
    return kind;
  }

  private data(kind: Kind, length: number, start: number): Kind {
    if (length > this.end - this.pos) {
      malformed(
        `msgpack ${kind === Kind.bin ? "bin" : "str"} at offset ${start} declares ${length} bytes but only ${this.end - this.pos} remain`,
        start,
      );
    }
    this.kind = kind;
    this.num = length;
    return kind;
  }

  /** Skips one whole value (checking that it is well-formed) and returns the offset after it. */
  skip(depth = 1): number {
    const kind = this.head();
    if (kind === Kind.str || kind === Kind.bin) {
      this.pos += this.num;
    } else if (kind === Kind.array || kind === Kind.map) {
      if (depth > MAX_DEPTH) {
        malformed(`msgpack values nested deeper than ${MAX_DEPTH} at offset ${this.pos}`, this.pos);
      }
      // every element takes at least one byte, so a count larger than what remains is truncated
      const items = kind === Kind.map ? this.num * 2 : this.num;
      if (items > this.end - this.pos) {
        malformed(
          `msgpack ${kind === Kind.map ? "map" : "array"} declares ${this.num} entries but only ${this.end - this.pos} bytes remain`,
          this.pos,
        );
      }
      if (kind === Kind.array) {
        for (let i = 0; i < items; i++) this.skip(depth + 1);
      } else {
        for (let i = 0; i < items; i += 2) {
          const at = this.pos;
          if (this.head() !== Kind.str) malformed(`map key at offset ${at} is not a string`, at);
          this.pos += this.num;
          this.skip(depth + 1);
        }
      }
    }
    return this.pos;
  }
}

const utf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/**
 * Decodes `length` bytes at `pos` as UTF-8 (strictly: invalid sequences return undefined rather
 * than being replaced, and a leading BOM is kept, so decoding and re-encoding is byte-exact).
 */
export function readUtf8(bytes: Uint8Array, pos: number, length: number): string | undefined {
  if (length <= 32) {
    // short ASCII strings (keys, enums, ids) skip the TextDecoder call
    let out = "";
    for (let i = pos; i < pos + length; i++) {
      const c = bytes[i]!;
      if (c >= 0x80) {
        out = "";
        break;
      }
      out += String.fromCharCode(c);
    }
    if (out.length === length) return out;
  }
  try {
    return utf8.decode(bytes.subarray(pos, pos + length));
  } catch {
    return undefined;
  }
}

/**
 * Where the data of the first large `bin` (at least `minBytes`) of a frame starts, from the
 * frame's first bytes (`head`, possibly incomplete); -1 if `head` does not reach it. Used to place
 * a frame in memory so that its main tensor is aligned and decodes without a copy.
 */
export function firstLargeBinOffset(head: Uint8Array, minBytes = 64): number {
  const r = new MsgpackReader(head);
  try {
    if (r.head() !== Kind.map) return -1;
    const count = r.num;
    for (let i = 0; i < count; i++) {
      r.skip();
      // the bin's data need not be in `head`: read its header by hand
      const b = head[r.pos];
      const size = b === 0xc4 ? 1 : b === 0xc5 ? 2 : b === 0xc6 ? 4 : 0;
      if (size > 0) {
        if (r.pos + 1 + size > head.byteLength) return -1;
        let length = 0;
        for (let j = 1; j <= size; j++) length = length * 256 + head[r.pos + j]!;
        if (length >= minBytes) return r.pos + 1 + size;
      }
      r.pos = skipRest(r, r.head());
    }
  } catch {
    // incomplete or malformed: the decoder will say which
  }
  return -1;
}

/** Finishes skipping a value whose header `head()` has just read. */
function skipRest(r: MsgpackReader, kind: Kind): number {
  if (kind === Kind.str || kind === Kind.bin) return r.pos + r.num;
  if (kind === Kind.array || kind === Kind.map) {
    const items = kind === Kind.map ? r.num * 2 : r.num;
    for (let i = 0; i < items; i++) r.skip(2);
  }
  return r.pos;
}

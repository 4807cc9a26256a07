import { Packr, RESERVE_START_SPACE } from "msgpackr/index-no-eval";
import { checkHeadroom, checkMaxFrameBytes } from "./codec-checks.js";
import { validateFrame } from "./codec-validate.js";
import { holeOf, TENSOR_FRAME_TYPES, writeNumber, writeTensorFrame } from "./codec-write.js";
import { InvalidArgumentError, ProtocolError } from "./errors.js";
import {
  CAPS_FIELDS,
  type FieldRule,
  type FieldSpec,
  FRAME_FIELDS,
  type Frame,
  type FrameType,
  PROTOCOL_VERSION,
  type ResultFrame,
} from "./frames.js";
import { MsgpackReader } from "./msgpack-read.js";
import { Slab } from "./slab.js";
import { bytesOf } from "./tensor.js";

// ---- encoding -------------------------------------------------------------------------------

const packr = new Packr({
  useRecords: false,
  useFloat32: 0,
  variableMapSize: true,
  moreTypes: false,
  structuredClone: false,
  bundleStrings: false,
  useTimestamp32: false,
  encodeUndefinedAsNil: false,
});

// Frames without tensors are packed straight into a slab of our own rather than into msgpackr's
// working buffer, which msgpackr reuses: the bytes returned are the caller's. msgpackr starts a
// new buffer when fewer than 2 KiB remain at its position, so the room handed to it includes that.
const slab = new Slab();

/** Where an encoding is written: `room`/`take` for msgpackr's packing, `alloc` for assembly. */
interface Memory {
  /** A view of at least `bytes` writable bytes (contents unspecified), not yet taken. */
  room(bytes: number): Buffer;
  /** Takes `bytes` bytes at the start of the view `room` returned. */
  take(bytes: number): void;
  /**
   * At least `bytes` writable bytes from offset 0 (contents unspecified; the caller fills the
   * first `bytes` completely and writes nothing beyond them).
   */
  alloc(bytes: number): Buffer;
}

/** The memory of `encodeFrame`: each frame's bytes are its caller's for good. */
const FRESH: Memory = {
  room: (bytes) => slab.room(bytes),
  take: (bytes) => slab.take(bytes),
  alloc: (bytes) => (bytes > OWN_MEMORY_BYTES ? Buffer.allocUnsafeSlow(bytes) : slab.alloc(bytes)),
};

const PACKR_HEADROOM = 0x800 + 16;
// Handed to msgpackr after each pack so that it never writes into the slab on its own: with less
// than 2 KiB of room, its next pack starts a new buffer instead.
const DETACHED = Buffer.alloc(16);
const TWO_32 = 0x1_0000_0000;
// Frames with tensors are written by codec-write.ts, each tensor copied once into memory of
// exactly the payload's size. Above this size a frame gets memory of its own, not zero-filled
// since every byte of it is written.
const OWN_MEMORY_BYTES = 64 * 1024;

interface Wire {
  /** Upper bound on the packed size (including msgpackr's worst-case string estimate). */
  bound: number;
  /** A value was handed over as BigInt and its int64 header may need to become uint64. */
  bigint: boolean;
}

/** A number as msgpackr must receive it to emit the canonical encoding. */
function wireNumber(x: number, w: Wire): number | bigint {
  // msgpackr writes the smallest int for values in [-2^31, 2^32) and float64 for any other
  // number: the other safe integers go as BigInt (int64, turned into uint64 if >= 0)
  if (Number.isSafeInteger(x) && (x < -0x8000_0000 || x >= TWO_32)) {
    w.bigint = true;
    return BigInt(x);
  }
  return x;
}

function wireValue(value: unknown, rule: FieldRule, w: Wire): unknown {
  switch (rule.type) {
    case "uint":
    case "float":
      w.bound += 9;
      return wireNumber(value as number, w);
    case "bool":
      w.bound += 1;
      return value;
    case "str":
      w.bound += 5 + 3 * (value as string).length;
      return value;
    case "bin": {
      const bytes = bytesOf(value as Float32Array | Uint16Array | Int32Array);
      w.bound += 5 + bytes.byteLength;
      return bytes;
    }
    case "uints":
      w.bound += 5 + 9 * (value as number[]).length;
      return [...(value as number[])];
    case "strs":
      w.bound += 5;
      for (const s of value as string[]) w.bound += 5 + 3 * s.length;
      return [...(value as string[])];
    case "caps": {
      const caps = value as Record<string, unknown>;
      const out: Record<string, unknown> = {};
      w.bound += 5;
      for (const spec of CAPS_FIELDS) {
        if (caps[spec.key] === undefined) continue;
        w.bound += 1 + spec.key.length;
        out[spec.key] = wireValue(caps[spec.key], spec.rule, w);
      }
      return out;
    }
  }
}

function tooLarge(size: number, max: number): ProtocolError {
  return new ProtocolError(
    "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
    `frame takes ${size} bytes, more than the maximum of ${max}`,
    { details: { size, max } },
  );
}

/** Packs a validated frame without tensors, leaving `reserve` (< 256) bytes free at the start. */
function pack(frame: Frame, reserve: number, max: number, memory: Memory): Uint8Array {
  const o = frame as unknown as Record<string, unknown>;
  const value: Record<string, unknown> = { t: o.t, v: PROTOCOL_VERSION };
  const w: Wire = { bound: 16 + 12, bigint: false };
  for (const spec of FRAME_FIELDS[frame.t]) {
    if (o[spec.key] === undefined) continue;
    w.bound += 1 + spec.key.length;
    value[spec.key] = wireValue(o[spec.key], spec.rule, w);
  }
  const room = memory.room(w.bound + reserve + PACKR_HEADROOM);
  packr.useBuffer(room);
  let packed: Uint8Array;
  try {
    packed = packr.pack(value, reserve > 0 ? RESERVE_START_SPACE | reserve : 0);
  } finally {
    packr.useBuffer(DETACHED);
  }
  // (had msgpackr needed more room than the bound, it would have packed into a buffer of its own)
  if (packed.buffer === room.buffer) memory.take(packed.byteLength);
  if (packed.byteLength - reserve > max) throw tooLarge(packed.byteLength - reserve, max);
  // msgpackr skips the reserved bytes without writing them: reused memory holds an older frame there
  packed.fill(0, 0, reserve);
  if (w.bigint) uint64Headers(packed, reserve);
  // a plain Uint8Array, as callers expect (a Buffer's `slice` would not copy)
  return new Uint8Array(packed.buffer, packed.byteOffset, packed.byteLength);
}

/** Rewrites the int64 header (0xd3) of a map's non-negative values to uint64 (0xcf). */
function uint64Headers(bytes: Uint8Array, start: number): void {
  const r = new MsgpackReader(bytes);
  r.pos = start;
  r.head();
  const count = r.num;
  for (let i = 0; i < count; i++) {
    r.skip();
    const at = r.pos;
    if (bytes[at] === 0xd3 && bytes[at + 1]! < 0x80) bytes[at] = 0xcf;
    r.skip();
  }
}

/**
 * A result's `y` that is not an array of its own: `fill` writes its `values` floats straight into
 * the frame's memory while the frame is encoded, which saves the copy of `y` into the frame. The
 * view `fill` gets is lent: it must write every value (the memory may hold an older frame) and
 * keep no reference to it once it returns. An exception from `fill` fails the encoding.
 *
 * A fill may compute the answer: when the frame has no `ms`, a number `fill` returns becomes the
 * frame's `ms` (the compute's time, known only once it ran; `ms` follows `y` on the wire, so it is
 * written after the fill). The bytes are the same as those of the frame with that `ms` and an
 * array `y`; without a number returned, those of the frame without `ms`.
 */
export interface InPlaceTensor {
  readonly values: number;
  fill(y: Float32Array): unknown;
}

/** A result frame whose `y` is written in place (see InPlaceTensor). */
export type ResultInPlace = Omit<ResultFrame, "y"> & { y: InPlaceTensor };

/** What the encoders take: a frame, or a result whose `y` is written in place. */
export type EncodableFrame = Frame | ResultInPlace;

export interface EncodeOptions {
  /** Largest payload to produce, in bytes (default 64 MiB); larger frames throw FRAME_TOO_LARGE. */
  maxFrameBytes?: number;
  /**
   * More padding bytes before a dispatch's or result's main tensor (default 0; a multiple of 8 up
   * to 248): room for a relay to write its routing fields in place (`relayHeadroom` says how much
   * a peer needs). Decoders skip padding, whatever its length.
   */
  headroom?: number;
}

/**
 * Encodes a frame as its canonical msgpack payload (see docs/protocol.md). The frame is
 * validated first (`validateFrame`); keys other than the frame type's fields are not sent. The
 * result is a view into a larger buffer shared with other frames (as Node's Buffer pool does):
 * write the view itself, never its `.buffer`.
 */
export function encodeFrame(frame: EncodableFrame, options: EncodeOptions = {}): Uint8Array {
  return encodeInto(
    frame,
    0,
    checkMaxFrameBytes(options.maxFrameBytes),
    FRESH,
    checkHeadroom(options.headroom),
  );
}

/** Encodes a frame with 4 bytes reserved at the start (for a length prefix); internal to framing. */
export function encodeFrameWithPrefixSpace(frame: Frame, options: EncodeOptions = {}): Uint8Array {
  return encodeInto(frame, 4, checkMaxFrameBytes(options.maxFrameBytes), FRESH);
}

function encodeInto(
  frame: EncodableFrame,
  reserve: number,
  max: number,
  memory: Memory,
  headroom = 0,
): Uint8Array {
  if (frame.t === "result" && isInPlace(frame.y))
    return encodeInPlace(frame as ResultInPlace, reserve, max, memory, headroom);
  validateFrame(frame as Frame);
  return TENSOR_FRAME_TYPES.has(frame.t)
    ? writeTensorFrame(frame as Frame, reserve, max, memory, tooLarge, headroom).bytes
    : pack(frame as Frame, reserve, max, memory);
}

/** An object with a `fill` method that is not a typed array (they have `fill` too). */
const isInPlace = (y: unknown): boolean =>
  typeof y === "object" &&
  y !== null &&
  !ArrayBuffer.isView(y) &&
  typeof (y as InPlaceTensor).fill === "function";

function encodeInPlace(
  frame: ResultInPlace,
  reserve: number,
  max: number,
  memory: Memory,
  headroom: number,
): Uint8Array {
  const tensor = frame.y;
  if (!Number.isSafeInteger(tensor.values) || tensor.values < 0) {
    throw new InvalidArgumentError(`result.y.values must be an integer >= 0, got ${String(tensor.values)}`);
  }
  // checked and written as the frame with a y of that length; the writer leaves y's bytes open
  // (and, without an `ms`, holds the most an ms takes for the one fill may return)
  const timed = frame.ms === undefined;
  const stand: ResultFrame = { ...frame, y: holeOf(tensor.values), ...(timed ? { ms: MS_HELD } : {}) };
  validateFrame(stand);
  const written = writeTensorFrame(stand, reserve, max, memory, tooLarge, headroom);
  const { bytes, holeAt } = written;
  const ms = tensor.fill(new Float32Array(bytes.buffer, bytes.byteOffset + holeAt, tensor.values));
  return timed ? writeHeldMs(bytes, reserve, holeAt + tensor.values * 4, ms) : bytes;
}

/** A stand-in ms written as a float64: the 9 bytes the largest canonical number takes. */
const MS_HELD = 0.5;
/** The entry `ms` (its fixstr key, 3 bytes, and a float64) as the stand-in writes it. */
const MS_ENTRY_BYTES = 3 + 9;

/**
 * The `ms` a fill returned, written over the stand-in entry at `at` (right after y) in its
 * canonical form, the entries after it moved up and the frame shortened to fit; without a number,
 * the entry is taken out (one entry fewer in the fixmap header: a result has fewer than 16).
 */
function writeHeldMs(bytes: Uint8Array, reserve: number, at: number, ms: unknown): Uint8Array {
  const tail = at + MS_ENTRY_BYTES;
  let end = at;
  if (typeof ms === "number") {
    if (!Number.isFinite(ms) || ms < 0) {
      throw new InvalidArgumentError(`result.ms must be a finite number >= 0, got ${String(ms)}`);
    }
    end = writeNumber(Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength), at + 3, ms);
  } else {
    bytes[reserve] = (bytes[reserve] as number) - 1;
  }
  if (end === tail) return bytes;
  bytes.copyWithin(end, tail);
  return bytes.subarray(0, bytes.byteLength - (tail - end));
}

/** One buffer, kept and grown, written from its start by each encoding. */
class ReusedMemory implements Memory {
  // zero-filled when (re)allocated: no stale process memory is ever reachable through it
  #buffer = Buffer.alloc(0);

  room(bytes: number): Buffer {
    if (this.#buffer.byteLength < bytes) {
      // a little slack for frames that grow by a token or two, without doubling a 64 MiB frame
      this.#buffer = Buffer.alloc(Math.max(4096, bytes + (bytes >> 3)));
    }
    return this.#buffer;
  }

  take(): void {}

  // the whole buffer, not a `subarray` of it: packTensors writes only its first `bytes` bytes and
  // builds its view from offsets, and a Buffer view per frame is a measurable part of a small frame
  alloc(bytes: number): Buffer {
    return this.room(bytes);
  }
}

/**
 * Encodes frames into memory it owns and reuses, for a sender that is done with the bytes once it
 * has written them (relay-client keeps a few encoders and lends each until its socket has written
 * the frame). Writing into memory already in use is about four times faster than writing into
 * fresh memory, which is most of what `encodeFrame` costs for frames with tensors.
 *
 * The bytes are lent, never given: `encode(frame, use)` calls `use` with them and takes them back
 * when `use` returns (or throws). Keep nothing that refers to them (not the view, not its
 * `.buffer`, not a frame `decodeFrame` made of them: its tensors are views); to keep a frame,
 * copy it or use `encodeFrame`. The encoder keeps the memory of its largest frame so far. An
 * `encode` called from inside `use` (a nested send) gets memory of its own, so the bytes `use`
 * holds are never overwritten while it runs. The bytes are exactly `encodeFrame`'s; the view's
 * `.buffer` may hold older frames beyond it: write the view itself, never its `.buffer`.
 */
export class FrameEncoder {
  readonly #max: number;
  readonly #headroom: number;
  readonly #memory = new ReusedMemory();
  #lent = false;

  /** `maxFrameBytes` applies to every frame it encodes, as with `encodeFrame`. */
  constructor(options: EncodeOptions = {}) {
    this.#max = checkMaxFrameBytes(options.maxFrameBytes);
    this.#headroom = checkHeadroom(options.headroom);
  }

  /**
   * Encodes `frame` (validating it) and calls `use` with its bytes; returns what `use` returns. A
   * result's in-place `y` is filled in this memory too (an encode from inside `fill` gets memory
   * of its own, as one from inside `use` does).
   */
  encode<T>(frame: EncodableFrame, use: (bytes: Uint8Array) => T): T {
    if (this.#lent) return use(encodeInto(frame, 0, this.#max, FRESH, this.#headroom));
    this.#lent = true;
    try {
      return use(encodeInto(frame, 0, this.#max, this.#memory, this.#headroom));
    } finally {
      this.#lent = false;
    }
  }
}

/** `spec` rows for docs and tests: the canonical field order of each frame type, with `t` and `v`. */
export function canonicalKeys(t: FrameType): string[] {
  return ["t", "v", ...FRAME_FIELDS[t].map((s: FieldSpec) => s.key)];
}

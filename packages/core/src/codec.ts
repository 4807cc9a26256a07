import { Packr, RESERVE_START_SPACE } from "msgpackr/index-no-eval";
import type { CodeOf } from "./errors.js";
import { InvalidArgumentError, ProtocolError } from "./errors.js";
import {
  CAPS_FIELDS,
  DEFAULT_MAX_FRAME_BYTES,
  type FieldRule,
  type FieldSpec,
  FRAME_FIELDS,
  type Frame,
  type FrameType,
  isFrameType,
  PROTOCOL_VERSION,
} from "./frames.js";
import { KIND_NAMES, Kind, MsgpackReader, readUtf8 } from "./msgpack-read.js";
import { Slab } from "./slab.js";
import { bytesOf, typedArrayFromBytes } from "./tensor.js";

// Encoding goes through msgpackr (its no-eval build: no `new Function`, no native addon loaded at
// import, module state of its own), configured so that it emits plain msgpack in the canonical form
// of docs/protocol.md (verified byte for byte by the tests): no records (`useRecords: false`, which
// also makes 0x40-0x7f positive fixints), no float32 (`useFloat32: 0`), the smallest map header
// (`variableMapSize`), no bundled strings or structured clone. msgpackr writes the smallest int
// for values in [-2^31, 2^32) and float64 for any other number, so the other safe integers are
// handed to it as BigInt (int64) and the header of a non-negative one is then turned into uint64.
//
// Decoding does not use msgpackr: its unpacker also accepts msgpackr's own extensions (a record
// definition changes what later bytes 0x40-0x7f mean; other ext types build Sets, Errors,
// RegExps, typed arrays), materialises every value of the map, unknown keys included, before a
// caller could check it, and returns float64 1.0 and uint 1 alike. The strict reader in
// msgpack-read.ts checks each declared length against the bytes present, skips unknown keys
// without allocating, and keeps msgpack's type families apart.

type ProtocolCode = CodeOf<"ProtocolError">;

export interface DecodeOptions {
  /** Largest accepted payload in bytes (default 64 MiB). */
  maxFrameBytes?: number;
  /** Expert ids (dispatch `ids`, register `experts`) must be below this. */
  maxExpert?: number;
  /**
   * Copy tensor data out of the input (default false: tensors are views over the input when
   * its alignment allows, so the input must not be reused while the frame is in use).
   */
  copy?: boolean;
}

/**
 * Where a check runs and how it fails: `decodeFrame` throws ProtocolError (with the frame type,
 * the field and, once read, the request id), the encoder InvalidArgumentError.
 */
class Checker {
  type: string;
  id: number | undefined = undefined;
  readonly encoding: boolean;

  constructor(type: string, encoding: boolean) {
    this.type = type;
    this.encoding = encoding;
  }

  fail(code: ProtocolCode, field: string, message: string): never {
    const text = `${this.type}${field ? `.${field}` : ""}: ${message}`;
    if (this.encoding) {
      throw new InvalidArgumentError(text, {
        details: { type: this.type, field, protocolCode: code },
      });
    }
    const details: Record<string, unknown> = { type: this.type, field };
    if (this.id !== undefined) details.id = this.id;
    throw new ProtocolError(code, text, { details });
  }

  bad(field: string, message: string): never {
    return this.fail("MOESWARM_PROTOCOL_BAD_FIELD", field, message);
  }
}

function checkMaxFrameBytes(value: number | undefined): number {
  if (value === undefined) return DEFAULT_MAX_FRAME_BYTES;
  if (!Number.isSafeInteger(value) || value < 1 || value > 0xffff_ffff) {
    throw new InvalidArgumentError(`maxFrameBytes must be an integer in 1..2^32-1, got ${String(value)}`);
  }
  return value;
}

function checkMaxExpert(value: number | undefined): number | undefined {
  if (value === undefined) return undefined;
  if (!Number.isSafeInteger(value) || value < 1 || value > 0x8000_0000) {
    throw new InvalidArgumentError(`maxExpert must be an integer in 1..2^31, got ${String(value)}`);
  }
  return value;
}

const KNOWN_KEYS: ReadonlySet<string> = new Set([
  "t",
  "v",
  ...Object.values(FRAME_FIELDS).flatMap((specs) => specs.map((s) => s.key)),
]);
const CAPS_KEYS: ReadonlySet<string> = new Set(CAPS_FIELDS.map((s) => s.key));

// Keys are matched by their bytes (all known keys are ASCII), without building strings.
const KEYS_BY_LENGTH: Array<Array<[string, Uint8Array]>> = [];
for (const key of new Set([...KNOWN_KEYS, ...CAPS_KEYS])) {
  const bucket = KEYS_BY_LENGTH[key.length] ?? [];
  bucket.push([key, Uint8Array.from(key, (c) => c.charCodeAt(0))]);
  KEYS_BY_LENGTH[key.length] = bucket;
}

function lookupKey(bytes: Uint8Array, pos: number, length: number): string | undefined {
  const candidates = KEYS_BY_LENGTH[length];
  if (candidates === undefined) return undefined;
  next: for (const [key, kb] of candidates) {
    for (let i = 0; i < length; i++) if (bytes[pos + i] !== kb[i]) continue next;
    return key;
  }
  return undefined;
}

const byteLength = (s: string): number => Buffer.byteLength(s, "utf8");
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

function describeKind(kind: Kind, r: MsgpackReader): string {
  if (kind === Kind.int && !r.exact) return "an integer beyond 2^53";
  return KIND_NAMES[kind] ?? "?";
}

// ---- decoding -------------------------------------------------------------------------------

/**
 * Decodes and validates one frame payload (the msgpack bytes, without a length prefix). Any
 * malformed or invalid input throws a ProtocolError whose code says what is wrong
 * (`MOESWARM_PROTOCOL_*`) and whose `details` name the frame type, the field and, once read, the
 * request id. Tensor fields are typed-array views over `bytes` when aligned, else copies.
 */
export function decodeFrame(bytes: Uint8Array, options: DecodeOptions = {}): Frame {
  const maxFrameBytes = checkMaxFrameBytes(options.maxFrameBytes);
  const maxExpert = checkMaxExpert(options.maxExpert);
  if (!(bytes instanceof Uint8Array)) {
    throw new InvalidArgumentError("decodeFrame needs a Uint8Array");
  }
  if (bytes.byteLength > maxFrameBytes) {
    throw new ProtocolError(
      "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
      `frame of ${bytes.byteLength} bytes exceeds the maximum of ${maxFrameBytes}`,
      { details: { size: bytes.byteLength, max: maxFrameBytes } },
    );
  }
  const r = new MsgpackReader(bytes);
  const top = r.head();
  if (top !== Kind.map) {
    throw new ProtocolError(`a frame is a msgpack map, found ${describeKind(top, r)}`, {
      details: { offset: 0 },
    });
  }
  const fields = indexMap(r, r.num, KNOWN_KEYS);
  if (r.pos !== r.end) {
    throw new ProtocolError(`${r.end - r.pos} bytes after the end of the frame's map`, {
      details: { offset: r.pos },
    });
  }

  const ctx: Checker = new Checker("frame", false);
  const tPos = fields.get("t");
  if (tPos === undefined) ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", "t", "the frame type `t` is missing");
  r.pos = tPos;
  const tKind = r.head();
  if (tKind !== Kind.str)
    ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "t", `must be a string, found ${describeKind(tKind, r)}`);
  // a type name longer than any known one is unknown; it is not decoded
  const t = r.num <= 16 ? readUtf8(r.bytes, r.pos, r.num) : undefined;
  const vPos = fields.get("v");
  if (vPos === undefined)
    ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", "v", "the protocol version `v` is missing");
  r.pos = vPos;
  const vKind = r.head();
  if (vKind !== Kind.int) {
    ctx.fail(
      "MOESWARM_PROTOCOL_BAD_FIELD",
      "v",
      `must be an unsigned integer, found ${describeKind(vKind, r)}`,
    );
  }
  if (r.num !== PROTOCOL_VERSION) {
    throw new ProtocolError(
      "MOESWARM_PROTOCOL_VERSION",
      `protocol version ${r.exact ? r.num : "beyond 2^53"} is not supported (this peer speaks ${PROTOCOL_VERSION})`,
      { details: { version: r.exact ? r.num : null, supported: [PROTOCOL_VERSION] } },
    );
  }
  if (!isFrameType(t)) {
    throw new ProtocolError(
      "MOESWARM_PROTOCOL_UNKNOWN_TYPE",
      `unknown frame type ${t === undefined ? "(a long or non-UTF-8 string)" : JSON.stringify(t)}`,
      { details: { type: t ?? null } },
    );
  }
  ctx.type = t;

  const out: Record<string, unknown> = { t, v: PROTOCOL_VERSION };
  for (const spec of FRAME_FIELDS[t]) {
    const pos = fields.get(spec.key);
    if (pos === undefined) {
      if (spec.required) ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", spec.key, "required field is missing");
      continue;
    }
    const value = readField(r, pos, spec.rule, spec.key, ctx, maxExpert);
    out[spec.key] = value;
    if (spec.key === "id") ctx.id = value as number;
  }
  decodeTensors(t, out, ctx, options.copy === true);
  checkCrossFields(t, out, ctx, maxExpert);
  return out as unknown as Frame;
}

/**
 * Walks `count` map entries at the reader's position and returns the offsets of the values of
 * known keys. Every value (known or not) is checked for well-formedness while skipping.
 */
function indexMap(r: MsgpackReader, count: number, known: ReadonlySet<string>): Map<string, number> {
  if (count * 2 > r.end - r.pos) {
    throw new ProtocolError(`msgpack map declares ${count} entries but only ${r.end - r.pos} bytes remain`, {
      details: { offset: r.pos },
    });
  }
  const fields = new Map<string, number>();
  for (let i = 0; i < count; i++) {
    const keyOffset = r.pos;
    const kind = r.head();
    if (kind !== Kind.str) {
      throw new ProtocolError(
        `map keys must be strings, found ${describeKind(kind, r)} at offset ${keyOffset}`,
        { details: { offset: keyOffset } },
      );
    }
    const length = r.num;
    const keyStart = r.pos;
    r.pos += length;
    const key = lookupKey(r.bytes, keyStart, length);
    const valueOffset = r.pos;
    r.skip(2);
    if (key !== undefined && known.has(key)) {
      if (fields.has(key)) {
        throw new ProtocolError(`duplicate key ${JSON.stringify(key)}`, {
          details: { offset: keyOffset },
        });
      }
      fields.set(key, valueOffset);
    }
  }
  return fields;
}

function readField(
  r: MsgpackReader,
  pos: number,
  rule: FieldRule,
  field: string,
  ctx: Checker,
  maxExpert?: number,
): unknown {
  r.pos = pos;
  const kind = r.head();
  switch (rule.type) {
    case "uint": {
      if (kind !== Kind.int)
        return ctx.bad(field, `must be an unsigned integer, found ${describeKind(kind, r)}`);
      const min = rule.min ?? 0;
      if (!r.exact || r.num < min || r.num > rule.max) {
        return ctx.bad(field, `${r.exact ? r.num : "a value beyond 2^53"} is outside ${min}..${rule.max}`);
      }
      return r.num;
    }
    case "float": {
      if (kind !== Kind.int && kind !== Kind.float)
        return ctx.bad(field, `must be a number, found ${describeKind(kind, r)}`);
      if (!Number.isFinite(r.num)) return ctx.bad(field, `${r.num} is not finite`);
      if (rule.min !== undefined && r.num < rule.min) return ctx.bad(field, `${r.num} is below ${rule.min}`);
      return r.num;
    }
    case "str":
      if (kind !== Kind.str) return ctx.bad(field, `must be a string, found ${describeKind(kind, r)}`);
      return readStr(r, rule, field, ctx);
    case "bool":
      if (kind !== Kind.bool) return ctx.bad(field, `must be true or false, found ${describeKind(kind, r)}`);
      return r.num === 1;
    case "bin":
      if (kind !== Kind.bin) return ctx.bad(field, `must be bin, found ${describeKind(kind, r)}`);
      return r.bytes.subarray(r.pos, r.pos + r.num);
    case "uints": {
      if (kind !== Kind.array) return ctx.bad(field, `must be an array, found ${describeKind(kind, r)}`);
      const count = r.num;
      if (count > rule.maxItems)
        return ctx.bad(field, `${count} entries exceed the limit of ${rule.maxItems}`);
      const max =
        field === "experts" && maxExpert !== undefined ? Math.min(rule.max, maxExpert - 1) : rule.max;
      const out = new Array<number>(count);
      for (let i = 0; i < count; i++) {
        const k = r.head();
        if (k !== Kind.int)
          return ctx.bad(field, `entry ${i} must be an unsigned integer, found ${describeKind(k, r)}`);
        if (!r.exact || r.num < 0 || r.num > max) {
          return ctx.bad(field, `entry ${i} (${r.exact ? r.num : "beyond 2^53"}) is outside 0..${max}`);
        }
        if (rule.ascending && i > 0 && r.num <= out[i - 1]!) {
          return ctx.bad(
            field,
            `entries must be strictly ascending (entry ${i} is ${r.num} after ${out[i - 1]})`,
          );
        }
        out[i] = r.num;
      }
      return out;
    }
    case "strs": {
      if (kind !== Kind.array) return ctx.bad(field, `must be an array, found ${describeKind(kind, r)}`);
      const count = r.num;
      if (count > rule.maxItems)
        return ctx.bad(field, `${count} entries exceed the limit of ${rule.maxItems}`);
      const out = new Array<string>(count);
      for (let i = 0; i < count; i++) {
        const k = r.head();
        if (k !== Kind.str) return ctx.bad(field, `entry ${i} must be a string, found ${describeKind(k, r)}`);
        out[i] = readStr(r, rule, `${field}[${i}]`, ctx);
      }
      return out;
    }
    case "caps": {
      if (kind !== Kind.map) return ctx.bad(field, `must be a map, found ${describeKind(kind, r)}`);
      let fields: Map<string, number>;
      try {
        fields = indexMap(r, r.num, CAPS_KEYS);
      } catch (error) {
        // the whole frame was already checked to be well-formed: only a non-string or repeated key lands here
        if (error instanceof ProtocolError && error.code === "MOESWARM_PROTOCOL_MALFORMED") {
          return ctx.bad(field, error.message);
        }
        throw error;
      }
      const caps: Record<string, unknown> = {};
      for (const spec of CAPS_FIELDS) {
        const p = fields.get(spec.key);
        if (p !== undefined) caps[spec.key] = readField(r, p, spec.rule, `${field}.${spec.key}`, ctx);
      }
      return caps;
    }
  }
}

function readStr(
  r: MsgpackReader,
  rule: { min: number; max: number; oneOf?: readonly string[]; pattern?: RegExp },
  field: string,
  ctx: Checker,
): string {
  const length = r.num;
  if (length < rule.min || length > rule.max) {
    ctx.fail(
      "MOESWARM_PROTOCOL_BAD_FIELD",
      field,
      `string of ${length} bytes is outside ${rule.min}..${rule.max}`,
    );
  }
  const s = readUtf8(r.bytes, r.pos, length);
  r.pos += length;
  if (s === undefined) ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", field, "string is not valid UTF-8");
  checkStrValue(s, rule, field, ctx);
  return s;
}

function checkStrValue(
  s: string,
  rule: { oneOf?: readonly string[]; pattern?: RegExp },
  field: string,
  ctx: Checker,
): void {
  if (rule.oneOf && !rule.oneOf.includes(s)) {
    ctx.fail(
      "MOESWARM_PROTOCOL_BAD_FIELD",
      field,
      `${JSON.stringify(s.slice(0, 32))} is not one of ${rule.oneOf.join(", ")}`,
    );
  }
  if (rule.pattern && !rule.pattern.test(s)) {
    ctx.fail(
      "MOESWARM_PROTOCOL_BAD_FIELD",
      field,
      `${JSON.stringify(s.slice(0, 80))} does not match ${rule.pattern}`,
    );
  }
}

const ELEMENT_SIZE = { f32: 4, f16: 2, bf16: 2 } as const;

/** Checks bin lengths against the declared shape, then turns them into typed arrays. */
function lengthIs(
  o: Record<string, unknown>,
  field: string,
  expected: number,
  what: string,
  ctx: Checker,
): void {
  const got = (o[field] as Uint8Array).byteLength;
  if (got !== expected)
    ctx.fail("MOESWARM_PROTOCOL_BAD_LENGTH", field, `${got} bytes, expected ${expected} (${what})`);
}

/** Checks bin lengths against the declared shape, then turns them into typed arrays. */
function decodeTensors(t: FrameType, o: Record<string, unknown>, ctx: Checker, copy: boolean): void {
  if (t === "dispatch") {
    const n = o.n as number;
    const k = o.k as number;
    const embd = o.embd as number;
    const dtype = o.dtype as keyof typeof ELEMENT_SIZE;
    lengthIs(o, "x", n * embd * ELEMENT_SIZE[dtype], `n*embd*${ELEMENT_SIZE[dtype]} for ${dtype}`, ctx);
    lengthIs(o, "ids", n * k * 4, "n*k*4", ctx);
    o.x = typedArrayFromBytes(dtype === "f32" ? "f32" : "f16", o.x as Uint8Array, { copy });
    o.ids = typedArrayFromBytes("i32", o.ids as Uint8Array, { copy });
    if (o.w !== undefined) {
      lengthIs(o, "w", n * k * 4, "n*k*4", ctx);
      o.w = typedArrayFromBytes("f32", o.w as Uint8Array, { copy });
    }
  } else if (t === "result") {
    const n = o.n as number;
    const k = o.k as number;
    const embd = o.embd as number;
    if (o.compact === true) {
      // the filled slots' rows: their count is the dispatch's, which a relay does not know
      const got = (o.y as Uint8Array).byteLength;
      if (o.mode !== "each")
        ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "compact", 'a compact result must be mode "each"');
      if (got % (embd * 4) !== 0 || got > n * k * embd * 4) {
        ctx.fail(
          "MOESWARM_PROTOCOL_BAD_LENGTH",
          "y",
          `${got} bytes, expected a multiple of embd*4 up to n*k*embd*4 (${n * k * embd * 4}) for a compact result`,
        );
      }
    } else if (o.mode === "each") lengthIs(o, "y", n * k * embd * 4, 'n*k*embd*4 for mode "each"', ctx);
    else lengthIs(o, "y", n * embd * 4, 'n*embd*4 for mode "sum"', ctx);
    o.y = typedArrayFromBytes("f32", o.y as Uint8Array, { copy });
  }
}

/** Rules that involve more than one field or the values inside a tensor; shared by both directions. */
function checkCrossFields(t: FrameType, o: Record<string, unknown>, ctx: Checker, maxExpert?: number): void {
  if (t !== "dispatch") return;
  if (o.compact === true && o.mode !== "each") {
    ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "compact", 'compact results exist for mode "each" only');
  }
  if (o.mode === "sum" && o.w === undefined) {
    ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", "w", 'router weights are required for mode "sum"');
  }
  const ids = o.ids as Int32Array;
  const limit = maxExpert ?? 0x8000_0000;
  for (let i = 0; i < ids.length; i++) {
    const e = ids[i]!;
    if (e < -1 || e >= limit) {
      ctx.fail(
        "MOESWARM_PROTOCOL_BAD_FIELD",
        "ids",
        `slot ${i} holds expert id ${e}, outside -1..${limit - 1}${maxExpert !== undefined ? " (maxExpert)" : ""}`,
      );
    }
  }
  const w = o.w as Float32Array | undefined;
  if (w) {
    for (let i = 0; i < w.length; i++) {
      if (!Number.isFinite(w[i]!))
        ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "w", `slot ${i} weight ${w[i]} is not finite`);
    }
  }
}

// ---- validation of frames built in memory ------------------------------------------------------

function checkValue(value: unknown, rule: FieldRule, field: string, ctx: Checker): void {
  switch (rule.type) {
    case "uint": {
      const min = rule.min ?? 0;
      if (typeof value !== "number" || !Number.isSafeInteger(value) || value < min || value > rule.max) {
        ctx.bad(field, `must be an integer in ${min}..${rule.max}, got ${describeJs(value)}`);
      }
      return;
    }
    case "float":
      if (typeof value !== "number" || !Number.isFinite(value))
        ctx.bad(field, `must be a finite number, got ${describeJs(value)}`);
      if (rule.min !== undefined && (value as number) < rule.min)
        ctx.bad(field, `${value} is below ${rule.min}`);
      return;
    case "str": {
      if (typeof value !== "string") ctx.bad(field, `must be a string, got ${describeJs(value)}`);
      if (LONE_SURROGATE.test(value))
        ctx.bad(field, "string has a lone UTF-16 surrogate (not encodable as UTF-8)");
      const length = byteLength(value);
      if (length < rule.min || length > rule.max) {
        ctx.bad(field, `string of ${length} UTF-8 bytes is outside ${rule.min}..${rule.max}`);
      }
      checkStrValue(value, rule, field, ctx);
      return;
    }
    case "bin":
      // element types and lengths are checked per frame type
      return;
    case "bool":
      if (typeof value !== "boolean") ctx.bad(field, `must be true or false, got ${describeJs(value)}`);
      return;
    case "uints": {
      if (!Array.isArray(value)) ctx.bad(field, `must be an array of integers, got ${describeJs(value)}`);
      if (value.length > rule.maxItems)
        ctx.bad(field, `${value.length} entries exceed the limit of ${rule.maxItems}`);
      for (let i = 0; i < value.length; i++) {
        const e: unknown = value[i];
        if (typeof e !== "number" || !Number.isSafeInteger(e) || e < 0 || e > rule.max) {
          ctx.bad(field, `entry ${i} must be an integer in 0..${rule.max}, got ${describeJs(e)}`);
        }
        if (rule.ascending && i > 0 && (e as number) <= (value[i - 1] as number)) {
          ctx.bad(field, `entries must be strictly ascending (entry ${i} is ${e} after ${value[i - 1]})`);
        }
      }
      return;
    }
    case "strs": {
      if (!Array.isArray(value)) ctx.bad(field, `must be an array of strings, got ${describeJs(value)}`);
      if (value.length > rule.maxItems)
        ctx.bad(field, `${value.length} entries exceed the limit of ${rule.maxItems}`);
      const itemRule = { type: "str", min: rule.min, max: rule.max } as const;
      for (let i = 0; i < value.length; i++) checkValue(value[i], itemRule, `${field}[${i}]`, ctx);
      return;
    }
    case "caps": {
      if (typeof value !== "object" || value === null || Array.isArray(value)) {
        ctx.bad(field, `must be an object, got ${describeJs(value)}`);
      }
      for (const spec of CAPS_FIELDS) {
        const v = (value as Record<string, unknown>)[spec.key];
        if (v !== undefined) checkValue(v, spec.rule, `${field}.${spec.key}`, ctx);
      }
    }
  }
}

function describeJs(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  if (typeof value === "object") return (value as object).constructor?.name ?? "an object";
  if (typeof value === "string")
    return JSON.stringify(value.length > 32 ? `${value.slice(0, 32)}...` : value);
  return String(value);
}

function elementsAre(
  o: Record<string, unknown>,
  field: string,
  ctor: { new (n: number): unknown; name: string },
  length: number,
  what: string,
  ctx: Checker,
): void {
  const a = o[field];
  if (!(a instanceof ctor)) ctx.bad(field, `must be a ${ctor.name}, got ${describeJs(a)}`);
  const got = (a as { length: number }).length;
  if (got !== length)
    ctx.fail("MOESWARM_PROTOCOL_BAD_LENGTH", field, `${got} elements, expected ${length} (${what})`);
}

function checkTensorTypes(t: FrameType, o: Record<string, unknown>, ctx: Checker): void {
  if (t === "dispatch") {
    const n = o.n as number;
    const k = o.k as number;
    const embd = o.embd as number;
    elementsAre(o, "x", o.dtype === "f32" ? Float32Array : Uint16Array, n * embd, "n*embd", ctx);
    elementsAre(o, "ids", Int32Array, n * k, "n*k", ctx);
    if (o.w !== undefined) elementsAre(o, "w", Float32Array, n * k, "n*k", ctx);
  } else if (t === "result") {
    const n = o.n as number;
    const k = o.k as number;
    const embd = o.embd as number;
    const each = o.mode === "each";
    if (o.compact === true) {
      const y = o.y;
      if (!(y instanceof Float32Array)) ctx.bad("y", `must be a Float32Array, got ${describeJs(y)}`);
      if (!each) ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "compact", 'a compact result must be mode "each"');
      const got = (y as Float32Array).length;
      if (got % embd !== 0 || got > n * k * embd) {
        ctx.fail(
          "MOESWARM_PROTOCOL_BAD_LENGTH",
          "y",
          `${got} elements, expected a multiple of embd up to n*k*embd (${n * k * embd}) for a compact result`,
        );
      }
      return;
    }
    elementsAre(o, "y", Float32Array, each ? n * k * embd : n * embd, each ? "n*k*embd" : "n*embd", ctx);
  }
}

/**
 * Checks a frame built in memory against every rule `decodeFrame` enforces (the same limits, tensor
 * lengths and id ranges), throwing InvalidArgumentError (`details.protocolCode` says which
 * protocol rule). `encodeFrame` calls it; builders call it too.
 */
export function validateFrame(frame: Frame, options: { maxExpert?: number } = {}): void {
  const maxExpert = checkMaxExpert(options.maxExpert);
  if (typeof frame !== "object" || frame === null) {
    throw new InvalidArgumentError("a frame must be an object");
  }
  const o = frame as unknown as Record<string, unknown>;
  const ctx: Checker = new Checker(isFrameType(o.t) ? o.t : "frame", true);
  if (!isFrameType(o.t))
    ctx.fail("MOESWARM_PROTOCOL_UNKNOWN_TYPE", "t", `unknown frame type ${describeJs(o.t)}`);
  if (o.v !== undefined && o.v !== PROTOCOL_VERSION) {
    ctx.fail("MOESWARM_PROTOCOL_VERSION", "v", `version must be ${PROTOCOL_VERSION}, got ${describeJs(o.v)}`);
  }
  const t = o.t as FrameType;
  for (const spec of FRAME_FIELDS[t]) {
    const value = o[spec.key];
    if (value === undefined) {
      if (spec.required) ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", spec.key, "required field is missing");
      continue;
    }
    checkValue(value, spec.rule, spec.key, ctx);
  }
  if (t === "register" && maxExpert !== undefined) {
    const experts = o.experts as number[];
    const last = experts[experts.length - 1];
    if (last !== undefined && last >= maxExpert) {
      ctx.fail(
        "MOESWARM_PROTOCOL_BAD_FIELD",
        "experts",
        `expert ${last} is not below maxExpert ${maxExpert}`,
      );
    }
  }
  checkTensorTypes(t, o, ctx);
  checkCrossFields(t, o, ctx, maxExpert);
}

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
const PACKR_HEADROOM = 0x800 + 16;
// Handed to msgpackr after each pack so that it never writes into the slab on its own: with less
// than 2 KiB of room, its next pack starts a new buffer instead.
const DETACHED = Buffer.alloc(16);
const TWO_32 = 0x1_0000_0000;

// Frames with tensors are assembled instead: msgpackr packs the entries between the tensors (as
// an array of keys and values whose header is then dropped: a map's entries are its keys and
// values one after the other), a tensor's bin header is one of three fixed forms, and each tensor
// is copied once into memory of exactly the payload's size. Packed whole, the tensors would be
// copied into a buffer sized by an upper bound, for large frames a zero-filled slab four frames
// wide: every byte written twice. Above this size a frame gets memory of its own, not
// zero-filled since every byte of it is written.
const OWN_MEMORY_BYTES = 64 * 1024;
// msgpackr's working buffer for the runs between tensors (a few numbers and short names).
const runScratch = Buffer.alloc(0x8000);
const HAS_TENSORS: ReadonlySet<FrameType> = new Set(
  (Object.keys(FRAME_FIELDS) as FrameType[]).filter((t) =>
    FRAME_FIELDS[t].some((s) => s.rule.type === "bin"),
  ),
);
// The first tensor of at least this size is the main one, placed 8-byte aligned in memory so that
// decoding it in this process, or after a transport that keeps the alignment, is a view.
const LARGE_BIN = 64;
const binHeader = (n: number) => (n < 256 ? 2 : n < 65536 ? 3 : 5);

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
function pack(frame: Frame, reserve: number, max: number): Uint8Array {
  const o = frame as unknown as Record<string, unknown>;
  const value: Record<string, unknown> = { t: o.t, v: PROTOCOL_VERSION };
  const w: Wire = { bound: 16 + 12, bigint: false };
  for (const spec of FRAME_FIELDS[frame.t]) {
    if (o[spec.key] === undefined) continue;
    w.bound += 1 + spec.key.length;
    value[spec.key] = wireValue(o[spec.key], spec.rule, w);
  }
  const room = slab.room(w.bound + reserve + PACKR_HEADROOM);
  packr.useBuffer(room);
  let packed: Uint8Array;
  try {
    packed = packr.pack(value, reserve > 0 ? RESERVE_START_SPACE | reserve : 0);
  } finally {
    packr.useBuffer(DETACHED);
  }
  // (had msgpackr needed more room than the bound, it would have packed into a buffer of its own)
  if (packed.buffer === room.buffer) slab.take(packed.byteLength);
  if (packed.byteLength - reserve > max) throw tooLarge(packed.byteLength - reserve, max);
  if (w.bigint) uint64Headers(packed, reserve, "map");
  // a plain Uint8Array, as callers expect (a Buffer's `slice` would not copy)
  return new Uint8Array(packed.buffer, packed.byteOffset, packed.byteLength);
}

/** `pack` for a validated frame with tensors: the same bytes, each tensor copied once. */
function packTensors(frame: Frame, reserve: number, max: number): Uint8Array {
  const o = frame as unknown as Record<string, unknown>;
  // runs of packed entries, each but the last followed by a tensor
  const runs: Uint8Array[] = [];
  const tensors: Uint8Array[] = [];
  const w: Wire = { bound: 0, bigint: false };
  let entries: unknown[] = ["t", frame.t, "v", PROTOCOL_VERSION];
  let keys = 2;
  packr.useBuffer(runScratch);
  try {
    for (const spec of FRAME_FIELDS[frame.t]) {
      const value = o[spec.key];
      if (value === undefined) continue;
      keys++;
      entries.push(spec.key);
      if (spec.rule.type === "bin") {
        runs.push(packEntries(entries, w));
        tensors.push(bytesOf(value as Float32Array | Uint16Array | Int32Array));
        entries = [];
      } else {
        entries.push(wireValue(value, spec.rule, w));
      }
    }
    runs.push(entries.length > 0 ? packEntries(entries, w) : new Uint8Array(0));
  } finally {
    packr.useBuffer(DETACHED);
  }
  let size = keys < 16 ? 1 : 3;
  let tensorAt = -1;
  for (let i = 0; i < tensors.length; i++) {
    const n = tensors[i]!.byteLength;
    size += runs[i]!.byteLength + binHeader(n);
    if (tensorAt < 0 && n >= LARGE_BIN) tensorAt = size;
    size += n;
  }
  size += runs[tensors.length]!.byteLength;
  if (size > max) throw tooLarge(size, max);
  // shift the payload so that the main tensor's data lands 8-byte aligned (buffers start so)
  const shift = tensorAt < 0 ? 0 : (8 - ((reserve + tensorAt) % 8)) % 8;
  const total = shift + reserve + size;
  let out: Buffer;
  if (total > OWN_MEMORY_BYTES) {
    out = Buffer.allocUnsafeSlow(total);
    out.fill(0, 0, shift + reserve);
  } else {
    out = slab.alloc(total);
  }
  let at = shift + reserve;
  if (keys < 16) out[at++] = 0x80 | keys;
  else {
    out[at++] = 0xde;
    out.writeUInt16BE(keys, at);
    at += 2;
  }
  for (let i = 0; i < tensors.length; i++) {
    out.set(runs[i]!, at);
    at += runs[i]!.byteLength;
    const tensor = tensors[i]!;
    const n = tensor.byteLength;
    if (n < 0x100) {
      out[at++] = 0xc4;
      out[at++] = n;
    } else if (n < 0x1_0000) {
      out[at++] = 0xc5;
      out.writeUInt16BE(n, at);
      at += 2;
    } else {
      out[at++] = 0xc6;
      out.writeUInt32BE(n, at);
      at += 4;
    }
    out.set(tensor, at);
    at += n;
  }
  out.set(runs[tensors.length]!, at);
  return new Uint8Array(out.buffer, out.byteOffset + shift, reserve + size);
}

/** Packs map entries (keys and values in order) without the array header around them. */
function packEntries(entries: unknown[], w: Wire): Uint8Array {
  const packed: Uint8Array = packr.pack(entries);
  if (w.bigint) uint64Headers(packed, 0, "array");
  w.bigint = false;
  // fixarray below 16 elements, array 16 from there (a frame has fewer than 2^16 entries)
  return packed.subarray(entries.length < 16 ? 1 : 3);
}

/**
 * Rewrites the int64 header (0xd3) of non-negative top-level values to uint64 (0xcf): the values
 * of a map, or every element of an array of keys and values (a key is a string, never 0xd3).
 */
function uint64Headers(bytes: Uint8Array, start: number, container: "map" | "array"): void {
  const r = new MsgpackReader(bytes);
  r.pos = start;
  r.head();
  const count = r.num;
  for (let i = 0; i < count; i++) {
    if (container === "map") r.skip();
    const at = r.pos;
    if (bytes[at] === 0xd3 && bytes[at + 1]! < 0x80) bytes[at] = 0xcf;
    r.skip();
  }
}

export interface EncodeOptions {
  /** Largest payload to produce, in bytes (default 64 MiB); larger frames throw FRAME_TOO_LARGE. */
  maxFrameBytes?: number;
}

/**
 * Encodes a frame as its canonical msgpack payload (see docs/protocol.md). The frame is
 * validated first (`validateFrame`); keys other than the frame type's fields are not sent. The
 * result is a view into a larger buffer shared with other frames (as Node's Buffer pool does):
 * write the view itself, never its `.buffer`.
 */
export function encodeFrame(frame: Frame, options: EncodeOptions = {}): Uint8Array {
  const max = checkMaxFrameBytes(options.maxFrameBytes);
  validateFrame(frame);
  return HAS_TENSORS.has(frame.t) ? packTensors(frame, 0, max) : pack(frame, 0, max);
}

/** Encodes a frame with 4 bytes reserved at the start (for a length prefix); internal to framing. */
export function encodeFrameWithPrefixSpace(frame: Frame, options: EncodeOptions = {}): Uint8Array {
  const max = checkMaxFrameBytes(options.maxFrameBytes);
  validateFrame(frame);
  return HAS_TENSORS.has(frame.t) ? packTensors(frame, 4, max) : pack(frame, 4, max);
}

/** `spec` rows for docs and tests: the canonical field order of each frame type, with `t` and `v`. */
export function canonicalKeys(t: FrameType): string[] {
  return ["t", "v", ...FRAME_FIELDS[t].map((s: FieldSpec) => s.key)];
}

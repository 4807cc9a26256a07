import {
  Checker,
  checkCrossFields,
  checkMaxExpert,
  checkMaxFrameBytes,
  checkStrValue,
} from "./codec-checks.js";
import { InvalidArgumentError, ProtocolError } from "./errors.js";
import {
  CAPS_FIELDS,
  type FieldRule,
  FRAME_FIELDS,
  type Frame,
  type FrameType,
  isFrameType,
  isQuantizedActivationDtype,
  PROTOCOL_VERSION,
  quantizedActivationBytes,
} from "./frames.js";
import { KIND_NAMES, Kind, MsgpackReader, readUtf8 } from "./msgpack-read.js";
import { typedArrayFromBytes } from "./tensor.js";

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
  /**
   * Leave the activations and outputs (`x`, `y`) as the frame's bytes (Uint8Array views), their
   * lengths checked but never decoded or copied: for a relay that forwards them (rerouteFrame).
   * `ids` and `w` are decoded and checked as always. The frame's type then lies about `x` and `y`.
   */
  raw?: boolean;
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
  decodeTensors(t, out, ctx, options.copy === true, options.raw === true);
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
function decodeTensors(
  t: FrameType,
  o: Record<string, unknown>,
  ctx: Checker,
  copy: boolean,
  raw: boolean,
): void {
  if (t === "dispatch") {
    const n = o.n as number;
    const k = o.k as number;
    const embd = o.embd as number;
    if (isQuantizedActivationDtype(o.dtype)) {
      // ggml block rows: x stays bytes
      const bytes = quantizedActivationBytes(o.dtype, n, embd);
      if (bytes === 0)
        ctx.fail(
          "MOESWARM_PROTOCOL_BAD_LENGTH",
          "x",
          `embd ${embd} is not a whole number of ${o.dtype} blocks`,
        );
      lengthIs(o, "x", bytes, `n rows of embd values as ${o.dtype} blocks`, ctx);
      if (!raw && copy) o.x = (o.x as Uint8Array).slice();
    } else {
      const dtype = o.dtype as keyof typeof ELEMENT_SIZE;
      lengthIs(o, "x", n * embd * ELEMENT_SIZE[dtype], `n*embd*${ELEMENT_SIZE[dtype]} for ${dtype}`, ctx);
      if (!raw) o.x = typedArrayFromBytes(dtype === "f32" ? "f32" : "f16", o.x as Uint8Array, { copy });
    }
    lengthIs(o, "ids", n * k * 4, "n*k*4", ctx);
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
    if (!raw) o.y = typedArrayFromBytes("f32", o.y as Uint8Array, { copy });
  }
}

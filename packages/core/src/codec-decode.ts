import {
  Checker,
  checkCrossFields,
  checkMaxExpert,
  checkMaxFrameBytes,
  checkStrValue,
  quantizedXBytes,
} from "./codec-checks.js";
import { InvalidArgumentError, ProtocolError } from "./errors.js";
import {
  CAPS_FIELDS,
  type FieldRule,
  FRAME_FIELDS,
  type Frame,
  type FrameType,
  isQuantizedActivationDtype,
  PROTOCOL_VERSION,
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

// Keys are matched by their bytes (all known keys are ASCII), without building strings, and
// numbered: a map's known keys are indexed into a reused array of value offsets, not a Map.
const KEY_NAMES: readonly string[] = [
  ...new Set([
    "t",
    "v",
    ...Object.values(FRAME_FIELDS).flatMap((specs) => specs.map((s) => s.key)),
    ...CAPS_FIELDS.map((s) => s.key),
  ]),
];
const keyId = (key: string): number => KEY_NAMES.indexOf(key);
// A key is found by a hash of its length and first and last bytes, then one compare of its bytes
// (a chain when two keys share a hash): a map's keys are looked up once per frame each, a dozen
// or more per dispatch, and a scan of the keys of the same length took a fifth of the decoding.
const KEY_BYTES: readonly Uint8Array[] = KEY_NAMES.map((key) => Uint8Array.from(key, (c) => c.charCodeAt(0)));
const KEY_HASH_BITS = 8;
const keyHash = (bytes: Uint8Array, pos: number, length: number): number =>
  (length * 0x9e + bytes[pos]! * 31 + bytes[pos + length - 1]! * 7) & ((1 << KEY_HASH_BITS) - 1);
/** The first key id of each hash (-1: none), and the next id of the same hash after each id. */
const KEY_CHAIN_HEAD = new Int16Array(1 << KEY_HASH_BITS).fill(-1);
const KEY_CHAIN_NEXT = new Int16Array(KEY_NAMES.length).fill(-1);
KEY_BYTES.forEach((encoded, id) => {
  const h = keyHash(encoded, 0, encoded.length);
  KEY_CHAIN_NEXT[id] = KEY_CHAIN_HEAD[h]!;
  KEY_CHAIN_HEAD[h] = id;
});
/** Which key ids a frame's map and a `caps` map know (others are skipped). */
const FRAME_KNOWN = new Uint8Array(KEY_NAMES.length);
for (const key of ["t", "v", ...Object.values(FRAME_FIELDS).flatMap((specs) => specs.map((s) => s.key))])
  FRAME_KNOWN[keyId(key)] = 1;
const CAPS_KNOWN = new Uint8Array(KEY_NAMES.length);
for (const spec of CAPS_FIELDS) CAPS_KNOWN[keyId(spec.key)] = 1;
const T_ID = keyId("t");
const V_ID = keyId("v");
const CAPS_SPEC_IDS: readonly number[] = CAPS_FIELDS.map((s) => keyId(s.key));
// Value offsets by key id (-1: absent) of the frame's map and of its `caps` map; decoding is
// synchronous, so one of each serves every call.
const framePositions = new Int32Array(KEY_NAMES.length);
const capsPositions = new Int32Array(KEY_NAMES.length);

function lookupKey(bytes: Uint8Array, pos: number, length: number): number {
  if (length === 0) return -1;
  next: for (let id = KEY_CHAIN_HEAD[keyHash(bytes, pos, length)]!; id >= 0; id = KEY_CHAIN_NEXT[id]!) {
    const encoded = KEY_BYTES[id]!;
    if (encoded.length !== length) continue;
    for (let i = 0; i < length; i++) if (bytes[pos + i] !== encoded[i]) continue next;
    return id;
  }
  return -1;
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
  const fields = indexMap(r, r.num, FRAME_KNOWN, framePositions);
  if (r.pos !== r.end) {
    throw new ProtocolError(`${r.end - r.pos} bytes after the end of the frame's map`, {
      details: { offset: r.pos },
    });
  }

  const ctx: Checker = new Checker("frame", false);
  const tPos = fields[T_ID]!;
  if (tPos < 0) ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", "t", "the frame type `t` is missing");
  r.pos = tPos;
  const tKind = r.head();
  if (tKind !== Kind.str)
    ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "t", `must be a string, found ${describeKind(tKind, r)}`);
  // known types are matched by their bytes; an unknown one's name is decoded for the error only
  // when it is no longer than any known one
  const plan = planOf(r.bytes, r.pos, r.num);
  const t = plan?.t ?? (r.num <= 16 ? readUtf8(r.bytes, r.pos, r.num) : undefined);
  const vPos = fields[V_ID]!;
  if (vPos < 0) ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", "v", "the protocol version `v` is missing");
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
  if (plan === undefined) {
    throw new ProtocolError(
      "MOESWARM_PROTOCOL_UNKNOWN_TYPE",
      `unknown frame type ${t === undefined ? "(a long or non-UTF-8 string)" : JSON.stringify(t)}`,
      { details: { type: t ?? null } },
    );
  }
  const type = plan.t;
  ctx.type = type;

  const out: Record<string, unknown> = { t: type, v: PROTOCOL_VERSION };
  const { specs, ids, strings } = plan;
  for (let i = 0; i < specs.length; i++) {
    const spec = specs[i]!;
    const pos = fields[ids[i]!]!;
    if (pos < 0) {
      if (spec.required) ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", spec.key, "required field is missing");
      continue;
    }
    let value: unknown = spec.rule.type === "str" ? lastString(r, pos, strings[i]) : undefined;
    if (value === undefined) {
      value = readField(r, pos, spec.rule, spec.key, ctx, maxExpert);
      if (spec.rule.type === "str") strings[i] = rememberString(r.bytes, pos, value as string);
    }
    out[spec.key] = value;
    if (spec.key === "id") ctx.id = value as number;
  }
  decodeTensors(type, out, ctx, options.copy === true, options.raw === true);
  checkCrossFields(type, out, ctx, maxExpert);
  return out as unknown as Frame;
}

// The last string accepted per frame type and field, with its encoding: peer ids, model names,
// modes and dtypes repeat frame after frame, and one compare of their bytes then replaces the
// decoding and the checks (the rules depend on nothing but the string).
interface LastString {
  readonly encoded: Uint8Array;
  readonly value: string;
}

/**
 * What decoding a frame of one type needs, found once per frame by the type's bytes (a keyed
 * lookup by the type's name per field, with a dozen names seen, cost more than reading the field).
 * `strings`: the last string accepted per field.
 */
interface TypePlan {
  readonly t: FrameType;
  readonly encoded: Uint8Array;
  readonly specs: (typeof FRAME_FIELDS)[FrameType];
  readonly ids: readonly number[];
  readonly strings: Array<LastString | undefined>;
}
const PLANS: readonly TypePlan[] = (Object.keys(FRAME_FIELDS) as FrameType[]).map((t) => ({
  t,
  encoded: Uint8Array.from(t, (c) => c.charCodeAt(0)),
  specs: FRAME_FIELDS[t],
  ids: FRAME_FIELDS[t].map((s) => keyId(s.key)),
  strings: FRAME_FIELDS[t].map(() => undefined),
}));

/** The plan of the frame type whose name is `bytes[pos, pos + length)`, if it is one. */
function planOf(bytes: Uint8Array, pos: number, length: number): TypePlan | undefined {
  next: for (let p = 0; p < PLANS.length; p++) {
    const plan = PLANS[p]!;
    const encoded = plan.encoded;
    if (encoded.length !== length) continue;
    for (let i = 0; i < length; i++) if (bytes[pos + i] !== encoded[i]) continue next;
    return plan;
  }
  return undefined;
}

const REMEMBERED_BYTES = 64;

/** The string at `pos` if its encoding (header included) is the last one accepted. */
function lastString(r: MsgpackReader, pos: number, last: LastString | undefined): string | undefined {
  if (last === undefined) return undefined;
  const bytes = r.bytes;
  const encoded = last.encoded;
  const n = encoded.byteLength;
  if (n > r.end - pos) return undefined;
  for (let i = 0; i < n; i++) if (bytes[pos + i] !== encoded[i]) return undefined;
  return last.value;
}

function rememberString(bytes: Uint8Array, pos: number, value: string): LastString | undefined {
  const r = new MsgpackReader(bytes);
  r.pos = pos;
  r.head();
  const end = r.pos + r.num;
  return end - pos <= REMEMBERED_BYTES ? { encoded: copyOf(bytes, pos, end), value } : undefined;
}

/**
 * bytes[start, end) in memory of its own. Not `slice`: a Buffer's `slice` is a view, and a view
 * would change with memory its owner reuses or rewrites (the relay reroutes frames in place), and
 * keep that memory alive.
 */
function copyOf(bytes: Uint8Array, start: number, end: number): Uint8Array {
  return new Uint8Array(bytes.subarray(start, end));
}

/**
 * Walks `count` map entries at the reader's position and fills `positions` (by key id) with the
 * offsets of the values of `known` keys, -1 for those absent. Every value (known or not) is
 * checked for well-formedness while skipping.
 */
function indexMap(r: MsgpackReader, count: number, known: Uint8Array, positions: Int32Array): Int32Array {
  if (count * 2 > r.end - r.pos) {
    throw new ProtocolError(`msgpack map declares ${count} entries but only ${r.end - r.pos} bytes remain`, {
      details: { offset: r.pos },
    });
  }
  positions.fill(-1);
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
    const id = lookupKey(r.bytes, keyStart, length);
    const valueOffset = r.pos;
    r.skip(2);
    if (id >= 0 && known[id] === 1) {
      if (positions[id]! >= 0) {
        throw new ProtocolError(`duplicate key ${JSON.stringify(KEY_NAMES[id])}`, {
          details: { offset: keyOffset },
        });
      }
      positions[id] = valueOffset;
    }
  }
  return positions;
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
      let fields: Int32Array;
      try {
        fields = indexMap(r, r.num, CAPS_KNOWN, capsPositions);
      } catch (error) {
        // the whole frame was already checked to be well-formed: only a non-string or repeated key lands here
        if (error instanceof ProtocolError && error.code === "MOESWARM_PROTOCOL_MALFORMED") {
          return ctx.bad(field, error.message);
        }
        throw error;
      }
      const caps: Record<string, unknown> = {};
      for (let i = 0; i < CAPS_FIELDS.length; i++) {
        const spec = CAPS_FIELDS[i]!;
        const p = fields[CAPS_SPEC_IDS[i]!]!;
        if (p >= 0) caps[spec.key] = readField(r, p, spec.rule, `${field}.${spec.key}`, ctx);
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

type TensorCtor = typeof Float32Array | typeof Uint16Array | typeof Int32Array;
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
// Copies of small tensors that are not aligned in the frame (ids and w mostly) are cut from one
// pool, as Slab does, without its Buffer views: two objects per copy instead of four.
const POOL_BYTES = 64 * 1024;
let pool = new ArrayBuffer(0);
let poolPos = 0;

/** A tensor's bytes as its typed array: a view when aligned (unless `copy`), else a copy. */
function tensorOf(
  ctor: TensorCtor,
  bytes: Uint8Array,
  copy: boolean,
): Float32Array | Uint16Array | Int32Array {
  const size = ctor.BYTES_PER_ELEMENT;
  // (a big-endian host swaps bytes: typedArrayFromBytes knows how)
  if (!LITTLE_ENDIAN)
    return typedArrayFromBytes(size === 2 ? "f16" : ctor === Int32Array ? "i32" : "f32", bytes, { copy });
  const n = bytes.byteLength / size;
  if (!copy && bytes.byteOffset % size === 0)
    return new ctor(bytes.buffer as ArrayBuffer, bytes.byteOffset, n);
  const length = bytes.byteLength;
  if (length > POOL_BYTES >> 2) {
    const out = new ctor(n);
    new Uint8Array(out.buffer).set(bytes);
    return out;
  }
  if (pool.byteLength - poolPos < length) {
    pool = new ArrayBuffer(POOL_BYTES);
    poolPos = 0;
  }
  const at = poolPos;
  new Uint8Array(pool, at, length).set(bytes);
  poolPos += (length + 7) & ~7;
  return new ctor(pool, at, n);
}

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
      const bytes = quantizedXBytes(o.dtype, n, embd, ctx);
      lengthIs(o, "x", bytes, `n rows of embd values as ${o.dtype} blocks`, ctx);
      if (!raw && copy) o.x = copyOf(o.x as Uint8Array, 0, (o.x as Uint8Array).byteLength);
    } else {
      const dtype = o.dtype as keyof typeof ELEMENT_SIZE;
      lengthIs(o, "x", n * embd * ELEMENT_SIZE[dtype], `n*embd*${ELEMENT_SIZE[dtype]} for ${dtype}`, ctx);
      if (!raw) o.x = tensorOf(dtype === "f32" ? Float32Array : Uint16Array, o.x as Uint8Array, copy);
    }
    lengthIs(o, "ids", n * k * 4, "n*k*4", ctx);
    o.ids = tensorOf(Int32Array, o.ids as Uint8Array, copy);
    if (o.w !== undefined) {
      lengthIs(o, "w", n * k * 4, "n*k*4", ctx);
      o.w = tensorOf(Float32Array, o.w as Uint8Array, copy);
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
    if (!raw) o.y = tensorOf(Float32Array, o.y as Uint8Array, copy);
  }
}

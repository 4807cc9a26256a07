import {
  byteLength,
  Checker,
  checkCrossFields,
  checkMaxExpert,
  checkStrValue,
  LONE_SURROGATE,
  quantizedXBytes,
} from "./codec-checks.js";
import { InvalidArgumentError } from "./errors.js";
import {
  CAPS_FIELDS,
  type FieldRule,
  FRAME_FIELDS,
  type Frame,
  type FrameType,
  isFrameType,
  isQuantizedActivationDtype,
  PROTOCOL_VERSION,
} from "./frames.js";

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
    if (isQuantizedActivationDtype(o.dtype)) {
      const bytes = quantizedXBytes(o.dtype, n, embd, ctx);
      elementsAre(o, "x", Uint8Array, bytes, `n rows of embd values as ${o.dtype} blocks`, ctx);
    } else {
      elementsAre(o, "x", o.dtype === "f32" ? Float32Array : Uint16Array, n * embd, "n*embd", ctx);
    }
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

// The last string accepted per frame type and field: peer ids, model names and modes repeat frame
// after frame, and a string's checks depend on nothing but the string (compared by value).
const ACCEPTED = Object.fromEntries(
  (Object.keys(FRAME_FIELDS) as FrameType[]).map((t) => [t, FRAME_FIELDS[t].map(() => undefined)]),
) as unknown as Record<FrameType, Array<string | undefined>>;

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
  const specs = FRAME_FIELDS[t];
  const accepted = ACCEPTED[t];
  for (let i = 0; i < specs.length; i++) {
    const spec = specs[i]!;
    const value = o[spec.key];
    if (value === undefined) {
      if (spec.required) ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", spec.key, "required field is missing");
      continue;
    }
    if (value === accepted[i]) continue;
    checkValue(value, spec.rule, spec.key, ctx);
    if (typeof value === "string") accepted[i] = value;
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

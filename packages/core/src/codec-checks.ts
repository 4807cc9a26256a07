import type { CodeOf } from "./errors.js";
import { InvalidArgumentError, ProtocolError } from "./errors.js";
import {
  DEFAULT_MAX_FRAME_BYTES,
  type FrameType,
  MAIN_TENSOR_ALIGN,
  MAX_HEADROOM,
  type QuantizedActivationDtype,
  quantizedActivationBytes,
} from "./frames.js";

// What decoding and validation share: how a check fails, the option checks, cross-field rules.

export type ProtocolCode = CodeOf<"ProtocolError">;

/**
 * Where a check runs and how it fails: `decodeFrame` throws ProtocolError (with the frame type,
 * the field and, once read, the request id), the encoder InvalidArgumentError.
 */
export class Checker {
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

export function checkMaxFrameBytes(value: number | undefined): number {
  if (value === undefined) return DEFAULT_MAX_FRAME_BYTES;
  if (!Number.isSafeInteger(value) || value < 1 || value > 0xffff_ffff) {
    throw new InvalidArgumentError(`maxFrameBytes must be an integer in 1..2^32-1, got ${String(value)}`);
  }
  return value;
}

/** EncodeOptions `headroom`: a multiple of the main tensor's alignment that the padding can hold. */
export function checkHeadroom(value: number | undefined): number {
  if (value === undefined) return 0;
  if (!Number.isInteger(value) || value < 0 || value > MAX_HEADROOM || value % MAIN_TENSOR_ALIGN !== 0) {
    throw new InvalidArgumentError(
      `headroom must be a multiple of ${MAIN_TENSOR_ALIGN} in 0..${MAX_HEADROOM}, got ${String(value)}`,
    );
  }
  return value;
}

export function checkMaxExpert(value: number | undefined): number | undefined {
  if (value === undefined) return undefined;
  if (!Number.isSafeInteger(value) || value < 1 || value > 0x8000_0000) {
    throw new InvalidArgumentError(`maxExpert must be an integer in 1..2^31, got ${String(value)}`);
  }
  return value;
}

/** Rules that involve more than one field or the values inside a tensor; shared by both directions. */
export function checkCrossFields(
  t: FrameType,
  o: Record<string, unknown>,
  ctx: Checker,
  maxExpert?: number,
): void {
  if (t !== "dispatch") return;
  if (o.compact === true && o.mode !== "each") {
    ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "compact", 'compact results exist for mode "each" only');
  }
  if (o.mode === "sum" && o.w === undefined) {
    ctx.fail("MOESWARM_PROTOCOL_MISSING_FIELD", "w", 'router weights are required for mode "sum"');
  }
  const ids = o.ids as Int32Array;
  const limit = maxExpert ?? 0x8000_0000;
  // one unsigned compare per slot: e in -1..limit-1 is e+1 in 0..limit (e+1 of an int32 >= -2^31+1)
  const bound = limit + 1;
  for (let i = 0; i < ids.length; i++) {
    if ((ids[i]! + 1) >>> 0 >= bound) badId(ids, limit, maxExpert, ctx);
  }
  const w = o.w as Float32Array | undefined;
  if (w) {
    // v - v is 0 for a finite v and NaN for an infinite or NaN one: a subtraction and a compare
    // per slot, no call
    for (let i = 0; i < w.length; i++) {
      const v = w[i]!;
      if (v - v !== 0) ctx.fail("MOESWARM_PROTOCOL_BAD_FIELD", "w", `slot ${i} weight ${v} is not finite`);
    }
  }
}

function badId(ids: Int32Array, limit: number, maxExpert: number | undefined, ctx: Checker): never {
  const i = ids.findIndex((e) => e < -1 || e >= limit);
  return ctx.fail(
    "MOESWARM_PROTOCOL_BAD_FIELD",
    "ids",
    `slot ${i} holds expert id ${ids[i]}, outside -1..${limit - 1}${maxExpert !== undefined ? " (maxExpert)" : ""}`,
  );
}

export const byteLength = (s: string): number => Buffer.byteLength(s, "utf8");
export const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

export function checkStrValue(
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

/** Bytes of a dispatch's q8_0 / q8_K rows (`x`), failing when embd is not a whole number of blocks. */
export function quantizedXBytes(
  dtype: QuantizedActivationDtype,
  n: number,
  embd: number,
  ctx: Checker,
): number {
  const bytes = quantizedActivationBytes(dtype, n, embd);
  if (bytes === 0)
    ctx.fail("MOESWARM_PROTOCOL_BAD_LENGTH", "x", `embd ${embd} is not a whole number of ${dtype} blocks`);
  return bytes;
}

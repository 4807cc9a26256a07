import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import { GGML_MAX_NAME } from "./gguf-constants.js";

/**
 * Bounds the reader enforces before it allocates anything a file asks for. The defaults sit far
 * above every real model (a 262k-token vocabulary, ~2k tensors for a 1T-parameter MoE) and far
 * below what would hurt a process; tighten them for untrusted input in small services.
 */
export interface GgufLimits {
  /** Most bytes of one string (key, value, array element, tensor name). */
  readonly maxStringBytes: number;
  /** Most elements of one metadata array. */
  readonly maxArrayLength: number;
  /** Most array elements summed over all metadata (nested arrays included). */
  readonly maxMetadataElements: number;
  /** Deepest nesting of arrays inside arrays (1 = arrays of scalars only). */
  readonly maxArrayDepth: number;
  /** Most metadata key/value pairs. */
  readonly maxKvCount: number;
  /** Most tensor infos. */
  readonly maxTensorCount: number;
  /** Longest tensor name in bytes (ggml stores names in `char[GGML_MAX_NAME]`). */
  readonly maxTensorNameBytes: number;
  /** Most bytes of header (magic through the last tensor info) the reader will fetch. */
  readonly maxHeaderBytes: number;
}

export const DEFAULT_GGUF_LIMITS: GgufLimits = Object.freeze({
  maxStringBytes: 64 * 1024 * 1024,
  maxArrayLength: 16 * 1024 * 1024,
  maxMetadataElements: 32 * 1024 * 1024,
  maxArrayDepth: 8,
  maxKvCount: 1024 * 1024,
  maxTensorCount: 1024 * 1024,
  maxTensorNameBytes: GGML_MAX_NAME - 1,
  maxHeaderBytes: 256 * 1024 * 1024,
});

// A header lives in one ArrayBuffer, so nothing above this can be read whatever the options say.
const HARD_MAX_HEADER_BYTES = 2 ** 31 - 1;

/** Defaults overridden by `partial`, each checked to be a positive safe integer. */
export function resolveGgufLimits(partial: Partial<GgufLimits> | undefined): GgufLimits {
  if (partial === undefined) return DEFAULT_GGUF_LIMITS;
  if (typeof partial !== "object" || partial === null) {
    throw new InvalidArgumentError("limits must be an object");
  }
  const out: Record<string, number> = { ...DEFAULT_GGUF_LIMITS };
  for (const [name, value] of Object.entries(partial)) {
    if (!(name in DEFAULT_GGUF_LIMITS)) {
      throw new InvalidArgumentError(`unknown GGUF limit ${name}`);
    }
    if (value === undefined) continue;
    if (typeof value !== "number" || !Number.isSafeInteger(value) || value < 0) {
      throw new InvalidArgumentError(
        `GGUF limit ${name} must be a non-negative safe integer, got ${String(value)}`,
      );
    }
    out[name] = value;
  }
  out.maxHeaderBytes = Math.min(out.maxHeaderBytes!, HARD_MAX_HEADER_BYTES);
  return Object.freeze(out) as unknown as GgufLimits;
}

/**
 * A 64-bit count or offset from the file as a number, or a GgufError with `code` when it does not
 * fit in `max` (at most 2^53 - 1, where a number stops being exact).
 */
export function checkedNumber(
  value: bigint,
  what: string,
  code: "MOESWARM_GGUF_LIMIT" | "MOESWARM_GGUF_BAD_TENSOR" | "MOESWARM_GGUF_BAD_OFFSET",
  max: number = Number.MAX_SAFE_INTEGER,
): number {
  if (value < 0n || value > BigInt(max)) {
    throw new GgufError(code, `${what} is ${value}, above the limit ${max}`, {
      details: { what, value: value.toString(), max },
    });
  }
  return Number(value);
}

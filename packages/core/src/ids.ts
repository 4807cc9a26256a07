import { InvalidArgumentError } from "./errors.js";

/** One routed expert of one layer, by global index. */
export interface ExpertRef {
  readonly layer: number;
  readonly expert: number;
}

/** A half-open integer range `[start, end)`, written `start:end`. */
export interface Range {
  readonly start: number;
  readonly end: number;
}

/** Largest value a range bound may take unless a smaller `max` is given (2^31 - 1). */
export const RANGE_LIMIT = 0x7fff_ffff;

const DIGITS = /^(0|[1-9][0-9]{0,9})$/;

function bound(text: string, input: string): number {
  if (!DIGITS.test(text)) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_RANGE",
      `range ${JSON.stringify(input)}: "${text}" is not a non-negative integer`,
    );
  }
  return Number(text);
}

/**
 * Parses `a:b` (half-open, `a < b`). A single integer `a` means `a:a+1`. `max` bounds `b`
 * (e.g. the number of experts), so `0:300` fails for a 256-expert model.
 */
export function parseRange(input: string, options: { max?: number } = {}): Range {
  if (typeof input !== "string") {
    throw new InvalidArgumentError("MOESWARM_INVALID_RANGE", "a range must be a string like 0:8");
  }
  const max = options.max ?? RANGE_LIMIT;
  const parts = input.trim().split(":");
  if (parts.length > 2 || parts.some((p) => p.length === 0)) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_RANGE",
      `range ${JSON.stringify(input)}: expected a:b or a`,
    );
  }
  const start = bound(parts[0]!, input);
  const end = parts.length === 2 ? bound(parts[1]!, input) : start + 1;
  if (end <= start) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_RANGE",
      `range ${JSON.stringify(input)}: end must be greater than start`,
    );
  }
  if (end > max) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_RANGE",
      `range ${JSON.stringify(input)}: end ${end} exceeds the limit ${max}`,
      {
        details: { max },
      },
    );
  }
  return { start, end };
}

/** Validates a range given as numbers (same rules as {@link parseRange}). */
export function checkRange(range: Range, options: { max?: number } = {}): Range {
  const max = options.max ?? RANGE_LIMIT;
  const { start, end } = range;
  if (!Number.isSafeInteger(start) || !Number.isSafeInteger(end) || start < 0 || end <= start || end > max) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_RANGE",
      `invalid range ${String(start)}:${String(end)} (limit ${max})`,
    );
  }
  return range;
}

export function formatRange(range: Range): string {
  return `${range.start}:${range.end}`;
}

export function rangeLength(range: Range): number {
  return range.end - range.start;
}

export function* rangeValues(range: Range): Generator<number> {
  for (let i = range.start; i < range.end; i++) yield i;
}

/** Compresses sorted or unsorted integers into the fewest half-open ranges. */
export function toRanges(values: Iterable<number>): Range[] {
  const sorted = [...new Set(values)].sort((a, b) => a - b);
  const out: Range[] = [];
  for (const v of sorted) {
    const last = out[out.length - 1];
    if (last && last.end === v) out[out.length - 1] = { start: last.start, end: v + 1 };
    else out.push({ start: v, end: v + 1 });
  }
  return out;
}

/** A stable string key for maps: `layer:expert`. */
export function expertKey(ref: ExpertRef): string {
  return `${ref.layer}:${ref.expert}`;
}

import { isMoeswarmError, type Range } from "@moeswarm/core";

// Small helpers of the run: error text for events, poll jitter, range expansion.

export function message(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

export function codeOf(error: unknown): string {
  return isMoeswarmError(error) ? error.code : "MOESWARM_DISPATCH_FAILED";
}

export function jitter(ms: number): number {
  return Math.round(ms * (0.8 + 0.4 * Math.random()));
}

export function rangeValues(r: Range): number[] {
  return Array.from({ length: r.end - r.start }, (_, i) => r.start + i);
}

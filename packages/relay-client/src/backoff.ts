import { InvalidArgumentError } from "@moeswarm/core";

export interface ReconnectOptions {
  /** Delay before the first attempt after a drop (default 250 ms). */
  initialDelayMs?: number;
  /** Ceiling of the delay (default 30 s). */
  maxDelayMs?: number;
  /** Growth per attempt (default 2). */
  factor?: number;
  /** Fraction of each delay that is randomised away, 0..1 (default 0.5). */
  jitter?: number;
  /** Give up after this many failed attempts in a row (default: never). */
  maxAttempts?: number;
}

export type Backoff = Required<ReconnectOptions>;

function positive(name: string, value: number, min: number): number {
  if (typeof value !== "number" || !(value >= min)) {
    throw new InvalidArgumentError(`reconnect.${name} must be a number >= ${min}`);
  }
  return value;
}

export function normalizeBackoff(options: ReconnectOptions = {}): Backoff {
  const b: Backoff = {
    initialDelayMs: positive("initialDelayMs", options.initialDelayMs ?? 250, 0),
    maxDelayMs: positive("maxDelayMs", options.maxDelayMs ?? 30_000, 0),
    factor: positive("factor", options.factor ?? 2, 1),
    jitter: positive("jitter", options.jitter ?? 0.5, 0),
    maxAttempts: positive("maxAttempts", options.maxAttempts ?? Number.POSITIVE_INFINITY, 1),
  };
  if (b.jitter > 1) throw new InvalidArgumentError("reconnect.jitter must be <= 1");
  return b;
}

/**
 * Delay before attempt `attempt` (1-based): exponential up to the ceiling, less a random share of
 * up to `jitter` of it, so that many clients dropped by one relay restart do not return in step.
 */
export function backoffDelay(attempt: number, backoff: Backoff, random: () => number = Math.random): number {
  const base = Math.min(
    backoff.maxDelayMs,
    backoff.initialDelayMs * backoff.factor ** Math.max(0, attempt - 1),
  );
  return Math.round(base * (1 - backoff.jitter * random()));
}

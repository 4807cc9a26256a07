import { InvalidArgumentError } from "@moeswarm/core";

/**
 * How demand turns into replica targets and values. The formula is written out, with a worked
 * example, in README.md "Demand"; the functions below are it, term by term.
 */
export interface DemandPolicy {
  /** Half-life of the routing counts (ms): a count reported this long ago weighs half. */
  readonly halfLifeMs: number;
  /** Pseudo-count added to every expert, so a few reports do not make an expert hot. */
  readonly prior: number;
  /** One replica per this many times the average load of an expert of its layer. */
  readonly hotLoad: number;
  /** Most replicas any expert is asked for. */
  readonly maxReplicas: number;
  /**
   * Distinct workers every expert needs before it counts as covered (the least target). The hub
   * defaults to 2, so each expert part has two independent owners whose answers a backbone can
   * compare; a CoverageMarket on its own defaults to 1. Raises maxReplicas when above it.
   */
  readonly replicas: number;
  /** Value of giving an expert with no replica (live or leased) its first one. */
  readonly uncoveredValue: number;
}

export const DEFAULT_DEMAND_POLICY: DemandPolicy = Object.freeze({
  halfLifeMs: 600_000,
  prior: 1,
  hotLoad: 2,
  maxReplicas: 4,
  replicas: 1,
  uncoveredValue: 100,
});

function finitePositive(name: string, value: number): number {
  if (typeof value !== "number" || !Number.isFinite(value) || value <= 0) {
    throw new InvalidArgumentError(`market option ${name} must be a number > 0`);
  }
  return value;
}

/** The policy with `overrides` applied and checked (InvalidArgumentError on a bad value). */
export function demandPolicy(overrides: Partial<DemandPolicy> = {}): DemandPolicy {
  const p = { ...DEFAULT_DEMAND_POLICY, ...overrides };
  finitePositive("halfLifeMs", p.halfLifeMs);
  finitePositive("hotLoad", p.hotLoad);
  finitePositive("uncoveredValue", p.uncoveredValue);
  if (typeof p.prior !== "number" || !Number.isFinite(p.prior) || p.prior < 0) {
    throw new InvalidArgumentError("market option prior must be a number >= 0");
  }
  if (!Number.isInteger(p.maxReplicas) || p.maxReplicas < 1 || p.maxReplicas > 1024) {
    throw new InvalidArgumentError("market option maxReplicas must be an integer in 1..1024");
  }
  if (!Number.isInteger(p.replicas) || p.replicas < 1 || p.replicas > 1024) {
    throw new InvalidArgumentError("market option replicas must be an integer in 1..1024");
  }
  return Object.freeze(p);
}

/** `2^(-dt / halfLife)`; 1 when the clock did not advance (or went back). */
export function decayFactor(dtMs: number, halfLifeMs: number): number {
  return dtMs > 0 ? 2 ** (-dtMs / halfLifeMs) : 1;
}

/**
 * An expert's load relative to the average expert of its layer:
 * `h = n * (d + prior) / (D + n * prior)` with `d` its decayed count, `D` the layer's sum and `n`
 * the layer's experts. 1 for every expert of a layer nobody reported (or with `prior` alone).
 */
export function hotness(count: number, layerTotal: number, nExpert: number, prior: number): number {
  const denominator = layerTotal + nExpert * prior;
  return denominator > 0 ? (nExpert * (count + prior)) / denominator : 1;
}

/**
 * `clamp(ceil(h / hotLoad), replicas, max(maxReplicas, replicas))`, with a 1e-9 allowance against
 * rounding noise.
 */
export function targetReplicas(h: number, policy: DemandPolicy): number {
  const t = Math.ceil(h / policy.hotLoad - 1e-9);
  const least = policy.replicas ?? 1;
  return Math.min(Math.max(policy.maxReplicas, least), Math.max(least, t));
}

/**
 * What one more replica of an expert is worth, given its load `h`, its target and the replicas it
 * has (`live + pending`): `missing * h`, plus `uncoveredValue` when it has none at all.
 */
export function cellValue(h: number, target: number, have: number, policy: DemandPolicy): number {
  const missing = target - have;
  if (missing <= 0) return 0;
  return (have === 0 ? policy.uncoveredValue : 0) + h * missing;
}

/**
 * Decayed routing counts of one model: one f64 per (layer, expert) cell, all referred to one
 * instant `at` (ms). Adding decays everything to the new instant first, so the result depends on
 * the timestamps only, never on when the hub happened to look.
 */
export class DemandCounters {
  readonly counts: Float64Array;
  at: number;

  constructor(cells: number, at: number, counts?: Float64Array) {
    this.counts = counts ?? new Float64Array(cells);
    this.at = at;
  }

  /** Brings every count to `now` (no change when `now` is not later than `at`). */
  decayTo(now: number, halfLifeMs: number): void {
    if (!(now > this.at)) return;
    const f = decayFactor(now - this.at, halfLifeMs);
    const c = this.counts;
    for (let i = 0; i < c.length; i++) c[i] = (c[i] as number) * f;
    this.at = now;
  }

  /** Adds `values` to the cells from `offset`, after decaying to `now`. */
  add(offset: number, values: ArrayLike<number>, now: number, halfLifeMs: number): void {
    this.decayTo(now, halfLifeMs);
    const c = this.counts;
    for (let i = 0; i < values.length; i++) c[offset + i] = (c[offset + i] as number) + (values[i] as number);
  }
}

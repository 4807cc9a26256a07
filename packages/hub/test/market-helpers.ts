import { isMoeswarmError } from "@moeswarm/core";

export { DemandCounters, demandPolicy, hotness, targetReplicas } from "../src/demand.js";
export { CoverageMarket, type MarketModel } from "../src/market.js";

/** A MOESWARM_HUB_CONFLICT refusal with this `details.reason`. */
export function isMoeswarmHubConflict(error: unknown, reason: string): boolean {
  return isMoeswarmError(error, "MOESWARM_HUB_CONFLICT") && error.details?.reason === reason;
}

/** mulberry32: a small seeded PRNG, so a simulation replays exactly. */
export function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

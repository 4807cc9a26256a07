import { isMoeswarmError } from "@moeswarm/core";

export { DemandCounters, demandPolicy, hotness, targetReplicas } from "../src/demand.js";
export { CoverageMarket, type MarketModel } from "../src/market.js";

/** A MOESWARM_HUB_CONFLICT refusal with this `details.reason`. */
export function isMoeswarmHubConflict(error: unknown, reason: string): boolean {
  return isMoeswarmError(error, "MOESWARM_HUB_CONFLICT") && error.details?.reason === reason;
}

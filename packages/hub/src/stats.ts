import { parseStatsReport as parseReport, type StatsReport } from "@moeswarm/core";
import type { MarketModel } from "./market.js";

// The report's body and its parser are core's (hub-api.ts), shared with the backbones that send it.
export { MAX_RECEIPTS, type ReceiptJson as Receipt, type StatsReport } from "@moeswarm/core";

/**
 * A backbone's periodic report (POST /api/models/:model/stats, JSON), checked against the
 * model; HubError MOESWARM_HUB_BAD_REQUEST says what is wrong. Field by field in README.md
 * "Backbone stats".
 */
export function parseStatsReport(body: unknown, model: MarketModel): StatsReport {
  return parseReport(body, model);
}

// What the bridge reports to the hub, between the two modules that share it: the bridge produces
// it (`takeStatsReport`), the hub link sends it. Its own module so neither imports the other for it;
// the body's one definition is core's (hub-api.ts), which the hub parses.
import type { ReceiptJson, StatsReportJson } from "@moeswarm/core";

/**
 * What happened since the previous report: core's stats body (`POST /api/models/:model/stats`)
 * with the fields the bridge always fills, without `seq` and `backbone`, which the reporter adds.
 * `tokens` counts what went through the lowest remote layer (every ubatch passes there whole);
 * `counts` are per layer (decimal key) plain arrays, one count per expert.
 */
export type BridgeStatsReport = Required<Pick<StatsReportJson, "tokens" | "ms">> & {
  counts: Record<string, number[]>;
  receipts: Record<string, ReceiptJson>;
};

/** Where reports come from: the bridge (`takeStatsReport`). */
export interface StatsSource {
  takeStatsReport(options: { nExpert: number }): BridgeStatsReport;
}

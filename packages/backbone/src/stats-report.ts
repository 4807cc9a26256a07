// What the bridge reports to the hub, between the two modules that share it: the bridge produces
// it (`takeStatsReport`), the hub link sends it. Its own module so neither imports the other for
// it; when the hub's request bodies get one shared definition, this file is where it is re-pointed.

/**
 * What happened since the previous report, in the shape of the hub's backbone stats
 * (`POST /api/models/:model/stats`, without `seq` and `backbone`, which the reporter adds).
 */
export interface BridgeStatsReport {
  /** Tokens that went through the lowest remote layer (every ubatch passes there whole). */
  tokens: number;
  /** The report's span, ms. */
  ms: number;
  /** Per layer (decimal key): how many (token, slot) selections chose each expert, one count per expert. */
  counts: Record<string, number[]>;
  /** Per worker: the (token, expert) pairs it computed and returned, and its mean round trip, ms. */
  receipts: Record<string, { expertTokens: number; ms?: number }>;
}

/** Where reports come from: the bridge (`takeStatsReport`). */
export interface StatsSource {
  takeStatsReport(options: { nExpert: number }): BridgeStatsReport;
}

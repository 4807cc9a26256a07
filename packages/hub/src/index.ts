// Public API of @moeswarm/hub: the hub service (HTTP API + relay on one server), the relay on
// its own, the coverage market, auth tokens, and the stores that keep state across restarts.

export type { ConnectionGuard, ConnectionLimits, ConnectionRefusal } from "./connection-guard.js";
export {
  cellValue,
  DEFAULT_DEMAND_POLICY,
  type DemandPolicy,
  decayFactor,
  hotness,
  targetReplicas,
} from "./demand.js";
export { ENROL_BURST, ENROL_PER_MINUTE, type EnrolmentLimits } from "./enrolment.js";
export {
  type HubErrorBody,
  httpStatusOf,
} from "./http-errors.js";
export { createHub, createHubHandler } from "./hub.js";
export type {
  Hub,
  HubEvent,
  HubListener,
  HubMarketOptions,
  HubModelSource,
  HubOptions,
  HubStatus,
} from "./hub-types.js";
export { type ListenRelayOptions, listenRelay, type RelayListener } from "./listen.js";
export {
  createLoopbackCertificates,
  type LoopbackCertificateOptions,
  type LoopbackCertificates,
} from "./loopback-tls.js";
export {
  type AutoClaimRequest,
  type ClaimRequest,
  type CoverageGrid,
  CoverageMarket,
  type CoverageSummary,
  type CreditRow,
  type DemandRange,
  type Lease,
  type MarketChanges,
  type MarketLayer,
  type MarketModel,
  type MarketOptions,
  type PlacementJson,
  type PlacementRegistration,
  type StoredDemandRow,
  type WorkerCapacity,
} from "./market.js";
export type { BackboneRate } from "./market-book.js";
export type { LeaseJson } from "./market-http.js";
export { HubMetrics, type MarketFigures, type RouteLabel } from "./metrics.js";
export { defaultModelId, type ModelInfo } from "./model.js";
export {
  type BackboneInfo,
  createRelay,
  type Relay,
  type RelayOptions,
  type RelayServerEvent,
  type RelayStats,
  type SliceInfo,
  type WorkerInfo,
} from "./relay.js";
export {
  loadSqliteDriver,
  SQLITE_DRIVERS,
  type SqliteDatabase,
  type SqliteDriver,
  type SqliteDriverName,
  type SqliteStatement,
  type SqliteTransaction,
} from "./sqlite-driver.js";
export {
  createMemoryStore,
  type HubStore,
  isModelId,
  type MarketWrite,
  type StoredCredit,
  type StoredLease,
  type StoredModel,
  type StoredSlice,
  type StoredStatsSeq,
  type StoredWorker,
} from "./store.js";
export { openSqliteStore, SQLITE_SCHEMA_VERSION, type SqliteStoreOptions } from "./store-sqlite.js";
export {
  checkSecret,
  type MintTokenOptions,
  mintToken,
  principalOf,
  type TokenClaims,
  type TokenRole,
  type TokenSecret,
  type VerifyTokenOptions,
  verifyToken,
} from "./token.js";
export type { HubWorkerInfo } from "./worker-book.js";

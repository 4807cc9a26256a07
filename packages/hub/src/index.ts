// Public API of @moeswarm/hub: the hub service (HTTP API + relay on one server), the relay on
// its own, auth tokens, and the stores that keep models and workers across restarts.
export {
  type HubErrorBody,
  httpStatusOf,
} from "./http-errors.js";
export {
  createHub,
  createHubHandler,
  type Hub,
  type HubEvent,
  type HubListener,
  type HubModelSource,
  type HubOptions,
} from "./hub.js";
export { type ListenRelayOptions, listenRelay, type RelayListener } from "./listen.js";
export { HubMetrics, type RouteLabel } from "./metrics.js";
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
  createMemoryStore,
  type HubStore,
  isModelId,
  type StoredModel,
  type StoredSlice,
  type StoredWorker,
} from "./store.js";
export { openSqliteStore, SQLITE_SCHEMA_VERSION, type SqliteStoreOptions } from "./store-sqlite.js";
export {
  checkSecret,
  type MintTokenOptions,
  mintToken,
  type TokenClaims,
  type TokenRole,
  type TokenSecret,
  type VerifyTokenOptions,
  verifyToken,
} from "./token.js";
export type { HubWorkerInfo } from "./worker-book.js";

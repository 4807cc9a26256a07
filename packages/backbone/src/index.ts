// Public API of @moeswarm/backbone: llama.cpp as the backbone, unmodified.
export {
  type BackboneBridge,
  type BackboneBridgeOptions,
  type BackboneHubOptions,
  serveBackboneBridge,
} from "./bridge.js";
export type { BridgeLayerLatency, BridgeMetrics, BridgeRequestStats } from "./bridge-metrics.js";
export {
  type LogitsHarnessOptions,
  type LogitsHarnessPlugin,
  type LogitsHarnessResult,
  type PluginStats,
  readLogits,
  runLogitsHarness,
} from "./harness.js";
export type { HubLinkError, HubLinkEvent, StatsOutcome } from "./hub-events.js";
export type { HubCa, HubToken } from "./hub-http.js";
export { connectHub, type HubLink, type HubLinkMetrics } from "./hub-link.js";
export type { HubLinkOptions } from "./hub-options.js";
export { type HubPlacement, parseHubPlacement } from "./hub-placement.js";
export {
  formatLayerSelection,
  type LayerSelection,
  moeswarmOverride,
  parseLayerSelection,
} from "./layers.js";
export {
  type BridgeNativeOptions,
  DEFAULT_NATIVE_DEADLINE_MS,
  type NativeMetrics,
} from "./native-bridge.js";
export { logitsHarnessPath, pluginPath } from "./native-paths.js";
export {
  decodeNativeFrame,
  encodeNativeTable,
  NATIVE_FRAME_TYPES,
  type NativeAltEntry,
  type NativeHelloFrame,
  type NativeReceiptCount,
  type NativeReceiptFailure,
  type NativeReceiptsFrame,
  type NativeTableEntry,
  type NativeTableFrame,
} from "./native-plane.js";
export {
  type NativePlanCandidate,
  type NativeRoute,
  nativeLayerOwners,
  nativeWorkers,
  replicaLayerPlan,
  wholeLayerOwners,
} from "./native-table.js";
export type { BridgeSocket } from "./plugin-socket.js";
export type { RoutingCount } from "./routing-stats.js";
export type { BridgeStatsReport, StatsSource } from "./stats-report.js";
export { createSwarmLlama, type SwarmLlama, type SwarmLlamaOptions } from "./swarm-llama.js";
export {
  createLocalFallback,
  expertComputeHandler,
  type LocalFallback,
  type LocalFallbackOptions,
} from "./worker-handler.js";

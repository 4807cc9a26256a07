// Public API of @moeswarm/backbone: llama.cpp as the backbone, unmodified.
export {
  type BackboneBridge,
  type BackboneBridgeOptions,
  type BackboneHubOptions,
  type BridgeLayerLatency,
  type BridgeMetrics,
  type BridgeRequestStats,
  type BridgeSocket,
  type RoutingCount,
  serveBackboneBridge,
} from "./bridge.js";
export {
  type LogitsHarnessOptions,
  type LogitsHarnessPlugin,
  type LogitsHarnessResult,
  type PluginStats,
  readLogits,
  runLogitsHarness,
} from "./harness.js";
export {
  connectHub,
  type HubCa,
  type HubLink,
  type HubLinkError,
  type HubLinkEvent,
  type HubLinkMetrics,
  type HubLinkOptions,
  type HubPlacement,
  type HubToken,
  parseHubPlacement,
  type StatsOutcome,
} from "./hub-link.js";
export {
  formatLayerSelection,
  type LayerSelection,
  moeswarmOverride,
  parseLayerSelection,
} from "./layers.js";
export { logitsHarnessPath, pluginPath } from "./native-paths.js";
export type { BridgeStatsReport, StatsSource } from "./stats-report.js";
export { createSwarmLlama, type SwarmLlama, type SwarmLlamaOptions } from "./swarm-llama.js";
export {
  createLocalFallback,
  expertComputeHandler,
  type LocalFallback,
  type LocalFallbackOptions,
} from "./worker-handler.js";

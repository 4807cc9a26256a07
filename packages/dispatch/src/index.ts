// Public API of @moeswarm/dispatch.

// The expert contract is core's (one definition for every package); re-exported so dispatch's
// users need not import core for it.
export type {
  ExpertCallOptions,
  ExpertHandler,
  ExpertRequest,
  ExpertResult,
  ExpertTransport,
} from "@moeswarm/core";
export {
  type ActivationSpec,
  activate,
  type ExpertActivation,
  normalizeActivation,
  SWIGLU_OAI_ALPHA,
  SWIGLU_OAI_LIMIT,
} from "./activation.js";
export { emptyCallMetrics } from "./call-state.js";
export { combineEach, partialSumF32 } from "./combine.js";
export { combineBackend } from "./combine-wasm.js";
export {
  type DispatchOptions,
  type DispatchResult,
  dispatchExperts,
  dispatchExpertsDetailed,
  dispatchExpertsF64,
} from "./dispatch.js";
export {
  type GgufExpertWeights,
  type LoadExpertWeightsOptions,
  loadExpertWeightsFromGguf,
} from "./gguf-weights.js";
export { Liveness, type LivenessOptions, type LivenessSnapshot } from "./liveness.js";
export {
  type DispatchCallMetrics,
  DispatchMetrics,
  type DispatchMetricsSnapshot,
  FALLBACK_OWNER,
  type OwnerCallMetrics,
  type OwnerTotals,
  REFERENCE_OWNER,
} from "./metrics.js";
export {
  checkRouting,
  type ExpertMatrices,
  type ExpertShape,
  type ExpertWeights,
  expertForwardF64,
  expertShape,
  type ReferenceMoeOptions,
  referenceMoe,
} from "./oracle.js";
export {
  type MissingExperts,
  Placement,
  type PlacementOptions,
  type WorkerRegistration,
} from "./placement.js";
export {
  createReferenceWorker,
  type ReferenceWorkerOptions,
  validateExpertRequest,
} from "./reference-worker.js";
export {
  GATING_FUNCTION_IDS,
  type GatingFunction,
  type RouteOptions,
  type RouterInput,
  type Routing,
  type RoutingConfig,
  route,
  type SelectionSource,
  validateRoutingConfig,
  WEIGHT_SUM_CLAMP,
} from "./route.js";
export {
  type ArchRoutingSpec,
  type GatingRule,
  type GgufMetadataInput,
  type GgufRoutingConfig,
  ROUTING_ARCHITECTURES,
  routingConfigFromGguf,
} from "./routing-config.js";
export {
  DEFAULT_MIN_COSINE,
  DEFAULT_NORM_TOLERANCE,
  type PartComparison,
  type QuarantineEvent,
  SpotCheck,
  type SpotCheckOptions,
  type SpotCheckSnapshot,
} from "./spot-check.js";
export { InProcessTransport } from "./transport-inproc.js";
export { serveExpertThread, type ThreadWorkerSpec, WorkerThreadTransport } from "./transport-threads.js";
export {
  emptyVerificationStats,
  Verification,
  type VerificationEvent,
  type VerificationOptions,
  type VerificationStats,
} from "./verification.js";
export {
  QuantizingTransport,
  type QuantizingTransportOptions,
  quantizingTransport,
  type WireQuantizeMetrics,
} from "./wire-quantize.js";

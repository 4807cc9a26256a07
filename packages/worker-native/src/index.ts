// Public API of @moeswarm/worker-native.
export {
  ACTIVATIONS,
  type Activation,
  type ComputeBackend,
  type ExpertCompute,
  type ExpertComputeInfo,
  type LayerTensors,
  type RunMode,
  type RunOptions,
  type RunRequest,
} from "./expert-compute.js";
export {
  type LlamaCppBinsOptions,
  type LoadLlamaCpuOptions,
  llamaCppBinsDir,
  llamaCpuAddonPath,
  llamaExpertWorkerPath,
  loadLlamaCpuCompute,
  type SpawnLlamaExpertWorkerOptions,
  spawnLlamaExpertWorker,
} from "./llama-cpu.js";
export { type LoadExpertComputeOptions, loadExpertCompute } from "./load.js";
export {
  ggmlDequantize,
  ggmlQuantize,
  type NativeCandidate,
  type NativeStatus,
  nativeStatus,
  probeNative,
} from "./native-binding.js";
export { NativeExpertCompute, type NativeLoadOptions } from "./native-compute.js";
// Worker runtime: the autonomous participation loop and its pieces.
export {
  chooseSlices,
  compareChoices,
  type DemandRangeInput,
  type SliceChoice,
  type SliceRect,
} from "./runtime/choose.js";
export {
  type DownloadOptions,
  type DownloadProgress,
  type DownloadResult,
  type DownloadRetry,
  downloadResumable,
} from "./runtime/download.js";
export {
  formatBytes,
  formatWorkerEvent,
  type WorkerEvent,
  type WorkerEventBody,
  type WorkerEventName,
} from "./runtime/events.js";
export type { CaOption } from "./runtime/http.js";
export {
  type RunWorkerOptions,
  runWorker,
  type WorkerBackend,
  type WorkerSliceSummary,
  type WorkerSummary,
} from "./runtime/run-worker.js";
export {
  type CachedSlice,
  type CachedSliceMeta,
  listCachedSlices,
  type PrunedSlice,
  type PruneOptions,
  type PruneResult,
  pruneSliceCache,
} from "./runtime/slice-cache.js";
export { type SliceLayer, type SliceLayout, type SliceTensor, sliceLayout } from "./slice-layout.js";
export { TsExpertCompute, type TsLoadOptions } from "./ts-compute.js";
export {
  type ArmVariant,
  armVariantFor,
  type ExpertWorkerPathOptions,
  expertWorkerPath,
  type WorkerTarget,
} from "./worker-binary.js";
export { type SpawnExpertWorkerOptions, spawnExpertWorker, WorkerProcessCompute } from "./worker-process.js";

// Public API of @moeswarm/worker: the autonomous participation loop (runWorker, the
// `moeswarm-worker` bin) and its pieces.

/** PEM CA certificate(s) to trust for a self-hosted hub: relay-client's `HubCa`. */
export type { HubCa as CaOption } from "@moeswarm/relay-client";
export {
  chooseSlices,
  compareChoices,
  type DemandRangeInput,
  type SliceChoice,
  type SliceRect,
} from "./choose.js";
export { runWorkerCli, type WorkerCliIo } from "./cli.js";
export { workerCliPath } from "./cli-path.js";
export type { DirectOptions } from "./direct.js";
export {
  type DownloadOptions,
  type DownloadProgress,
  type DownloadResult,
  type DownloadRetry,
  downloadResumable,
} from "./download.js";
export {
  formatBytes,
  formatWorkerEvent,
  type WorkerEvent,
  type WorkerEventBody,
  type WorkerEventName,
} from "./events.js";
export type { NativeListenOptions } from "./native.js";
export {
  type PowerOptions,
  type PowerReading,
  type PowerState,
  PowerWatch,
  readPower,
} from "./power.js";
export {
  type RunWorkerOptions,
  runWorker,
  type WorkerSliceSummary,
  type WorkerSummary,
} from "./run-worker.js";
export {
  type CachedSlice,
  type CachedSliceMeta,
  cacheSlice,
  listCachedSlices,
  type PrunedSlice,
  type PruneOptions,
  type PruneResult,
  pruneSliceCache,
} from "./slice-cache.js";

// Public API of @moeswarm/worker-native.

export { loadActivationQuantizer } from "./activation-quantizer.js";
export {
  CUDA_PACKAGE,
  CUDA_TYPES,
  type CudaOptions,
  type CudaStatus,
  cudaBinsDir,
  probeCuda,
  type SpawnCudaExpertWorkerOptions,
  spawnCudaExpertWorker,
} from "./cuda.js";
export {
  ACTIVATIONS,
  type Activation,
  BACKEND_CHOICES,
  type BackendChoice,
  type ComputeBackend,
  checkRunRequest,
  type ExpertCompute,
  type ExpertComputeInfo,
  GPU_BACKEND_CHOICES,
  isBackendChoice,
  type LayerTensors,
  type RunMode,
  type RunOptions,
  type RunRequest,
} from "./expert-compute.js";
export {
  GPU_MAX_BATCH_ROWS,
  GPU_RESERVE_SHAPE,
  type GpuDevice,
  type GpuStatus,
  gpuComputeReserveBytes,
  gpuDriverError,
  gpuVramMargin,
  gpuVramOffer,
} from "./gpu-build.js";
export {
  type LlamaCppBinsOptions,
  type LoadLlamaCpuOptions,
  llamaCppBinsDir,
  llamaCpuAddonPath,
  llamaExpertWorkerPath,
  loadLlamaCpuCompute,
  NODE_LLAMA_CPP_VERSION,
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
export { NativeExpertCompute, type NativeLoadOptions, SYNC_MAX_TOKENS } from "./native-compute.js";
export {
  type NativeRoute,
  type NativeServed,
  type NativeServer,
  type NativeServerOptions,
  type NativeSlice,
  nativeSliceOf,
  serveNative,
} from "./native-server.js";
export {
  NATIVE_TARGETS,
  type NativeTarget,
  platformPackageName,
  prebuiltPath,
} from "./prebuilt.js";
export { type SliceLayer, type SliceLayout, type SliceTensor, sliceLayout } from "./slice-layout.js";
export { TsExpertCompute, type TsLoadOptions } from "./ts-compute.js";
export {
  probeVulkan,
  type SpawnVulkanExpertWorkerOptions,
  spawnVulkanExpertWorker,
  VULKAN_PACKAGE,
  VULKAN_TYPES,
  type VulkanDevice,
  type VulkanOptions,
  type VulkanStatus,
  vulkanBinsDir,
} from "./vulkan.js";
export {
  type ArmVariant,
  armVariantFor,
  type ExpertWorkerPathOptions,
  expertWorkerPath,
  type WorkerTarget,
} from "./worker-binary.js";
export { autoBackendFor, staticWorkerExecutable } from "./worker-fallback.js";
export { type SpawnExpertWorkerOptions, spawnExpertWorker, WorkerProcessCompute } from "./worker-process.js";

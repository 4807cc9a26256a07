// Public API of @moeswarm/shard.

export {
  type ByteSource,
  type ByteSourceInput,
  bufferSource,
  fileSource,
  type HttpSourceOptions,
  httpSource,
  openByteSource,
  type ReadOptions,
} from "./byte-source.js";
export {
  GGML_TYPES,
  GgmlType,
  type GgmlTypeTraits,
  ggmlRowBytes,
  ggmlTensorBytes,
  ggmlTypeName,
  ggmlTypeTraits,
  isGgmlType,
} from "./ggml-type.js";
export {
  GGML_MAX_DIMS,
  GGML_MAX_NAME,
  GGUF_DEFAULT_ALIGNMENT,
  GGUF_KEY_GENERAL_ALIGNMENT,
  GGUF_MAGIC,
  GGUF_TYPE_COUNT,
  GGUF_VERSION,
  GgufValueType,
  ggufScalarSize,
  ggufValueTypeName,
  isGgufValueType,
} from "./gguf-constants.js";
export { checkedNumber, DEFAULT_GGUF_LIMITS, type GgufLimits, resolveGgufLimits } from "./gguf-limits.js";
export {
  type GgufArray,
  type GgufArrayItems,
  type GgufArrayOf,
  type GgufMetadata,
  type GgufMetadataValue,
  type GgufPlainValue,
  type GgufScalarValue,
  getArray,
  getBigInt,
  getBool,
  getInteger,
  getNumber,
  getNumberArray,
  getString,
  getStringArray,
  ggufValue,
  plainValue,
} from "./gguf-metadata.js";
export {
  findTensor,
  type GgufHeader,
  type GgufTensorInfo,
  type ReadGgufOptions,
  readGguf,
} from "./gguf-reader.js";
export {
  type GgufPlan,
  type GgufPlannedTensor,
  type GgufStreamOptions,
  type GgufTensorRange,
  type GgufWriteInput,
  type GgufWriteTensor,
  ggufByteStream,
  planGguf,
  type WriteGgufOptions,
  writeGguf,
} from "./gguf-writer.js";
export {
  type BuildManifestOptions,
  buildManifest,
  type LoadedManifest,
  type LoadOrBuildManifestOptions,
  loadOrBuildManifest,
  MANIFEST_FORMAT,
  type ManifestLayer,
  type ManifestProgress,
  type ManifestSlab,
  type ManifestTensor,
  manifestSlabs,
  parseManifest,
  type SliceManifest,
} from "./manifest.js";
// Expert slicing, manifests and synthetic MoE models.
export {
  type ExpertLayer,
  type ExpertProjection,
  type ExpertTensor,
  findExpertTensors,
  type MoeLayout,
  SLICE_KEYS,
} from "./moe-tensors.js";
// Offload planner (M0).
export { formatLayers, formatOffloadPlan, offloadPlanToJson } from "./plan/format.js";
export { kvLayers, type ModelHparams, modelHparams, recurrentLayers } from "./plan/hparams.js";
export {
  type ComputeEstimate,
  type ContextShape,
  estimateComputeBuffer,
  estimateHostBuffers,
  KV_CACHE_TYPES,
  type KvCacheSize,
  type KvCacheType,
  kvCacheSize,
  OP_OFFLOAD_MIN_BATCH,
  type RecurrentStateSize,
  recurrentStateSize,
} from "./plan/memory.js";
export {
  type DeviceTotals,
  type ExpertLayerPlan,
  type OffloadDevice,
  type OffloadOrder,
  type OffloadPlan,
  type PlannedTensor,
  type PlanOffloadOptions,
  planOffload,
  type TensorOverride,
} from "./plan/offload.js";
export {
  EXPERT_TENSOR_NAME,
  equivalentNCpuMoe,
  expertOverridePattern,
  nCpuMoePattern,
  numberSetPattern,
} from "./plan/override.js";
export {
  assignSwarm,
  type ExpertDemand,
  type SwarmAssignment,
  type SwarmLayerInfo,
  type SwarmPlan,
  type SwarmSlice,
  type SwarmWorker,
} from "./plan/swarm.js";
export { type ByteSize, parseByteSize, toGiB } from "./plan/units.js";
export {
  canDequantize,
  DEQUANTIZABLE_TYPES,
  dequantize,
  dequantizeF64,
  dequantizeRows,
  dequantizeSlab,
} from "./quant/dequantize.js";
export { canQuantize, QUANTIZABLE_TYPES, quantize } from "./quant/quantize.js";
export {
  type ExpertSlice,
  type IndexSelection,
  type SliceExpertsOptions,
  type SliceStreamOptions,
  type SliceWriteOptions,
  sliceContents,
  sliceExperts,
} from "./slice.js";
export { type VerifiedSlice, type VerifySliceOptions, verifySlice } from "./slice-verify.js";
export {
  defaultModelCacheDir,
  type EnsuredSyntheticModel,
  type EnsureSyntheticModelOptions,
  ensureSyntheticModel,
  SYNTHETIC_PRESETS,
  type SyntheticPreset,
  syntheticModelKey,
  syntheticPreset,
} from "./synth/presets.js";
export { q4kmTypes, SYNTHETIC_MIXES, type SyntheticMix } from "./synth/quant-mix.js";
export { isRecurrentLayer, type LinearAttentionOptions } from "./synth/qwen35moe.js";
export {
  DEFAULT_SYNTHETIC_TYPES,
  type ResolvedSyntheticOptions,
  resolveSyntheticOptions,
  SYNTH_GENERATOR_VERSION,
  SYNTHETIC_ARCHS,
  SYNTHETIC_TYPES,
  SYNTHETIC_WEIGHTS,
  type SyntheticArch,
  type SyntheticMoeOptions,
  type SyntheticType,
  type SyntheticTypes,
  type SyntheticWeights,
} from "./synth/spec.js";
export {
  planSyntheticModel,
  type SynthesizeOptions,
  type SynthesizeProgress,
  type SynthesizeResult,
  type SynthQuantizer,
  synthesizeMoeModel,
  writeSyntheticHeader,
} from "./synth/synthesize.js";

// Public API of @moeswarm/core.

export { abortable, linkedSignal, onAbort, sleep } from "./abort.js";
export {
  type CliProcessIo,
  type CliProcessOptions,
  readPackageVersion,
  runCliProcess,
} from "./cli-process.js";

export {
  canonicalKeys,
  type DecodeOptions,
  decodeFrame,
  type EncodeOptions,
  encodeFrame,
  validateFrame,
} from "./codec.js";
export { type RoutePatch, rerouteFrame } from "./codec-route.js";
export { describeError } from "./describe-error.js";
export { ERROR_CODES, type ErrorCode, isErrorCode } from "./error-codes.js";
export {
  AbortError,
  AuthError,
  abortReason,
  type CodeOf,
  DispatchError,
  type ErrorFromCodeOptions,
  errorFromCode,
  errorFromSystemError,
  errorToWire,
  GgufError,
  HubError,
  InvalidArgumentError,
  IoError,
  isMoeswarmError,
  MoeswarmError,
  type MoeswarmErrorOptions,
  NativeError,
  ProtocolError,
  TransportError,
  throwIfAborted,
} from "./errors.js";
export type {
  ExpertCallOptions,
  ExpertHandler,
  ExpertRequest,
  ExpertResult,
  ExpertTransport,
} from "./expert-contract.js";
export {
  dispatchFrame,
  drainFrame,
  errorFrame,
  type FrameInit,
  helloFrame,
  pingFrame,
  pongFrame,
  registerFrame,
  resultFrame,
} from "./frame-builders.js";
export {
  type ActivationDtype,
  CAPS_FIELDS,
  DEFAULT_MAX_FRAME_BYTES,
  type DispatchFrame,
  type DispatchMode,
  type DrainFrame,
  type ErrorFrame,
  type FieldRule,
  type FieldSpec,
  FRAME_FIELDS,
  FRAME_TYPES,
  type Frame,
  type FrameOf,
  type FrameType,
  type HelloCaps,
  type HelloFrame,
  isFrameType,
  type PeerRole,
  type PingFrame,
  type PongFrame,
  PROTOCOL_LIMITS,
  PROTOCOL_VERSION,
  type RegisterFrame,
  type ResultFrame,
  type Routed,
} from "./frames.js";
export {
  encodeLengthPrefixed,
  FrameReader,
  type FramingOptions,
  LENGTH_PREFIX_BYTES,
  type ReadFramesOptions,
  readFrames,
  type WriteFrameOptions,
  writeFrame,
} from "./framing.js";
export {
  bf16BitsToF32,
  decodeBf16,
  decodeF16,
  encodeBf16,
  encodeF16,
  f16BitsToF32,
  f32ToBf16Bits,
  f32ToF16Bits,
} from "./half.js";
// The hub's HTTP API bodies, for the hub and its clients.
export {
  AUTO_CLAIM_BODY_SHAPE,
  type AutoClaimRequestJson,
  CAPACITY_SHAPE,
  CLAIM_BODY_SHAPE,
  type ClaimCapacityJson,
  type ClaimRequestJson,
  type DemandJson,
  type DemandPolicyJson,
  type DemandRangeJson,
  isHubId,
  type LeaseJson,
  MAX_HUB_ID_BYTES,
  MAX_RECEIPTS,
  manifestUrl,
  type PlacementJson,
  type PlacementRegistrationJson,
  parseDemandJson,
  parseLeaseJson,
  parseStatsReport,
  placementUrl,
  RENEW_BODY_SHAPE,
  type ReceiptJson,
  type ReleasedJson,
  type RenewRequestJson,
  type StatsModelShape,
  type StatsOutcomeJson,
  type StatsReport,
  type StatsReportJson,
  shardUrl,
} from "./hub-api.js";
export {
  checkRange,
  type ExpertRef,
  expertKey,
  formatRange,
  parseRange,
  RANGE_LIMIT,
  type Range,
  rangeLength,
  rangeValues,
  toRanges,
} from "./ids.js";
export { cosine, maxAbsDiff, relL2 } from "./numerics.js";
export { mulberry32 } from "./prng.js";
export { compactSlots, expandSlots, filledSlots, type SlotShape, sumSlots } from "./slots.js";
export {
  bytesOf,
  DTYPES,
  type Dtype,
  type DtypeArray,
  type DtypeArrayMap,
  dtypeSize,
  isDtype,
  shapeSize,
  type TensorView,
  tensor,
  tensorByteSize,
  tensorBytes,
  toF32,
  typedArrayFromBytes,
} from "./tensor.js";
export { traceEnabled, traceFlush, traceHop } from "./trace.js";

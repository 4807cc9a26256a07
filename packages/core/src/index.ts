// Public API of @moeswarm/core.
export { ERROR_CODES, type ErrorCode, isErrorCode } from "./error-codes.js";
export {
  AbortError,
  AuthError,
  abortReason,
  type CodeOf,
  DispatchError,
  GgufError,
  HubError,
  InvalidArgumentError,
  isMoeswarmError,
  MoeswarmError,
  type MoeswarmErrorOptions,
  NativeError,
  ProtocolError,
  TransportError,
  throwIfAborted,
} from "./errors.js";
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

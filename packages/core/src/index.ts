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

import {
  AbortError,
  AuthError,
  DispatchError,
  ERROR_CODES,
  type ErrorCode,
  GgufError,
  HubError,
  InvalidArgumentError,
  isErrorCode,
  type MoeswarmError,
  NativeError,
  ProtocolError,
  TransportError,
} from "@moeswarm/core";

type AreaClass = new (
  code: never,
  message?: string,
  options?: { details?: Record<string, unknown> },
) => MoeswarmError;

const CLASSES: Record<(typeof ERROR_CODES)[ErrorCode]["area"], AreaClass> = {
  InvalidArgumentError,
  AbortError,
  GgufError,
  ProtocolError,
  DispatchError,
  TransportError,
  AuthError,
  NativeError,
  HubError,
};

/**
 * The typed error for a `MOESWARM_*` code that crossed a language boundary (the addon's rejection,
 * an `error` frame of the executable). A code this version does not know becomes
 * NativeError MOESWARM_NATIVE_COMPUTE, with the original code in `details.code`.
 */
export function errorFromCode(
  code: string,
  message: string,
  details: Record<string, unknown> = {},
): MoeswarmError {
  if (isErrorCode(code)) {
    const cls = CLASSES[ERROR_CODES[code].area];
    return new cls(code as never, message, { details });
  }
  return new NativeError("MOESWARM_NATIVE_COMPUTE", `${code}: ${message}`, { details: { ...details, code } });
}

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
  isMoeswarmError,
  type MoeswarmError,
  type MoeswarmErrorOptions,
  NativeError,
  ProtocolError,
  TransportError,
} from "@moeswarm/core";

type AnyErrorClass = new (code: never, message?: string, options?: MoeswarmErrorOptions) => MoeswarmError;

const CLASSES: Record<string, AnyErrorClass> = {
  AbortError,
  AuthError,
  DispatchError,
  GgufError,
  HubError,
  InvalidArgumentError,
  NativeError,
  ProtocolError,
  TransportError,
};

/**
 * The typed error for an `error` frame: the class that owns the code, so `instanceof AuthError`
 * works on the receiving side. A code this build does not know (a newer peer) becomes a
 * DispatchError with the peer's code kept in `details.code`.
 */
export function errorFromWire(
  code: string,
  msg: string,
  details?: Readonly<Record<string, unknown>>,
): MoeswarmError {
  if (isErrorCode(code)) {
    const Cls = CLASSES[ERROR_CODES[code].area];
    if (Cls) return new Cls(code as never, msg, { details });
  }
  return new DispatchError("MOESWARM_DISPATCH_FAILED", `${code}: ${msg}`, { details: { ...details, code } });
}

/** The code and message an `error` frame carries for any thrown value. */
export function errorToWire(error: unknown): { code: ErrorCode; msg: string } {
  // well under the protocol's 16 KiB bound on `msg`, whatever the characters
  if (isMoeswarmError(error)) return { code: error.code, msg: error.message.slice(0, 4096) };
  const msg = error instanceof Error ? error.message : String(error);
  return { code: "MOESWARM_DISPATCH_FAILED", msg: msg.slice(0, 4096) };
}

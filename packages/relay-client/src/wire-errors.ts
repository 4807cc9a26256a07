import { errorToWire as coreErrorToWire, errorFromCode, type MoeswarmError } from "@moeswarm/core";

/**
 * The typed error for an `error` frame's code and message.
 * @deprecated Use `errorFromCode(code, msg, { details })` from @moeswarm/core (the same function).
 */
export function errorFromWire(
  code: string,
  msg: string,
  details?: Readonly<Record<string, unknown>>,
): MoeswarmError {
  return errorFromCode(code, msg, { details });
}

/** @deprecated Use `errorToWire` from @moeswarm/core (the same function). */
export const errorToWire: typeof coreErrorToWire = coreErrorToWire;

import { errorFromCode as coreErrorFromCode, type MoeswarmError } from "@moeswarm/core";

/**
 * The typed error for a `MOESWARM_*` code from the native side (the addon's rejection, an `error`
 * frame of the executable): core's errorFromCode, except that a code this version does not know
 * (a newer native build) becomes NativeError MOESWARM_NATIVE_COMPUTE, with the code in `details.code`.
 */
export function errorFromCode(
  code: string,
  message: string,
  details?: Record<string, unknown>,
): MoeswarmError {
  return coreErrorFromCode(code, message, { details, fallback: "MOESWARM_NATIVE_COMPUTE" });
}

import { isMoeswarmError } from "./errors.js";

/**
 * The code and one-line message a CLI prints for an error: a MoeswarmError's own (with its
 * details), a `node:util` parseArgs error as MOESWARM_INVALID_ARGUMENT, anything else by its
 * string `code` or its name.
 */
export function describeError(error: unknown): { code: string; message: string; details?: unknown } {
  if (isMoeswarmError(error)) return { code: error.code, message: error.message, details: error.details };
  const e = error as { code?: unknown; message?: unknown } | null;
  if (typeof e?.code === "string" && e.code.startsWith("ERR_PARSE_ARGS")) {
    return { code: "MOESWARM_INVALID_ARGUMENT", message: String(e.message) };
  }
  // Not one of ours (a bug, or a Node error that escaped): its own code or name.
  const code = typeof e?.code === "string" ? e.code : error instanceof Error ? error.name : "Error";
  return { code, message: error instanceof Error ? error.message : String(error) };
}

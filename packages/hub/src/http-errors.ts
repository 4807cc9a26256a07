import type { ServerResponse } from "node:http";
import { type ErrorCode, HubError, isMoeswarmError, type MoeswarmError } from "@moeswarm/core";

/** The JSON body of every error answer: `{"error": {"code", "message", "details"?}}`. */
export interface HubErrorBody {
  error: { code: ErrorCode; message: string; details?: Readonly<Record<string, unknown>> };
}

const STATUS: Partial<Record<ErrorCode, number>> = {
  MOESWARM_INVALID_ARGUMENT: 400,
  MOESWARM_INVALID_RANGE: 400,
  MOESWARM_HUB_BAD_REQUEST: 400,
  // a layer the query selected has no routed experts: the query is wrong, not the hub
  MOESWARM_GGUF_NOT_MOE: 400,
  MOESWARM_AUTH_MISSING: 401,
  MOESWARM_AUTH_INVALID: 401,
  MOESWARM_AUTH_EXPIRED: 401,
  MOESWARM_AUTH_ROLE: 403,
  MOESWARM_HUB_BANNED: 403,
  MOESWARM_HUB_NOT_OWNER: 403,
  MOESWARM_HUB_ENROL_INVALID: 403,
  MOESWARM_HUB_ENROL_EXPIRED: 403,
  MOESWARM_HUB_ENROL_USED: 403,
  MOESWARM_HUB_ENROL_REVOKED: 403,
  MOESWARM_HUB_NOT_FOUND: 404,
  MOESWARM_HUB_METHOD_NOT_ALLOWED: 405,
  MOESWARM_HUB_CONFLICT: 409,
  MOESWARM_HUB_PAYLOAD_TOO_LARGE: 413,
  MOESWARM_HUB_RANGE_NOT_SATISFIABLE: 416,
  MOESWARM_TRANSPORT_LIMIT: 429,
  MOESWARM_HUB_ENROL_RATE: 429,
  MOESWARM_HUB_STORE: 503,
};

/** The HTTP status an error is answered with: its code's (400s for the caller's mistakes), else 500. */
export function httpStatusOf(error: unknown): number {
  return isMoeswarmError(error) ? (STATUS[error.code] ?? 500) : 500;
}

/**
 * The error a request is answered with. Failures on the hub's side (status >= 500) keep their code
 * but not their message or details, which may name files on the hub's disk.
 */
export function publicError(error: unknown): { status: number; body: HubErrorBody; internal: boolean } {
  const status = httpStatusOf(error);
  if (!isMoeswarmError(error)) {
    return {
      status,
      internal: true,
      body: {
        error: { code: "MOESWARM_HUB_INTERNAL", message: "the hub failed while answering this request" },
      },
    };
  }
  if (status >= 500) {
    return {
      status,
      internal: true,
      body: { error: { code: error.code, message: "the hub failed while answering this request" } },
    };
  }
  const e: HubErrorBody["error"] = { code: error.code, message: error.message };
  if (error.details !== undefined) e.details = error.details;
  return { status, internal: false, body: { error: e } };
}

export function notFound(message: string): MoeswarmError {
  return new HubError("MOESWARM_HUB_NOT_FOUND", message);
}

export function badRequest(message: string, details?: Record<string, unknown>): MoeswarmError {
  return new HubError("MOESWARM_HUB_BAD_REQUEST", message, details ? { details } : {});
}

export function methodNotAllowed(method: string | undefined, allow: readonly string[]): MoeswarmError {
  return new HubError(
    "MOESWARM_HUB_METHOD_NOT_ALLOWED",
    `${method ?? "?"} is not allowed here; use ${allow.join(" or ")}`,
    { details: { allow: [...allow] } },
  );
}

/** Sends a JSON body with a Content-Length (HEAD: the headers only). */
export function sendJson(
  res: ServerResponse,
  status: number,
  body: unknown,
  headers: Record<string, string | number> = {},
  head = false,
): void {
  const text = Buffer.from(`${JSON.stringify(body)}\n`);
  res.writeHead(status, {
    "content-type": "application/json; charset=utf-8",
    "content-length": text.byteLength,
    "cache-control": "no-store",
    ...headers,
  });
  if (head) res.end();
  else res.end(text);
}

/**
 * Answers with the error's JSON body, or, when a body has already begun (a download that failed
 * half way), cuts the connection so the client sees a short body rather than a wrong one.
 */
export function sendError(res: ServerResponse, error: unknown, head = false): number {
  const { status, body } = publicError(error);
  if (res.headersSent) {
    res.destroy();
    return status;
  }
  const headers: Record<string, string> = {};
  if (status === 401) headers["www-authenticate"] = 'Bearer realm="moeswarm-hub"';
  const allow = isMoeswarmError(error) ? error.details?.allow : undefined;
  if (status === 405 && Array.isArray(allow)) headers.allow = allow.join(", ");
  const length = isMoeswarmError(error) ? error.details?.length : undefined;
  if (status === 416 && typeof length === "number") headers["content-range"] = `bytes */${length}`;
  sendJson(res, status, body, headers, head);
  return status;
}

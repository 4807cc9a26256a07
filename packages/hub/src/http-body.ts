import type { IncomingMessage, ServerResponse } from "node:http";
import { HubError } from "@moeswarm/core";
import { badRequest } from "./http-errors.js";

/**
 * Reads a JSON request body of at most `max` bytes (HubError MOESWARM_HUB_PAYLOAD_TOO_LARGE,
 * the connection marked to close, before more is buffered), HubError MOESWARM_HUB_BAD_REQUEST
 * when it is not JSON. An empty body is `undefined`.
 */
export async function readJsonBody(req: IncomingMessage, res: ServerResponse, max: number): Promise<unknown> {
  const declared = Number(req.headers["content-length"] ?? "0");
  const tooLarge = () => {
    // the rest of the body is not read: the connection cannot carry another request
    res.setHeader("connection", "close");
    return new HubError("MOESWARM_HUB_PAYLOAD_TOO_LARGE", `the body is larger than ${max} bytes`, {
      details: { max },
    });
  };
  if (declared > max) throw tooLarge();
  const parts: Buffer[] = [];
  let size = 0;
  for await (const chunk of req) {
    size += (chunk as Buffer).byteLength;
    if (size > max) throw tooLarge();
    parts.push(chunk as Buffer);
  }
  if (size === 0) return undefined;
  try {
    return JSON.parse(Buffer.concat(parts).toString("utf8"));
  } catch {
    throw badRequest("the body is not valid JSON");
  }
}

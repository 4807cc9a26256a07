import { errorFromCode, TransportError } from "@moeswarm/core";
import type { LinkCloseInfo } from "./link.js";

// Close codes the relay uses (4000-4999 is the application range of RFC 6455).
export const CLOSE_AUTH = 4001;
export const CLOSE_HOSTILE = 4002;
export const CLOSE_DEAD_PEER = 4003;
export const CLOSE_REPLACED = 4004;
export const CLOSE_SLOW_CONSUMER = 4005;
export const CLOSE_SHUTDOWN = 1001;

/** Why a link closed, as the error its requests (or the hello) fail with. */
export function closeToError(info: LinkCloseInfo, duringHello: boolean): Error {
  // the relay closes with the code of its refusal as reason, in case its error frame was lost
  if (info.code === CLOSE_AUTH) {
    const code = info.reason.startsWith("MOESWARM_AUTH_")
      ? info.reason.split(/\s/)[0]
      : "MOESWARM_AUTH_INVALID";
    return errorFromCode(code as string, `the relay refused the hello: ${info.reason}`);
  }
  if (info.error) return info.error;
  return new TransportError(
    duringHello ? "MOESWARM_TRANSPORT_CONNECT" : "MOESWARM_TRANSPORT_CLOSED",
    `the relay closed the connection (${info.code}${info.reason ? `: ${info.reason}` : ""})`,
    { details: { closeCode: info.code } },
  );
}

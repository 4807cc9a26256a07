import type { Socket } from "node:net";
import type { TLSSocket } from "node:tls";
import { abortReason, onAbort, ProtocolError, TransportError } from "@moeswarm/core";
import WebSocket from "ws";

/*
 * The frame-level transport under a relay connection. The connection (hello, multiplexing,
 * heartbeats, reconnect) runs over any FrameLink, so a later direct route between a backbone and a
 * worker (negotiated through the relay, as Tailscale does with DERP) is one more dialer, not a
 * second connection implementation.
 *
 * The WebSocket client is `ws` 8 rather than undici 7's WHATWG WebSocket. On Node 20 undici's
 * client does take a custom CA (an Agent with connect.ca), binary frames, bufferedAmount, a
 * payload limit (on the dispatcher's webSocketOptions) and outgoing pings, but a failed TLS
 * handshake surfaces as an error event with an empty message and no cause (a user cannot tell an
 * unknown CA from a refused port), pongs are only visible through a process-wide diagnostics
 * channel, and undici 7 needs Node >= 20.18.1. `ws` gives the real error
 * (UNABLE_TO_VERIFY_LEAF_SIGNATURE...), per-socket ping/pong, the raw socket (liveness while a
 * large frame is still arriving), runs on every Node 20, and the relay server needs it anyway, so
 * both ends share one implementation of the framing.
 */

export interface LinkCloseInfo {
  code: number;
  reason: string;
  /** Why the link failed, when it did not close cleanly. */
  error?: Error;
}

export interface FrameLinkHandlers {
  /** One complete frame's bytes. */
  frame(bytes: Uint8Array): void;
  /** Bytes arrived (possibly part of a large frame): the peer is alive. */
  activity(): void;
  /** The link is gone; called once. */
  close(info: LinkCloseInfo): void;
}

/** A bidirectional, message-framed, ordered link to one peer. */
export interface FrameLink {
  /** Bytes accepted by send() and not yet handed to the operating system. */
  readonly bufferedBytes: number;
  /**
   * Queues one frame; failures show up as a close. A link that sets `callsSent` calls `sent`
   * exactly once, when it no longer holds the frame's bytes: written to the operating system,
   * copied, or dropped because the link closed.
   */
  send(frame: Uint8Array, sent?: () => void): void;
  /**
   * True when `send` calls its `sent` as above: the connection then encodes frames into memory
   * it takes back at `sent` and reuses for a later frame (fresh memory costs page faults on every
   * frame). Leave it unset for a link that keeps the bytes it is given: it then gets bytes of its
   * own for each frame.
   */
  readonly callsSent?: boolean;
  /** Graceful close (the peer sees code and reason). */
  close(code?: number, reason?: string): void;
  /** Abrupt close: the socket is destroyed at once. */
  destroy(): void;
}

export interface DialOptions {
  handlers: FrameLinkHandlers;
  signal?: AbortSignal;
  /** Trusted CA certificates (PEM) for a self-hosted relay; the system store otherwise. */
  ca?: string | Uint8Array | ReadonlyArray<string | Uint8Array>;
  /** Largest frame accepted from the peer; a larger one closes the link (1009). */
  maxFrameBytes: number;
  connectTimeoutMs: number;
  /**
   * The SHA-256 fingerprint (AA:BB:...) the server's certificate must have: the certificate is
   * then pinned instead of checked against a CA (a worker's direct endpoint is self-signed). A
   * mismatch closes the link before the WebSocket opens, so no frame is ever sent to the impostor.
   */
  pin?: string;
}

export type FrameDialer = (url: string, options: DialOptions) => Promise<FrameLink>;

function toBuffer(value: string | Uint8Array): string | Buffer {
  return typeof value === "string" ? value : Buffer.from(value.buffer, value.byteOffset, value.byteLength);
}

/**
 * The mask of a client frame on a TLS link: four zero bytes, which `ws` (since 8.4) takes as "send
 * the bytes as they are" and its receiver as "nothing to unmask". RFC 6455 asks a client for an
 * unpredictable mask so that a script in a browser cannot make a frame look like an HTTP request
 * to a transparent proxy that reads the plaintext. Our clients run no one's scripts, and on a
 * `wss://` link no proxy reads the plaintext, so the mask protects nothing there, while masking
 * a 772 KB activation frame means copying it into fresh memory (page faults on every frame) and
 * the relay unmasking it again. Plain `ws://` links keep ws's random masks.
 */
export function zeroMask(mask: Buffer): void {
  mask.fill(0);
}

function closeError(code: number, error: Error | undefined): Error | undefined {
  if (error) {
    const wsCode = (error as { code?: string }).code;
    if (code === 1009 || wsCode === "WS_ERR_UNSUPPORTED_MESSAGE_LENGTH") {
      return new ProtocolError("MOESWARM_PROTOCOL_FRAME_TOO_LARGE", error.message, { cause: error });
    }
    return new TransportError("MOESWARM_TRANSPORT_CLOSED", error.message, { cause: error });
  }
  return undefined;
}

/** Dials a `ws://` or `wss://` URL; resolves once the WebSocket is open. */
export const dialWebSocket: FrameDialer = (url, options) => {
  const { handlers, signal } = options;
  if (signal?.aborted) return Promise.reject(abortReason(signal));
  return new Promise<FrameLink>((resolve, reject) => {
    let ws: WebSocket;
    try {
      ws = new WebSocket(url, {
        ca: options.ca === undefined ? undefined : [options.ca].flat().map(toBuffer),
        // pinned: the fingerprint is checked at the upgrade, below, instead of a CA chain
        ...(options.pin !== undefined ? { rejectUnauthorized: false } : {}),
        maxPayload: options.maxFrameBytes,
        perMessageDeflate: false,
        ...(url.startsWith("wss:") ? { generateMask: zeroMask } : {}),
        handshakeTimeout: options.connectTimeoutMs,
      });
    } catch (cause) {
      reject(new TransportError("MOESWARM_TRANSPORT_CONNECT", `cannot dial ${url}`, { cause }));
      return;
    }
    let open = false;
    let closed = false;
    let lastError: Error | undefined;
    const aborted = onAbort(signal, (reason) => {
      ws.terminate();
      reject(reason);
    });

    ws.on("upgrade", (res) => {
      const socket = res.socket as Socket;
      if (options.pin !== undefined) {
        const seen = (socket as TLSSocket).getPeerX509Certificate?.()?.fingerprint256;
        if (seen !== options.pin) {
          lastError = new TransportError(
            "MOESWARM_TRANSPORT_PIN_MISMATCH",
            `${url} presented certificate ${seen ?? "(none)"}, not the pinned ${options.pin}`,
          );
          ws.terminate();
          return;
        }
      }
      // ws already sets it; stated here because request latency depends on it
      socket.setNoDelay(true);
      socket.on("data", () => handlers.activity());
    });
    ws.on("unexpected-response", (_req, res) => {
      lastError = new TransportError(
        "MOESWARM_TRANSPORT_CONNECT",
        `${url} answered the upgrade with HTTP ${res.statusCode ?? "?"}`,
      );
      res.resume();
      ws.terminate();
    });
    ws.on("error", (error) => {
      lastError ??= error;
    });
    ws.on("open", () => {
      open = true;
      aborted[Symbol.dispose]();
      resolve(link);
    });
    ws.on("message", (data: Buffer) => {
      handlers.frame(data);
    });
    ws.on("close", (code, reasonBytes) => {
      aborted[Symbol.dispose]();
      if (closed) return;
      closed = true;
      const reason = reasonBytes.toString();
      if (!open) {
        reject(
          lastError instanceof TransportError
            ? lastError
            : new TransportError(
                "MOESWARM_TRANSPORT_CONNECT",
                `cannot connect to ${url}: ${lastError?.message ?? `closed (${code}) ${reason}`}`,
                { cause: lastError },
              ),
        );
        return;
      }
      handlers.close({ code, reason, error: closeError(code, lastError) });
    });

    const link: FrameLink = {
      // ws calls a send's callback once the socket has written the frame, or with an error when
      // the socket is gone; a zero mask (zeroMask) makes it write the caller's bytes themselves
      callsSent: true,
      get bufferedBytes() {
        return ws.bufferedAmount;
      },
      send(frame, sent) {
        if (ws.readyState !== WebSocket.OPEN) {
          sent?.();
          return;
        }
        ws.send(frame, { binary: true }, sent);
      },
      close(code = 1000, reason = "") {
        if (ws.readyState === WebSocket.CONNECTING || ws.readyState === WebSocket.OPEN) {
          ws.close(code, reason.slice(0, 120));
        }
      },
      destroy() {
        ws.terminate();
      },
    };
  });
};

// What the roundtrip benchmark's floor clients share: dialing one (stock ws options, the bench's
// self-signed certificate trusted) and, for the codec chain, sending frames encoded into memory
// that is used again once ws has written it, as relay-client's FrameWriter does.
import { type EncodableFrame, FrameEncoder } from "@moeswarm/core";
import { WebSocket } from "ws";

const MAX = 64 * 1024 * 1024;

/**
 * A WebSocket to `url`, open. `zeroMask`: send with four zero mask bytes, as relay-client does
 * over TLS (ws then writes the caller's bytes themselves); otherwise ws's random masks.
 */
export async function dialFloor(url: string, zeroMask = false): Promise<WebSocket> {
  const ws = new WebSocket(url, {
    perMessageDeflate: false,
    maxPayload: MAX,
    rejectUnauthorized: false,
    ...(zeroMask ? { generateMask: (mask: Buffer) => mask.fill(0) } : {}),
  });
  await new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", reject);
  });
  return ws;
}

/** Sends each frame encoded into an encoder's memory, the encoder kept for reuse once ws has written it. */
export function encodedSender(ws: WebSocket): (frame: EncodableFrame) => void {
  const free: FrameEncoder[] = [];
  return (frame) => {
    const encoder = free.pop() ?? new FrameEncoder({ maxFrameBytes: MAX });
    encoder.encode(frame, (bytes) => ws.send(bytes, () => free.push(encoder)));
  };
}

// Shared by the native listener tests of the worker (native, native-bin): a client of the wire of
// protocol section 10.9 over node:tls, and the hub's tickets.
import { createHash } from "node:crypto";
import { connect } from "node:tls";
import { decodeFrame, encodeLengthPrefixed, type Frame, FrameReader } from "@moeswarm/core";

/** One TLS connection to the native listener: frames out, decoded frames in, in order. */
export async function dial(address: string) {
  const [, host, port] = /^(.*):(\d+)$/.exec(address) as RegExpExecArray;
  const socket = connect({ host, port: Number(port), rejectUnauthorized: false });
  await new Promise<void>((resolve, reject) => {
    socket.once("secureConnect", resolve);
    socket.once("error", reject);
  });
  const reader = new FrameReader();
  const frames: Array<Frame | undefined> = [];
  let wake: (() => void) | undefined;
  socket.on("data", (chunk: Buffer) => {
    for (const p of reader.push(chunk)) frames.push(decodeFrame(p));
    wake?.();
  });
  socket.on("close", () => {
    frames.push(undefined);
    wake?.();
  });
  socket.on("error", () => {});
  const der = socket.getPeerCertificate().raw;
  return {
    fingerprint: createHash("sha256").update(der).digest("hex").toUpperCase().match(/../g)!.join(":"),
    send: (f: Frame) => socket.write(encodeLengthPrefixed(f)),
    async next(): Promise<Frame | undefined> {
      while (frames.length === 0) await new Promise<void>((r) => (wake = r));
      return frames.shift();
    },
    close: () => socket.destroy(),
  };
}

/** A direct-link ticket from the hub at `url` for `worker`, asked with a backbone `token`. */
export async function ticketFor(url: string, worker: string, token: string): Promise<string> {
  const r = await fetch(`${url}/api/direct/tickets`, {
    method: "POST",
    headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
    body: JSON.stringify({ worker }),
  });
  return ((await r.json()) as { ticket: string }).ticket;
}

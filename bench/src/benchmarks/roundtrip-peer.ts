// Child process of the `roundtrip` benchmark's floors, each the least a path of its kind can cost:
// `node-echo`: a length-prefixed TCP echo (Node's socket floor); `ws-echo`: a WebSocket echoing
// each binary message (the direct path's floor); `blind-relay`: a WebSocket server that forwards
// each message between its backbone and its worker without reading it (the relay path's floor);
// `blind-worker`: the echo at the blind relay's far end; `wss-echo`: the WebSocket echo over TLS
// (the floor of the product's direct path, which is TLS). With `cert` and `key`, `blind-relay`
// serves TLS too (the floor of the relay as the hub serves it), and `blind-worker` dials wss.
// The floors are stock `ws` clients: random masks, masked and unmasked on every hop.
// With `codec`, `blind-relay` and `blind-worker` do what the protocol itself asks of them and no
// more (the "codec chain"): the relay validates each frame it forwards (core's decodeFrame, raw,
// as the hub's relay does) and forwards the bytes it received, and the worker decodes each
// dispatch and answers with a result frame encoded into reused memory (FrameEncoder), sent with a
// zero mask as relay-client sends over TLS. No routing, no request tables, no deadlines: the
// product's relay path over it is what the product's own plumbing costs.
import { createServer as createHttpsServer } from "node:https";
import { createServer, type Socket } from "node:net";
import { type DispatchFrame, decodeFrame, PROTOCOL_VERSION, tuneHeapForFrames } from "@moeswarm/core";
import { type WebSocket, WebSocketServer } from "ws";
import { onParentMessage } from "./children.js";
import { dialFloor, encodedSender } from "./ws-floor.js";

interface Args {
  mode: "node-echo" | "ws-echo" | "wss-echo" | "blind-relay" | "blind-worker";
  /** blind-worker: the blind relay's worker URL. */
  url?: string;
  /** blind-relay, blind-worker: the codec chain (validate, decode and encode; see above). */
  codec?: boolean;
  /** wss-echo, blind-relay: PEM certificate and key. */
  cert?: string;
  key?: string;
}

const args = JSON.parse(process.argv[2] ?? "{}") as Args;
const MAX = 64 * 1024 * 1024;
// The floors' heaps are sized as the product's processes size theirs (relay-peer.ts): with V8's
// default growth, a floor that receives frame after frame runs a major collection every few
// thousand and is itself slowed by it (the blind chain by about 5% at 1 token), which flattered
// every ratio over it.
tuneHeapForFrames();

function nodeEcho(): Promise<number> {
  const server = createServer((socket: Socket) => {
    socket.setNoDelay(true);
    let pending: Buffer[] = [];
    let have = 0;
    socket.on("data", (chunk: Buffer) => {
      pending.push(chunk);
      have += chunk.byteLength;
      for (;;) {
        if (have < 4) return;
        const all = pending.length === 1 ? pending[0]! : Buffer.concat(pending);
        const n = all.readUInt32LE(0);
        if (have < 4 + n) {
          pending = [all];
          return;
        }
        socket.write(all.subarray(0, 4 + n));
        const rest = all.subarray(4 + n);
        pending = rest.byteLength > 0 ? [rest] : [];
        have = rest.byteLength;
      }
    });
    socket.on("error", () => {});
  });
  return new Promise((resolve) =>
    server.listen(0, "127.0.0.1", () => resolve((server.address() as { port: number }).port)),
  );
}

/** A WebSocket server on a loopback port, over TLS when `args` has a certificate. */
async function wsServer(onConnection: (ws: WebSocket, path: string) => void): Promise<number> {
  const options = { perMessageDeflate: false, maxPayload: MAX };
  const https = args.cert ? createHttpsServer({ cert: args.cert, key: args.key }) : undefined;
  const wss = https
    ? new WebSocketServer({ server: https, ...options })
    : new WebSocketServer({ host: "127.0.0.1", port: 0, ...options });
  if (https) await new Promise<void>((resolve) => https.listen(0, "127.0.0.1", () => resolve()));
  else await new Promise<void>((resolve) => wss.once("listening", () => resolve()));
  wss.on("connection", (ws, req) => {
    ws.on("error", () => {});
    onConnection(ws, req.url ?? "/");
  });
  return ((https ?? wss).address() as { port: number }).port;
}

/** The codec chain's worker: each dispatch decoded, its `x` answered as `y` in a result frame. */
function codecEcho(ws: WebSocket): (data: Buffer) => void {
  const send = encodedSender(ws);
  return (data) => {
    const d = decodeFrame(data, { maxFrameBytes: MAX }) as DispatchFrame;
    const { id, mode, n, k, embd } = d;
    send({ t: "result", v: PROTOCOL_VERSION, id, mode, n, k, embd, y: d.x as Float32Array });
  };
}

async function main(): Promise<void> {
  let port: number;
  if (args.mode === "blind-worker") {
    // the far end of the blind relay: echoes each message back through it
    // a wss blind relay's certificate is the bench's own self-signed one
    const ws = await dialFloor(args.url!, args.codec === true);
    ws.on("message", args.codec ? codecEcho(ws) : (data: Buffer) => ws.send(data));
    process.send?.({ ready: "1" });
    onParentMessage(() => process.exit(0));
    return;
  }
  if (args.mode === "node-echo") port = await nodeEcho();
  else if (args.mode === "ws-echo" || args.mode === "wss-echo") {
    port = await wsServer((ws) => ws.on("message", (data: Buffer) => ws.send(data)));
  } else {
    // one worker (path /worker), backbones on any other path: bytes forwarded, never parsed
    let worker: WebSocket | undefined;
    let backbone: WebSocket | undefined;
    port = await wsServer((ws, path) => {
      const validate = (data: Buffer) => args.codec && decodeFrame(data, { maxFrameBytes: MAX, raw: true });
      if (path === "/worker") {
        worker = ws;
        ws.on("message", (data: Buffer) => {
          validate(data);
          backbone?.send(data);
        });
      } else {
        backbone = ws;
        ws.on("message", (data: Buffer) => {
          validate(data);
          worker?.send(data);
        });
      }
    });
  }
  process.send?.({ port: String(port) });
  onParentMessage(() => process.exit(0));
}

main().catch((error: unknown) => {
  process.stderr.write(`roundtrip-peer ${args.mode}: ${String(error)}\n`);
  process.exit(1);
});

// Child process of the `relay` and `roundtrip` benchmarks: `relay` mode runs the hub's relay alone
// on a loopback port (listenRelay; over TLS with `tls`), `hub` mode a whole hub (createHub, as
// moeswarm-hub runs it: its relay feeds the hub's metrics, market and placement with every
// forwarded dispatch and answer; no models, no leases asked, state in memory); `worker` mode joins
// either as an echo worker (pinning the relay's certificate with `pin`) and also serves the same
// echo on a direct WebSocket, so both paths end in the same process doing the same work.
import { decodeFrame, encodeFrame, type Frame, PROTOCOL_VERSION, tuneHeapForFrames } from "@moeswarm/core";
import { connectRelay, dialWebSocket, parseDirectKey, serveDirect } from "@moeswarm/relay-client";
import { WebSocketServer } from "ws";
import { onParentMessage } from "./children.js";

interface Args {
  mode: "relay" | "hub" | "worker";
  secret?: string;
  /** relay, hub: serve wss with this certificate and key. */
  tls?: { cert: string; key: string };
  relayUrl?: string;
  /** worker: the SHA-256 fingerprint of the relay's certificate, pinned (a self-signed one). */
  pin?: string;
  token?: string;
  model?: string;
  /** worker: also serve the product's direct endpoint (serveDirect) with this certificate and hub key. */
  direct?: { cert: string; key: string; hubKey: unknown };
}

const args = JSON.parse(process.argv[2] ?? "{}") as Args;
// as moeswarm-hub and moeswarm-worker set it: these processes are the product as deployed
tuneHeapForFrames();
const MAX = 64 * 1024 * 1024;

// the echo: a "sum" result is n*embd values, the same shape as the activations
function echo(frame: Extract<Frame, { t: "dispatch" }>): Float32Array {
  return frame.x instanceof Float32Array ? frame.x : new Float32Array(frame.n * frame.embd);
}

// The relay's settings in both modes: the same limits, so the two relays are timed alike.
const RELAY = { maxFrameBytes: MAX, ratePerSec: 1e6, maxInFlight: 4096 };

/** `relay` or `hub` mode's server: its relay URL and how to close it. */
async function serveRelay(): Promise<{ url: string; close(): Promise<void> }> {
  // loaded here, not at the top: a worker process (the other mode) does not load the hub's code,
  // as moeswarm-worker does not
  const { createHub, listenRelay } = await import("@moeswarm/hub");
  const tls = args.tls ? { tls: args.tls } : {};
  if (args.mode === "relay") {
    const listener = await listenRelay({ secret: args.secret!, ...RELAY, ...tls });
    return { url: listener.url, close: () => listener.close() };
  }
  const hub = createHub({ secret: args.secret!, models: [], requireLeases: false, relay: RELAY, ...tls });
  return { url: (await hub.listen(0)).relayUrl, close: () => hub.close() };
}

async function main(): Promise<void> {
  if (args.mode !== "worker") {
    const server = await serveRelay();
    process.send?.({ url: server.url });
    onParentMessage(async () => {
      await server.close();
      process.exit(0);
    });
    return;
  }

  const wss = new WebSocketServer({ host: "127.0.0.1", port: 0, perMessageDeflate: false, maxPayload: MAX });
  await new Promise<void>((resolve) => wss.once("listening", () => resolve()));
  wss.on("connection", (ws) => {
    ws.on("error", () => {});
    ws.on("message", (data: Buffer) => {
      const frame = decodeFrame(data, { maxFrameBytes: MAX });
      let reply: Frame | undefined;
      if (frame.t === "hello") reply = { ...frame, token: "" };
      else if (frame.t === "ping") reply = { t: "pong", v: PROTOCOL_VERSION, seq: frame.seq, ts: frame.ts };
      else if (frame.t === "dispatch") {
        const { id, mode, n, k, embd } = frame;
        reply = { t: "result", v: PROTOCOL_VERSION, id, mode, n, k, embd, y: echo(frame) };
      }
      if (reply) ws.send(encodeFrame(reply, { maxFrameBytes: MAX }));
    });
  });
  const conn = await connectRelay(args.relayUrl!, {
    role: "worker",
    id: "echo",
    token: args.token!,
    maxFrameBytes: MAX,
    maxIncoming: 4096,
    onDispatch: (req) => ({
      y: req.x instanceof Float32Array ? req.x : new Float32Array(req.n * req.embd),
      ms: 0,
    }),
    ...(args.pin ? { dial: (url, o) => dialWebSocket(url, { ...o, pin: args.pin }) } : {}),
  });
  conn.register({ model: args.model!, layers: [0], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
  const d = args.direct;
  const product = d
    ? await serveDirect({
        id: "echo",
        cert: d.cert,
        key: d.key,
        host: "127.0.0.1",
        maxFrameBytes: MAX,
        maxIncoming: 4096,
        hubKey: async () => parseDirectKey(d.hubKey),
        onDispatch: (req) => ({
          y: req.x instanceof Float32Array ? req.x : new Float32Array(req.n * req.embd),
          ms: 0,
        }),
      })
    : undefined;
  process.send?.({
    directUrl: `ws://127.0.0.1:${(wss.address() as { port: number }).port}/`,
    ...(product ? { tlsUrl: `wss://127.0.0.1:${product.port}`, fingerprint: product.fingerprint } : {}),
  });
  onParentMessage(async () => {
    await product?.close();
    await conn.close();
    wss.close();
    process.exit(0);
  });
}

main().catch((error: unknown) => {
  process.stderr.write(`relay-peer ${args.mode}: ${String(error)}\n`);
  process.exit(1);
});

#!/usr/bin/env node
// A userspace TCP proxy that adds a fixed one-way delay to every chunk in both directions (the
// kernel here has no netem): RTT = 2 x delay on top of the real path. Order is preserved; nothing
// is dropped or reordered. Used by `pnpm bench throughput` between the backbone's bridge and the
// hub (HTTP and the relay's WebSocket alike).
//
//   node tools/delay-proxy.mjs --listen 127.0.0.1:0 --target 127.0.0.1:8080 --rtt-ms 10
import { createConnection, createServer } from "node:net";
import { fileURLToPath } from "node:url";

/**
 * Starts the proxy; resolves with its port and a close(). `rttMs` is split evenly between the two
 * directions; 0 forwards at once.
 */
export function startDelayProxy({ target, rttMs, host = "127.0.0.1", port = 0 }) {
  const [targetHost, targetPort] = splitHostPort(target);
  const oneWay = rttMs / 2;
  const sockets = new Set();
  const pipe = (from, to) => {
    // a chain of timers keeps the order: each chunk leaves oneWay ms after it arrived
    from.on("data", (chunk) => {
      if (oneWay <= 0) to.write(chunk);
      else setTimeout(() => to.destroyed || to.write(chunk), oneWay);
    });
    from.on("end", () => setTimeout(() => to.end(), oneWay));
    from.on("error", () => to.destroy());
    from.on("close", () => setTimeout(() => to.destroy(), oneWay));
  };
  const server = createServer({ noDelay: true }, (client) => {
    const upstream = createConnection({ host: targetHost, port: targetPort, noDelay: true });
    sockets.add(client);
    sockets.add(upstream);
    client.on("close", () => sockets.delete(client));
    upstream.on("close", () => sockets.delete(upstream));
    pipe(client, upstream);
    pipe(upstream, client);
  });
  return new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, host, () => {
      const { port: bound } = server.address();
      resolve({
        port: bound,
        url: `${host}:${bound}`,
        close: () =>
          new Promise((done) => {
            for (const s of sockets) s.destroy();
            server.close(() => done());
          }),
      });
    });
  });
}

function splitHostPort(s) {
  const colon = s.lastIndexOf(":");
  if (colon <= 0) throw new Error(`expected host:port, got ${s}`);
  return [s.slice(0, colon), Number(s.slice(colon + 1))];
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const args = process.argv.slice(2);
  const get = (flag) => {
    const i = args.indexOf(flag);
    return i >= 0 ? args[i + 1] : undefined;
  };
  if (args.includes("--help") || !get("--target")) {
    process.stdout.write("delay-proxy --target host:port [--listen host:port] --rtt-ms N\n");
    process.exit(args.includes("--help") ? 0 : 2);
  }
  const [host, port] = splitHostPort(get("--listen") ?? "127.0.0.1:0");
  const proxy = await startDelayProxy({
    target: get("--target"),
    rttMs: Number(get("--rtt-ms") ?? 0),
    host,
    port,
  });
  process.stdout.write(`${JSON.stringify({ event: "listening", address: proxy.url })}\n`);
  process.on("SIGINT", () => proxy.close().then(() => process.exit(0)));
  process.on("SIGTERM", () => proxy.close().then(() => process.exit(0)));
}

import { createServer as createHttpServer, type Server as HttpServer } from "node:http";
import { createServer as createHttpsServer, type Server as HttpsServer } from "node:https";
import type { AddressInfo } from "node:net";
import { InvalidArgumentError } from "@moeswarm/core";
import {
  type ConnectionGuard,
  type ConnectionLimits,
  checkLimits,
  guardServer,
  serverOptions,
} from "./connection-guard.js";
import { createRelay, type Relay, type RelayOptions } from "./relay.js";

export interface ListenRelayOptions extends RelayOptions {
  /** TCP port (default 0: any free port). */
  port?: number;
  /** Interface to bind (default 127.0.0.1; "0.0.0.0" or "::" to serve the network). */
  host?: string;
  /** Serve wss:// with this certificate and key (PEM); plain ws:// without. */
  tls?: { cert: string | Uint8Array; key: string | Uint8Array; ca?: string | Uint8Array };
  /** Connection caps and timeouts (README "Limits"). */
  limits?: ConnectionLimits;
}

export interface RelayListener extends AsyncDisposable {
  readonly relay: Relay;
  readonly server: HttpServer | HttpsServer;
  readonly port: number;
  /** The connection guard's figures (connections refused or closed, by reason). */
  readonly guard: ConnectionGuard;
  /** The URL clients dial, e.g. wss://127.0.0.1:8443/relay. */
  readonly url: string;
  close(): Promise<void>;
}

/**
 * A relay on its own port, for a relay-only deployment, tests and benchmarks, its connections
 * guarded by `limits` (connection-guard.ts) as the hub's are. An embedder's own server mounts a
 * relay with `relay.attach(server)` (unguarded: its server's limits are its own).
 */
export async function listenRelay(options: ListenRelayOptions): Promise<RelayListener> {
  const { port = 0, host = "127.0.0.1", tls, limits: limitOptions, ...relayOptions } = options;
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    throw new InvalidArgumentError("port must be an integer in 0..65535");
  }
  const limits = checkLimits(limitOptions);
  let guard: ConnectionGuard | undefined;
  const onEvent = relayOptions.onEvent;
  const relay = createRelay({
    ...relayOptions,
    onEvent: (event) => {
      if (event.type === "connect") guard?.authenticated(event.remote);
      onEvent?.(event);
    },
  });
  const created = serverOptions(limits);
  const server: HttpServer | HttpsServer = tls
    ? createHttpsServer({
        ...created,
        cert: toPem(tls.cert),
        key: toPem(tls.key),
        ca: tls.ca && toPem(tls.ca),
      })
    : createHttpServer(created);
  server.on("request", (_req, res) => {
    res.writeHead(426, { "content-type": "text/plain", connection: "close" });
    res.end(`this is a moeswarm relay: open a WebSocket on ${relay.path}\n`);
  });
  guard = guardServer(server, relay, limits, tls !== undefined);
  try {
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(port, host, () => {
        server.off("error", reject);
        resolve();
      });
    });
  } catch (error) {
    await relay.close();
    throw error;
  }
  const bound = (server.address() as AddressInfo).port;
  const hostPart = host.includes(":") ? `[${host}]` : host;
  const url = `${tls ? "wss" : "ws"}://${hostPart}:${bound}${relay.path}`;
  let closing: Promise<void> | undefined;
  const close = () => {
    closing ??= (async () => {
      const stopped = new Promise<void>((resolve) => server.close(() => resolve()));
      await relay.close();
      server.closeAllConnections();
      await stopped;
    })();
    return closing;
  };
  return { relay, server, port: bound, guard, url, close, [Symbol.asyncDispose]: close };
}

function toPem(value: string | Uint8Array): string | Buffer {
  return typeof value === "string" ? value : Buffer.from(value);
}

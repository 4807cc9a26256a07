// The hub's own server (`listen()`): one http(s) server for the API, the dashboard and the
// relay's WebSocket upgrade on `/relay`.
import {
  createServer as createHttpServer,
  type Server as HttpServer,
  type IncomingMessage,
  type ServerResponse,
} from "node:http";
import { createServer as createHttpsServer, type Server as HttpsServer } from "node:https";
import type { AddressInfo } from "node:net";
import { InvalidArgumentError } from "@moeswarm/core";
import type { TrustedProxies } from "./client-address.js";
import { type CheckedLimits, type ConnectionGuard, guardServer, serverOptions } from "./connection-guard.js";
import { badRequest, notFound, publicError, sendJson } from "./http-errors.js";
import type { HubListener, HubOptions } from "./hub-types.js";
import type { Relay } from "./relay.js";

export function checkListenAddress(port: number, host: string): void {
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    throw new InvalidArgumentError("port must be an integer in 0..65535");
  }
  if (typeof host !== "string" || host.length === 0) {
    throw new InvalidArgumentError("host must be an interface address or name");
  }
}

/**
 * A server whose requests go to `handle` (the hub's API) and whose upgrades go to the relay;
 * what `handle` declines is a 404, or a 426 on the relay's path (a plain request where a
 * WebSocket was expected). Its connections are guarded by `limits` (connection-guard.ts).
 */
export function createHubServer(
  tls: HubOptions["tls"],
  relay: Relay,
  limits: CheckedLimits,
  handle: (req: IncomingMessage, res: ServerResponse) => boolean,
  trustProxy?: TrustedProxies,
): { server: HttpServer | HttpsServer; guard: ConnectionGuard } {
  const options = serverOptions(limits);
  const server: HttpServer | HttpsServer = tls
    ? createHttpsServer({ ...options, cert: pem(tls.cert), key: pem(tls.key), ca: tls.ca && pem(tls.ca) })
    : createHttpServer(options);
  server.on("request", (req: IncomingMessage, res: ServerResponse) => {
    // closed by the connection guard (a proxied client over its address's cap): nothing is done
    if (req.socket.destroyed) return;
    if (handle(req, res)) return;
    const upgrade = (req.url ?? "").split("?")[0] === relay.path;
    const { body } = publicError(
      upgrade
        ? badRequest(`${relay.path} is the relay: open a WebSocket`)
        : notFound(`no such resource: ${req.url ?? ""}`),
    );
    sendJson(res, upgrade ? 426 : 404, body, upgrade ? { upgrade: "websocket" } : {}, req.method === "HEAD");
  });
  const guard = guardServer(server, relay, limits, tls !== undefined, trustProxy);
  return { server, guard };
}

/** Binds the server and names its URLs. */
export async function bindServer(
  server: HttpServer | HttpsServer,
  port: number,
  host: string,
  tls: boolean,
  relayPath: string,
): Promise<HubListener> {
  await new Promise<void>((resolveListen, reject) => {
    server.once("error", reject);
    server.listen(port, host, () => {
      server.off("error", reject);
      resolveListen();
    });
  });
  const bound = (server.address() as AddressInfo).port;
  const hostPart = host.includes(":") ? `[${host}]` : host;
  return {
    server,
    port: bound,
    url: `${tls ? "https" : "http"}://${hostPart}:${bound}`,
    relayUrl: `${tls ? "wss" : "ws"}://${hostPart}:${bound}${relayPath}`,
  };
}

function pem(value: string | Uint8Array): string | Buffer {
  return typeof value === "string" ? value : Buffer.from(value);
}

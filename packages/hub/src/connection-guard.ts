// The hub's defences against connections that cost it file descriptors and memory without doing
// any work: caps (global and per address), an idle timeout for connections that send nothing,
// HTTP header/request/keep-alive timeouts, and a cap on relay connections that have not said
// hello yet. One guard per server (the hub's, or a relay-only listener's).
import type { Server as HttpServer, IncomingMessage, ServerResponse } from "node:http";
import type { Server as HttpsServer } from "node:https";
import type { Duplex } from "node:stream";
import { InvalidArgumentError } from "@moeswarm/core";
import { clientAddress, type TrustedProxies } from "./client-address.js";
import type { Relay } from "./relay.js";

/** Limits on connections (each has a default; see the README's "Limits"). */
export interface ConnectionLimits {
  /** Open TCP connections in all (default 8192); more are closed at once. */
  maxConnections?: number;
  /** Open TCP connections from one IP address (default 256); more are closed at once. */
  maxConnectionsPerAddress?: number;
  /**
   * A connection with no request in progress that sends nothing for this long is closed
   * (default 30000 ms). Requests in progress (placement long-polls, slice downloads) and relay
   * WebSockets (they have heartbeats) are never cut by it.
   */
  idleConnectionMs?: number;
  /** Time to receive a request's headers (default 10000 ms); also the TLS handshake's. */
  headersTimeoutMs?: number;
  /** Time to receive a whole request, body included (default 60000 ms); answers are not limited. */
  requestTimeoutMs?: number;
  /** An idle kept-alive HTTP connection is closed after this (default 5000 ms). */
  keepAliveTimeoutMs?: number;
  /** Relay WebSockets from one address that have not said hello yet (default 64); more get 503. */
  maxUnauthenticatedPerAddress?: number;
}

export type ConnectionRefusal =
  | "global-cap"
  | "address-cap"
  | "idle"
  | "request-timeout"
  | "tls-handshake"
  | "unauthenticated-cap";

export const REFUSAL_REASONS: readonly ConnectionRefusal[] = [
  "global-cap",
  "address-cap",
  "idle",
  "request-timeout",
  "tls-handshake",
  "unauthenticated-cap",
];

export type CheckedLimits = Required<ConnectionLimits>;

function limit(name: string, value: number | undefined, fallback: number): number {
  const v = value ?? fallback;
  if (!Number.isSafeInteger(v) || v < 1) {
    throw new InvalidArgumentError(`limits.${name} must be an integer >= 1`);
  }
  return v;
}

/** Checks the limits (InvalidArgumentError), defaults filled in. */
export function checkLimits(limits: ConnectionLimits | undefined): CheckedLimits {
  if (limits !== undefined && (typeof limits !== "object" || limits === null)) {
    throw new InvalidArgumentError("limits must be an object");
  }
  const l = limits ?? {};
  const checked: CheckedLimits = {
    maxConnections: limit("maxConnections", l.maxConnections, 8192),
    maxConnectionsPerAddress: limit("maxConnectionsPerAddress", l.maxConnectionsPerAddress, 256),
    idleConnectionMs: limit("idleConnectionMs", l.idleConnectionMs, 30_000),
    headersTimeoutMs: limit("headersTimeoutMs", l.headersTimeoutMs, 10_000),
    requestTimeoutMs: limit("requestTimeoutMs", l.requestTimeoutMs, 60_000),
    keepAliveTimeoutMs: limit("keepAliveTimeoutMs", l.keepAliveTimeoutMs, 5000),
    maxUnauthenticatedPerAddress: limit("maxUnauthenticatedPerAddress", l.maxUnauthenticatedPerAddress, 64),
  };
  if (checked.headersTimeoutMs > checked.requestTimeoutMs) {
    throw new InvalidArgumentError("limits.headersTimeoutMs must not exceed limits.requestTimeoutMs");
  }
  return checked;
}

/** Options of `createServer` that the limits set (node:http and node:https take the same). */
export function serverOptions(limits: CheckedLimits): {
  headersTimeout: number;
  requestTimeout: number;
  keepAliveTimeout: number;
  connectionsCheckingInterval: number;
  handshakeTimeout: number;
} {
  return {
    headersTimeout: limits.headersTimeoutMs,
    requestTimeout: limits.requestTimeoutMs,
    keepAliveTimeout: limits.keepAliveTimeoutMs,
    // how often node looks for requests past their timeouts: its default (30 s) would let a
    // short timeout run several times over
    connectionsCheckingInterval: Math.max(10, Math.min(1000, Math.floor(limits.headersTimeoutMs / 4))),
    handshakeTimeout: limits.headersTimeoutMs,
  };
}

interface Connection {
  /** The client's address (behind a trusted proxy: X-Forwarded-For's, from its first request on). */
  address: string;
  /** From a trusted proxy: counted under `address` once a request names the client. */
  readonly proxied: boolean;
  counted: boolean;
  /** Requests in progress on it (a long-poll or a download keeps it busy, never idle). */
  busy: number;
  /** Taken over by the relay: its heartbeats and hello timeout govern it from then on. */
  upgraded: boolean;
  /** Upgraded and not yet past hello (counted against the address's unauthenticated cap). */
  unauthenticated: boolean;
  lastActive: number;
}

export interface ConnectionGuard {
  /** Connections closed or refused by the guard, by reason, since the server started. */
  refused(): Record<ConnectionRefusal, number>;
  /** Open TCP connections. */
  open(): number;
  /** The relay said hello on the connection from `remote` ("address:port"). */
  authenticated(remote: string): void;
}

/**
 * Guards `server` and mounts `relay` on it (instead of `relay.attach`): every connection is
 * counted by address, closed at once beyond a cap, closed when idle, and relay upgrades from an
 * address with too many connections that have not said hello are answered 503.
 */
export function guardServer(
  server: HttpServer | HttpsServer,
  relay: Relay,
  limits: CheckedLimits,
  tls: boolean,
  trustProxy?: TrustedProxies,
): ConnectionGuard {
  const refusals = Object.fromEntries(REFUSAL_REASONS.map((r) => [r, 0])) as Record<
    ConnectionRefusal,
    number
  >;
  const perAddress = new Map<string, number>();
  const unauthenticated = new Map<string, number>();
  // keyed by the socket http reads (the TLS socket on https): requests and upgrades name it
  const connections = new Map<Duplex, Connection>();
  const byRemote = new Map<string, Connection>();
  let open = 0;
  // also set on the server itself: createServer's options set them too, this holds whatever
  // created the server
  server.headersTimeout = limits.headersTimeoutMs;
  server.requestTimeout = limits.requestTimeoutMs;
  server.keepAliveTimeout = limits.keepAliveTimeoutMs;

  const bump = (map: Map<string, number>, key: string, by: number) => {
    const n = (map.get(key) ?? 0) + by;
    if (n <= 0) map.delete(key);
    else map.set(key, n);
  };
  const endUnauthenticated = (c: Connection) => {
    if (!c.unauthenticated) return;
    c.unauthenticated = false;
    bump(unauthenticated, c.address, -1);
  };
  const track = (socket: Duplex & { remoteAddress?: string; remotePort?: number }, address: string) => {
    const proxied = trustProxy?.has(address) === true;
    const c: Connection = {
      address,
      proxied,
      counted: false,
      busy: 0,
      upgraded: false,
      unauthenticated: false,
      lastActive: Date.now(),
    };
    const remote = `${socket.remoteAddress ?? "?"}:${socket.remotePort ?? "?"}`;
    connections.set(socket, c);
    byRemote.set(remote, c);
    socket.on("data", () => {
      c.lastActive = Date.now();
    });
    socket.once("close", () => {
      connections.delete(socket);
      if (byRemote.get(remote) === c) byRemote.delete(remote);
      endUnauthenticated(c);
      if (c.counted) bump(perAddress, c.address, -1);
    });
  };
  const attribute = attributeProxied({ trustProxy, limits, refusals, perAddress, bump, endUnauthenticated });

  server.on("connection", (socket) => {
    const address = socket.remoteAddress ?? "?";
    // a trusted proxy's connections count under their clients' addresses (attribute)
    const proxied = trustProxy?.has(address) === true;
    const reason: ConnectionRefusal | undefined =
      open >= limits.maxConnections
        ? "global-cap"
        : !proxied && (perAddress.get(address) ?? 0) >= limits.maxConnectionsPerAddress
          ? "address-cap"
          : undefined;
    socket.on("error", () => {});
    if (reason) {
      refusals[reason]++;
      socket.destroy();
      return;
    }
    open++;
    if (!proxied) bump(perAddress, address, 1);
    socket.once("close", () => {
      open--;
      if (!proxied) bump(perAddress, address, -1);
    });
    // a TLS connection is tracked once its handshake is done (the handshake has its own timeout)
    if (!tls) track(socket, address);
  });
  if (tls) {
    server.on("secureConnection", (socket) => track(socket, socket.remoteAddress ?? "?"));
    server.on("tlsClientError", (error: NodeJS.ErrnoException) => {
      if (error.code === "ERR_TLS_HANDSHAKE_TIMEOUT") refusals["tls-handshake"]++;
    });
  }
  // behind a trusted proxy, before the hub's handler: a refused request must do nothing
  // (hub-server.ts checks `destroyed`)
  if (trustProxy) {
    server.prependListener("request", (req: IncomingMessage) => {
      const c = connections.get(req.socket);
      if (c && !attribute(c, req)) req.socket.destroy();
    });
  }
  server.on("request", (req: IncomingMessage, res: ServerResponse) => {
    const c = connections.get(req.socket);
    if (!c || req.socket.destroyed) return;
    c.busy++;
    res.once("close", () => {
      c.busy--;
      c.lastActive = Date.now();
    });
  });
  server.on("clientError", clientErrorHandler(refusals));
  server.on("upgrade", (req: IncomingMessage, socket: Duplex, head: Buffer) => {
    const c = connections.get(req.socket);
    if (c && !attribute(c, req)) return unavailable(socket);
    if (c) {
      c.upgraded = true;
      if ((unauthenticated.get(c.address) ?? 0) >= limits.maxUnauthenticatedPerAddress) {
        refusals["unauthenticated-cap"]++;
        return unavailable(socket);
      }
      c.unauthenticated = true;
      bump(unauthenticated, c.address, 1);
    }
    if (relay.handleUpgrade(req, socket, head)) return;
    // nobody else on this server takes upgrades: say so rather than leave the socket hanging
    socket.on("error", () => {});
    socket.end("HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
  });

  startIdleSweep(server, connections, limits.idleConnectionMs, refusals);

  return {
    refused: () => ({ ...refusals }),
    open: () => open,
    authenticated(remote) {
      const c = byRemote.get(remote);
      if (c) endUnauthenticated(c);
    },
  };
}

type Refusals = Record<ConnectionRefusal, number>;

/** A refused upgrade: 503, then closed. */
function unavailable(socket: Duplex): void {
  socket.on("error", () => {});
  socket.end("HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
}

/**
 * Behind a trusted proxy (client-address.ts): a connection is counted under the client its
 * request names, moved when a later request names another; false when that client's address
 * is over its cap.
 */
function attributeProxied(g: {
  trustProxy: TrustedProxies | undefined;
  limits: CheckedLimits;
  refusals: Refusals;
  perAddress: Map<string, number>;
  bump: (map: Map<string, number>, key: string, by: number) => void;
  endUnauthenticated: (c: Connection) => void;
}): (c: Connection, req: IncomingMessage) => boolean {
  return (c, req) => {
    if (!c.proxied) return true;
    const { address } = clientAddress(req, g.trustProxy);
    if (c.counted && address === c.address) return true;
    if ((g.perAddress.get(address) ?? 0) >= g.limits.maxConnectionsPerAddress) {
      g.refusals["address-cap"]++;
      return false;
    }
    g.endUnauthenticated(c);
    if (c.counted) g.bump(g.perAddress, c.address, -1);
    c.address = address;
    c.counted = true;
    g.bump(g.perAddress, address, 1);
    return true;
  };
}

/** What node answers a request it cannot parse or that ran out of time, with the timeouts counted. */
function clientErrorHandler(refusals: Refusals) {
  return (error: NodeJS.ErrnoException, socket: Duplex) => {
    // what node answers without a listener, with the timeouts counted
    const timedOut = error.code === "ERR_HTTP_REQUEST_TIMEOUT";
    if (timedOut) refusals["request-timeout"]++;
    if (socket.writable && error.code !== "ECONNRESET") {
      const status = timedOut
        ? "408 Request Timeout"
        : error.code === "HPE_HEADER_OVERFLOW"
          ? "431 Request Header Fields Too Large"
          : "400 Bad Request";
      socket.end(`HTTP/1.1 ${status}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n`);
      // the answer's bytes first; a peer that never reads them does not keep the socket
      setTimeout(() => socket.destroy(), 1000).unref?.();
    } else socket.destroy();
  };
}

/** Closes connections with nothing in progress that sent nothing for `idleMs`. */
function startIdleSweep(
  server: HttpServer | HttpsServer,
  connections: Map<Duplex, Connection>,
  idleMs: number,
  refusals: Refusals,
): void {
  // the idle sweep: a connection with nothing in progress that sent nothing for idleConnectionMs
  const period = Math.max(10, Math.min(1000, Math.floor(idleMs / 4)));
  const sweep = setInterval(() => {
    const now = Date.now();
    for (const [socket, c] of connections) {
      if (c.busy > 0 || c.upgraded || now - c.lastActive < idleMs) continue;
      refusals.idle++;
      connections.delete(socket);
      socket.destroy();
    }
  }, period);
  sweep.unref?.();
  server.once("close", () => clearInterval(sweep));
}

// What the request handlers reach of the hub: one object the hub builds at construction, so the
// handlers live in modules by area rather than as private methods of one class.
import type { IncomingMessage, ServerResponse } from "node:http";
import type { ExpertSlice } from "@moeswarm/shard";
import type { ModelRegistry } from "../hub-models.js";
import type { Settings } from "../hub-options.js";
import type { HubStatus } from "../hub-types.js";
import type { Lease } from "../market.js";
import type { MarketHttpContext } from "../market-http.js";
import type { HubMetrics } from "../metrics.js";
import type { Relay } from "../relay.js";
import { type TokenClaims, type TokenRole, verifyToken } from "../token.js";
import type { HubWorkerInfo } from "../worker-book.js";

export interface RouteContext {
  readonly settings: Settings;
  readonly metrics: HubMetrics;
  readonly relay: Relay;
  readonly models: ModelRegistry;
  readonly marketHttp: MarketHttpContext;
  /** Downloads in flight (the hub aborts them when it closes). */
  readonly downloads: Set<AbortController>;
  /** The ETag of each planned slice, computed once. */
  readonly etags: WeakMap<ExpertSlice, string>;
  workers(): HubWorkerInfo[];
  status(options: { model?: string }): HubStatus;
  /** Reports a lease change to the hub's onEvent hook. */
  emitLease(action: "granted" | "renewed" | "released", lease: Lease): void;
}

/** One request, routed: its path parameters (percent-decoded) and query string. */
export interface RouteCall {
  readonly req: IncomingMessage;
  readonly res: ServerResponse;
  readonly method: string;
  /** HEAD: answer the headers only. */
  readonly head: boolean;
  readonly params: Readonly<Record<string, string>>;
  /** The query string, without `?`. */
  readonly query: string;
}

export type Handler = (ctx: RouteContext, call: RouteCall) => void | Promise<void>;

export function headerOf(req: IncomingMessage, name: string): string | undefined {
  const v = req.headers[name];
  return Array.isArray(v) ? v.join(", ") : v;
}

/** Verifies the request's bearer token (any role for reads, `role` for writes). */
export function authorize(settings: Settings, req: IncomingMessage, role?: TokenRole): TokenClaims {
  const header = headerOf(req, "authorization");
  const m = header === undefined ? null : /^Bearer[ ]+(\S+)\s*$/i.exec(header);
  return verifyToken(m ? m[1] : header === undefined ? undefined : "?", settings.secret, { role });
}

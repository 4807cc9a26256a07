// What the request handlers reach of the hub: one object the hub builds at construction, so the
// handlers live in modules by area rather than as private methods of one class.
import type { IncomingMessage, ServerResponse } from "node:http";
import { AuthError } from "@moeswarm/core";
import type { ExpertSlice } from "@moeswarm/shard";
import type { DirectKeys } from "../direct.js";
import type { Enrolled, IssuedCode, IssueOptions } from "../enrolment.js";
import type { ModelRegistry } from "../hub-models.js";
import type { Settings } from "../hub-options.js";
import type { HubStatus } from "../hub-types.js";
import type { Lease } from "../market.js";
import type { MarketHttpContext } from "../market-http.js";
import type { HubMetrics } from "../metrics.js";
import type { Relay } from "../relay.js";
import type { HubStore } from "../store.js";
import type { QuarantineEvidence, QuarantineRecord } from "../store-reports.js";
import { type TokenClaims, type TokenRole, unboundMessage, verifyToken } from "../token.js";
import type { HubWorkerInfo } from "../worker-book.js";
import type { WorkerPauses } from "../worker-pause.js";

export interface RouteContext {
  readonly settings: Settings;
  /** The hub's store (GET /api/health names its kind and driver). */
  readonly store: Pick<HubStore, "kind" | "driver">;
  readonly metrics: HubMetrics;
  readonly relay: Relay;
  readonly models: ModelRegistry;
  readonly marketHttp: MarketHttpContext;
  /** The key that signs direct-link tickets. */
  readonly directKeys: DirectKeys;
  /** Downloads in flight (the hub aborts them when it closes). */
  readonly downloads: Set<AbortController>;
  /** The ETag of each planned slice, computed once. */
  readonly etags: WeakMap<ExpertSlice, string>;
  workers(): HubWorkerInfo[];
  status(options: { model?: string }): HubStatus;
  /** Whether the relay ever forwarded a request of this backbone to this worker. */
  forwardedTo(backbone: string, worker: string): boolean;
  /** Records and applies a quarantine (reputation.ts). */
  quarantine(backbone: string, model: string, evidence: QuarantineEvidence): Promise<QuarantineRecord>;
  /** Lifts a quarantine; false when the worker was not quarantined. */
  reinstate(worker: string): Promise<boolean>;
  /** The quarantines in force. */
  quarantines(): QuarantineRecord[];
  /** Trades an enrolment code for a worker token (enrolment.ts). */
  enrol(code: unknown, address?: string): Promise<Enrolled>;
  /** Issues an enrolment code (admin). */
  issueEnrolCode(options: IssueOptions): Promise<IssuedCode>;
  /** Workers' pauses (worker-pause.ts). */
  readonly pauses: WorkerPauses;
  /** The principal a worker belongs to: its live connection's token, else its enrolment; undefined when unknown. */
  workerOwner(id: string): Promise<string | undefined>;
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
  const claims = verifyToken(m ? m[1] : header === undefined ? undefined : "?", settings.secret, { role });
  // a write by an unbound worker or backbone token could act for any id (README "Tokens")
  if (
    role !== undefined &&
    claims.role !== "admin" &&
    claims.id === undefined &&
    !settings.allowUnboundTokens
  ) {
    throw new AuthError("MOESWARM_AUTH_INVALID", unboundMessage(claims.role));
  }
  return claims;
}

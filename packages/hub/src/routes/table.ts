// The hub's routes in one table: each path template with, per method, who may call it and the
// handler. Matching, the 405 (with Allow) and the token checks are done here, once, for all.
import type { IncomingMessage, ServerResponse } from "node:http";
import { badRequest, methodNotAllowed, notFound } from "../http-errors.js";
import type { RouteLabel } from "../metrics.js";
import { authorize, type Handler, type RouteContext } from "./context.js";
import { getDashboard, getMetrics, getStatus } from "./dashboard.js";
import { getDirectKey, postDirectServed, postDirectTicket, putWorkerDirect } from "./direct.js";
import { getHealth } from "./health.js";
import * as market from "./market.js";
import { getManifest, getModel, listModels, registerModel, removeModel } from "./models.js";
import { enrol, issueEnrolCode, listQuarantines, reinstateWorker, reportQuarantine } from "./reputation.js";
import { getExpertShard } from "./shard.js";
import {
  drainWorker,
  getWorkerPause,
  listPauses,
  listWorkers,
  pauseWorker,
  resumeWorker,
} from "./workers.js";

/**
 * Who may call an endpoint: anyone (`public`); any valid token unless the hub serves public reads
 * (`read`); an admin token (`admin`); or `self`: the handler verifies the token itself, because
 * it needs the claims (the worker or backbone a token is bound to).
 */
export type Access = "public" | "read" | "admin" | "self";

interface Endpoint {
  readonly access: Access;
  readonly handle: Handler;
}

interface Route {
  readonly label: Exclude<RouteLabel, "other">;
  /** The label's segments; `:name` matches any one segment. */
  readonly segments: readonly string[];
  /** In the order the Allow header lists them. */
  readonly methods: Readonly<Record<string, Endpoint>>;
}

const read = (handle: Handler) =>
  ({ GET: { access: "read", handle }, HEAD: { access: "read", handle } }) as const;

function route(label: Route["label"], methods: Route["methods"]): Route {
  return { label, segments: label.split("/").slice(1), methods };
}

/** First match wins (`/api/claims/auto` before `/api/claims/:id`). */
const ROUTES: readonly Route[] = [
  route("/metrics", read(getMetrics)),
  route("/", {
    GET: { access: "public", handle: getDashboard },
    HEAD: { access: "public", handle: getDashboard },
  }),
  route("/api/workers", read(listWorkers)),
  route("/api/workers/:id/drain", { POST: { access: "admin", handle: drainWorker } }),
  route("/api/workers/:id/reinstate", { POST: { access: "admin", handle: reinstateWorker } }),
  route("/api/workers/:id/pause", { ...read(getWorkerPause), POST: { access: "self", handle: pauseWorker } }),
  route("/api/workers/:id/resume", { POST: { access: "self", handle: resumeWorker } }),
  route("/api/workers/:id/direct", { PUT: { access: "self", handle: putWorkerDirect } }),
  route("/api/workers/:id/direct/served", { POST: { access: "self", handle: postDirectServed } }),
  route("/api/direct/key", {
    GET: { access: "public", handle: getDirectKey },
    HEAD: { access: "public", handle: getDirectKey },
  }),
  route("/api/direct/tickets", { POST: { access: "self", handle: postDirectTicket } }),
  route("/api/pauses", read(listPauses)),
  route("/api/quarantines", read(listQuarantines)),
  route("/api/enrol", { POST: { access: "public", handle: enrol } }),
  route("/api/enrol-codes", { POST: { access: "admin", handle: issueEnrolCode } }),
  route("/api/status", read(getStatus)),
  route("/api/health", {
    GET: { access: "public", handle: getHealth },
    HEAD: { access: "public", handle: getHealth },
  }),
  route("/api/demand", read(market.demand)),
  route("/api/claims", { POST: { access: "self", handle: market.claim } }),
  route("/api/claims/auto", { POST: { access: "self", handle: market.autoClaim } }),
  route("/api/claims/:id", {
    GET: { access: "self", handle: market.lease },
    HEAD: { access: "self", handle: market.lease },
    DELETE: { access: "self", handle: market.lease },
  }),
  route("/api/claims/:id/renew", { POST: { access: "self", handle: market.renew } }),
  route("/api/models", { ...read(listModels), POST: { access: "admin", handle: registerModel } }),
  route("/api/models/:model", { ...read(getModel), DELETE: { access: "admin", handle: removeModel } }),
  route("/api/models/:model/manifest", read(getManifest)),
  route("/api/models/:model/expert-shard", read(getExpertShard)),
  route("/api/models/:model/placement", read(market.placement)),
  route("/api/models/:model/stats", { POST: { access: "self", handle: market.stats } }),
  route("/api/models/:model/reports/quarantine", { POST: { access: "self", handle: reportQuarantine } }),
];

export interface RouteMatch {
  readonly route: Route | undefined;
  readonly label: RouteLabel;
  readonly params: Record<string, string>;
}

/** The route of a path (its segments percent-decoded: a model id is matched as a name, never used as a path). */
export function matchRoute(path: string): RouteMatch {
  const segments = decodeSegments(path);
  for (const r of ROUTES) {
    if (r.segments.length !== segments.length) continue;
    const params: Record<string, string> = {};
    const hit = r.segments.every((s, i) => {
      const seg = segments[i] as string;
      if (s.startsWith(":")) {
        params[s.slice(1)] = seg;
        return true;
      }
      return s === seg;
    });
    if (hit) return { route: r, label: r.label, params };
  }
  return { route: undefined, label: "other", params: {} };
}

/** Answers a matched request: 404 without a route, 405 (Allow) for a method it lacks, then the token. */
export async function serveRoute(
  ctx: RouteContext,
  match: RouteMatch,
  req: IncomingMessage,
  res: ServerResponse,
  query: string,
): Promise<void> {
  const { route: r, params } = match;
  if (r === undefined) throw notFound(`no such resource: ${req.url ?? ""}`);
  const method = req.method ?? "GET";
  const endpoint = Object.hasOwn(r.methods, method) ? r.methods[method] : undefined;
  if (endpoint === undefined) throw methodNotAllowed(method, Object.keys(r.methods));
  if (endpoint.access === "admin") authorize(ctx.settings, req, "admin");
  else if (endpoint.access === "read" && !ctx.settings.publicReads) authorize(ctx.settings, req);
  await endpoint.handle(ctx, { req, res, method, head: method === "HEAD", params, query });
}

function decodeSegments(path: string): string[] {
  return path
    .split("/")
    .slice(1)
    .map((s) => {
      try {
        return decodeURIComponent(s);
      } catch {
        throw badRequest("the path has malformed percent-encoding");
      }
    });
}

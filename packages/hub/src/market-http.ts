import type { IncomingMessage, ServerResponse } from "node:http";
import {
  AUTO_CLAIM_BODY_SHAPE,
  AuthError,
  CAPACITY_SHAPE,
  CLAIM_BODY_SHAPE,
  type DemandJson,
  formatRange,
  isMoeswarmError,
  type LeaseJson,
  manifestUrl,
  type PlacementJson,
  parseRange,
  RENEW_BODY_SHAPE,
  type ReleasedJson,
  type StatsOutcomeJson,
  shardUrl,
} from "@moeswarm/core";
import { readJsonBody } from "./http-body.js";
import { badRequest, methodNotAllowed, sendJson } from "./http-errors.js";
import { capacityBytes, isWorkerId, type Lease, type MarketModel, type WorkerCapacity } from "./market.js";
import type { MarketBook } from "./market-book.js";
import type { Claimant } from "./market-demand.js";
import type { HubMetrics } from "./metrics.js";
import { parseStatsReport } from "./stats.js";
import { isModelId } from "./store.js";
import { principalOf, type TokenClaims, type TokenRole } from "./token.js";

/** What the market's routes need from the hub. */
export interface MarketHttpContext {
  readonly book: MarketBook;
  readonly metrics: HubMetrics;
  /** Verifies the bearer token (for `role`, or any role). */
  authorize(req: IncomingMessage, role?: TokenRole): TokenClaims;
  /** Throws unless reads are allowed (public, or with any valid token). */
  checkRead(req: IncomingMessage): void;
  /** The market shape of a served model; HubError MOESWARM_HUB_NOT_FOUND otherwise. */
  model(id: string): MarketModel;
  maxBodyBytes: number;
  maxStatsBytes: number;
  /** Longest wait of a placement long-poll, ms. */
  maxPollMs: number;
}

// The bodies (LeaseJson, DemandJson, the claim shapes, StatsReport...) are core's hub-api.ts,
// shared with the clients.
export { type LeaseJson, shardUrl } from "@moeswarm/core";

export function leaseJson(lease: Lease, now: number): LeaseJson {
  const layers = formatRange(lease.layers);
  const experts = formatRange(lease.experts);
  return {
    leaseId: lease.id,
    worker: lease.worker,
    model: lease.model,
    layers,
    experts,
    bytes: lease.bytes,
    grantedAt: lease.grantedAt,
    expiresAt: lease.expiresAt,
    ttlMs: Math.max(0, lease.expiresAt - now),
    url: shardUrl(lease.model, layers, experts),
    manifest: manifestUrl(lease.model),
    capacity: lease.capacity,
  };
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function objectBody(body: unknown, shape: string): Record<string, unknown> {
  if (body === undefined) return {};
  if (!isObject(body)) throw badRequest(`the body must be a JSON object ${shape}`);
  return body;
}

/** The worker a claim is for: the token's bound id, or (unbound token) the body's `worker`. */
function claimant(claims: TokenClaims, body: Record<string, unknown>): string {
  const asked = body.worker;
  if (asked !== undefined && !isWorkerId(asked)) throw badRequest('"worker" must be an id of 1..128 bytes');
  if (claims.id !== undefined) {
    if (asked !== undefined && asked !== claims.id) {
      throw new AuthError("MOESWARM_AUTH_ROLE", `the token is bound to worker ${JSON.stringify(claims.id)}`, {
        details: { tokenId: claims.id, id: asked },
      });
    }
    return claims.id;
  }
  if (asked === undefined)
    throw badRequest('"worker" is required when the token is not bound to a worker id');
  return asked;
}

/**
 * Whose leases a token may touch: a bound worker token only its own; an admin token, or an
 * unbound worker token (whose holder knows the unguessable lease id), any.
 */
function owner(claims: TokenClaims): string | undefined {
  return claims.role === "admin" ? undefined : claims.id;
}

function capacityOf(body: Record<string, unknown>): WorkerCapacity {
  const c = body.capacity;
  if (!isObject(c)) {
    throw badRequest(`"capacity" must be an object ${CAPACITY_SHAPE}`);
  }
  const capacity: WorkerCapacity = {
    ...(c.ramBytes === undefined ? {} : { ramBytes: c.ramBytes as number }),
    ...(c.vramBytes === undefined ? {} : { vramBytes: c.vramBytes as number }),
    ...(c.backend === undefined ? {} : { backend: c.backend as string }),
    ...(c.bandwidthBps === undefined ? {} : { bandwidthBps: c.bandwidthBps as number }),
  };
  capacityBytes(capacity); // InvalidArgumentError (400) with the field at fault
  return capacity;
}

function ttlOf(body: Record<string, unknown>): number | undefined {
  const t = body.ttlMs;
  if (t === undefined) return undefined;
  if (!Number.isSafeInteger(t)) throw badRequest('"ttlMs" must be an integer number of milliseconds');
  return t as number;
}

function modelOf(ctx: MarketHttpContext, value: unknown, required: boolean): string | undefined {
  if (value === undefined && !required) return undefined;
  if (!isModelId(value)) throw badRequest('"model" must name a model of this hub');
  ctx.model(value); // 404 for a model this hub does not serve
  return value;
}

function rangeOf(value: unknown, name: string): { start: number; end: number } {
  if (typeof value !== "string") throw badRequest(`"${name}" must be a half-open range "a:b"`);
  return parseRange(value);
}

async function countClaim<T>(ctx: MarketHttpContext, run: () => Promise<T>): Promise<T> {
  try {
    const out = await run();
    ctx.metrics.claim("granted");
    return out;
  } catch (error) {
    const reason = isMoeswarmError(error, "MOESWARM_HUB_CONFLICT") ? error.details?.reason : undefined;
    ctx.metrics.claim(typeof reason === "string" ? reason : "invalid");
    throw error;
  }
}

/** POST /api/claims and POST /api/claims/auto. */
export async function postClaim(
  ctx: MarketHttpContext,
  req: IncomingMessage,
  res: ServerResponse,
  auto: boolean,
): Promise<Lease> {
  const claims = ctx.authorize(req, "worker");
  const body = objectBody(
    await readJsonBody(req, res, ctx.maxBodyBytes),
    auto ? AUTO_CLAIM_BODY_SHAPE : CLAIM_BODY_SHAPE,
  );
  const worker = claimant(claims, body);
  // the token's principal (an admin claiming for a worker: the one that worker registered with)
  const principal = claims.role === "admin" ? undefined : principalOf(claims, worker);
  const who = principal !== undefined ? { owner: principal } : {};
  const capacity = capacityOf(body);
  const ttlMs = ttlOf(body);
  const { book } = ctx;
  const market = book.market;
  const lease = await countClaim(ctx, () => {
    if (auto) {
      const model = modelOf(ctx, body.model, false);
      return book.writeLease(
        () =>
          market.autoClaim(
            { worker, capacity, ...(model ? { model } : {}), ...(ttlMs ? { ttlMs } : {}), ...who },
            book.now(),
          ),
        (l) => market.release(l.id, undefined, book.now()),
      );
    }
    const model = modelOf(ctx, body.model, true) as string;
    const layers = rangeOf(body.layers, "layers");
    const experts = rangeOf(body.experts, "experts");
    const replace = body.replaceLeases;
    if (replace !== undefined && typeof replace !== "boolean")
      throw badRequest('"replaceLeases" must be a boolean');
    return book.writeLease(
      () =>
        market.claim(
          {
            worker,
            model,
            layers,
            experts,
            capacity,
            ...(ttlMs ? { ttlMs } : {}),
            ...(replace === true ? { replaceLeases: true } : {}),
            ...who,
          },
          book.now(),
        ),
      (l) => market.release(l.id, undefined, book.now()),
    );
  });
  sendJson(res, 201, leaseJson(lease, book.now()), {
    location: `/api/claims/${encodeURIComponent(lease.id)}`,
  });
  return lease;
}

/** GET / DELETE /api/claims/:id and POST /api/claims/:id/renew. */
export async function leaseRoute(
  ctx: MarketHttpContext,
  req: IncomingMessage,
  res: ServerResponse,
  method: string,
  id: string,
  renew: boolean,
): Promise<{ action: "renewed" | "released"; lease: Lease } | undefined> {
  const { book } = ctx;
  const market = book.market;
  if (renew) {
    if (method !== "POST") throw methodNotAllowed(method, ["POST"]);
    const claims = ctx.authorize(req, "worker");
    const body = objectBody(await readJsonBody(req, res, ctx.maxBodyBytes), RENEW_BODY_SHAPE);
    const ttlMs = ttlOf(body);
    const lease = await book.writeLease(
      () => market.renew(id, owner(claims), book.now(), ttlMs),
      // not persisted: the lease keeps its longer life here, the worker is told (503) and renews again
      () => {},
    );
    sendJson(res, 200, leaseJson(lease, book.now()));
    return { action: "renewed", lease };
  }
  if (method === "DELETE") {
    const claims = ctx.authorize(req, "worker");
    const lease = market.release(id, owner(claims), book.now());
    ctx.metrics.leaseEnded("released");
    await book.deleteLease(lease.id);
    sendJson(res, 200, { released: lease.id } satisfies ReleasedJson);
    return { action: "released", lease };
  }
  if (method !== "GET" && method !== "HEAD") throw methodNotAllowed(method, ["GET", "HEAD", "DELETE"]);
  const claims = ctx.authorize(req, "worker");
  sendJson(
    res,
    200,
    leaseJson(market.lease(id, owner(claims), book.now()), book.now()),
    {},
    method === "HEAD",
  );
  return undefined;
}

/**
 * The worker a demand read is for: a valid worker token bound to an id (its owner the token's,
 * else the id). Its demand leaves out what it and its owner's other workers hold, so a worker
 * never polls for cells a claim would refuse it (reason "held" or "owner"). Anyone else, a
 * missing or unusable token included (reads may be public), sees the demand as it is.
 */
function claimantOf(ctx: MarketHttpContext, req: IncomingMessage): Claimant | undefined {
  if (req.headers.authorization === undefined) return undefined;
  let claims: TokenClaims;
  try {
    claims = ctx.authorize(req, "worker");
  } catch {
    return undefined;
  }
  return claims.id === undefined ? undefined : { worker: claims.id, owner: principalOf(claims, claims.id) };
}

/** GET /api/demand?model=&limit= */
export function getDemand(
  ctx: MarketHttpContext,
  req: IncomingMessage,
  res: ServerResponse,
  query: string,
): void {
  const params = new URLSearchParams(query);
  const modelParam = params.get("model") ?? undefined;
  const model = modelParam === undefined ? undefined : (modelOf(ctx, modelParam, true) as string);
  const limitText = params.get("limit");
  let limit = Number.POSITIVE_INFINITY;
  if (limitText !== null) {
    if (!/^[1-9][0-9]{0,6}$/.test(limitText)) throw badRequest("limit must be an integer >= 1");
    limit = Number(limitText);
  }
  const { book } = ctx;
  const now = book.now();
  const market = book.market;
  const claimant = claimantOf(ctx, req);
  const ranges = market.demand(now, {
    ...(model === undefined ? {} : { model }),
    ...(claimant === undefined ? {} : { claimant }),
  });
  const p = market.policy;
  const body: DemandJson = {
    time: now,
    policy: {
      halfLifeMs: p.halfLifeMs,
      prior: p.prior,
      hotLoad: p.hotLoad,
      maxReplicas: p.maxReplicas,
      uncoveredValue: p.uncoveredValue,
      leaseTtlMs: market.leaseTtlMs,
    },
    models: (model === undefined ? market.modelIds() : [model]).map((m) => market.summary(m, now)),
    ranges: ranges.slice(0, limit).map((d) => {
      const layers = `${d.layer}:${d.layer + 1}`;
      const experts = formatRange(d.experts);
      return {
        model: d.model,
        layer: d.layer,
        layers,
        experts,
        count: d.count,
        target: d.target,
        coverage: d.coverage,
        pending: d.pending,
        missing: d.missing,
        hot: d.hot,
        value: d.value,
        bytes: d.bytes,
        bytesPerExpert: d.bytesPerExpert,
        nExpert: d.nExpert,
        url: shardUrl(d.model, layers, experts),
      };
    }),
  };
  sendJson(res, 200, body, {}, req.method === "HEAD");
}

/** GET /api/models/:model/placement?since=&wait= (long-poll). */
export async function getPlacement(
  ctx: MarketHttpContext,
  req: IncomingMessage,
  res: ServerResponse,
  model: string,
  query: string,
): Promise<void> {
  ctx.model(model);
  const params = new URLSearchParams(query);
  const sinceText = params.get("since");
  const waitText = params.get("wait");
  if (sinceText !== null && !/^(0|[1-9][0-9]{0,15})$/.test(sinceText)) {
    throw badRequest("since must be a placement version (an integer)");
  }
  if (waitText !== null && !/^[0-9]{1,4}$/.test(waitText)) throw badRequest("wait must be whole seconds");
  const waitMs = Math.min(ctx.maxPollMs, waitText === null ? ctx.maxPollMs : Number(waitText) * 1000);
  const market = ctx.book.market;
  const etagOf = (v: number) => `"p${v}"`;
  let since = sinceText === null ? undefined : Number(sinceText);
  const inm = req.headers["if-none-match"];
  if (since === undefined && typeof inm === "string") {
    const m = /^"p([0-9]{1,16})"$/.exec(inm.trim());
    if (m) since = Number(m[1]);
  }
  if (since !== undefined && market.version(model) === since && waitMs > 0 && sinceText !== null) {
    const abort = new AbortController();
    const onClose = () => abort.abort();
    res.once("close", onClose);
    try {
      await ctx.book.waitForChange(model, since, waitMs, abort.signal);
    } finally {
      res.off("close", onClose);
    }
    if (res.destroyed) return;
  }
  ctx.model(model); // it may have been removed while we waited
  const version = market.version(model);
  if (since !== undefined && version === since) {
    res.writeHead(304, { etag: etagOf(version), "cache-control": "no-cache" });
    res.end();
    return;
  }
  sendJson(
    res,
    200,
    market.placement(model) satisfies PlacementJson,
    { etag: etagOf(version), "cache-control": "no-cache" },
    req.method === "HEAD",
  );
}

/** POST /api/models/:model/stats (backbone token). */
export async function postStats(
  ctx: MarketHttpContext,
  req: IncomingMessage,
  res: ServerResponse,
  model: string,
): Promise<void> {
  const claims = ctx.authorize(req, "backbone");
  const shape = ctx.model(model);
  let report: ReturnType<typeof parseStatsReport>;
  try {
    report = parseStatsReport(await readJsonBody(req, res, ctx.maxStatsBytes), shape);
  } catch (error) {
    ctx.metrics.statsReport("rejected");
    throw error;
  }
  if (claims.id !== undefined && report.backbone !== undefined && report.backbone !== claims.id) {
    ctx.metrics.statsReport("rejected");
    throw new AuthError("MOESWARM_AUTH_ROLE", `the token is bound to backbone ${JSON.stringify(claims.id)}`);
  }
  const backbone = claims.id ?? report.backbone ?? "backbone";
  const outcome = ctx.book.ingest(model, backbone, report);
  await ctx.book.commit(); // on disk before it is acknowledged (a kill -9 loses no credit)
  ctx.metrics.statsReport(outcome.accepted ? "accepted" : "duplicate");
  sendJson(res, 200, { model, backbone, ...outcome } satisfies StatsOutcomeJson);
}

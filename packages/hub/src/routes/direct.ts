// Direct links: the ticket key (public), tickets for backbones, and workers' endpoints.
import { AuthError, type DirectServedOutcomeJson, isHubId } from "@moeswarm/core";
import { parseDirectEndpoint } from "../direct.js";
import { parseDirectServed } from "../direct-credit.js";
import { readJsonBody } from "../http-body.js";
import { badRequest, sendJson } from "../http-errors.js";
import type { Handler } from "./context.js";

/** GET /api/direct/key: the public key that verifies tickets (workers fetch it). */
export const getDirectKey: Handler = (ctx, { res, head }) => {
  sendJson(res, 200, ctx.directKeys.json, {}, head);
};

/**
 * POST /api/direct/tickets `{"worker": id}` with a backbone token: a ticket naming the token's
 * backbone (and principal) and that worker. The hub says only who is asking: which worker the
 * backbone may dispatch to is the worker's own check of its slices, as on the relay.
 */
export const postDirectTicket: Handler = async (ctx, { req, res }) => {
  const claims = ctx.marketHttp.authorize(req, "backbone");
  const body = await readJsonBody(req, res, ctx.settings.maxBodyBytes);
  const { worker, backbone } = (body ?? {}) as { worker?: unknown; backbone?: unknown };
  if (!isHubId(worker)) throw badRequest('the body must be {"worker": "<worker id>"}');
  if (claims.id !== undefined && backbone !== undefined && backbone !== claims.id) {
    throw new AuthError("MOESWARM_AUTH_ROLE", `the token is bound to backbone ${JSON.stringify(claims.id)}`);
  }
  // an unbound token (a private swarm) names its backbone in the body, as stats reports do
  const id = claims.id ?? (isHubId(backbone) ? backbone : undefined);
  if (id === undefined) throw badRequest('an unbound backbone token must name "backbone" in the body');
  sendJson(res, 200, ctx.directKeys.mint(id, claims.owner, worker));
};

/** PUT /api/workers/:id/direct with that worker's token: its endpoints (empty endpoints and native withdraw). */
export const putWorkerDirect: Handler = async (ctx, { req, res, params }) => {
  const id = params.id as string;
  const claims = ctx.marketHttp.authorize(req, "worker");
  if (claims.role !== "admin" && claims.id !== undefined && claims.id !== id) {
    throw new AuthError("MOESWARM_AUTH_ROLE", `the token is bound to worker ${JSON.stringify(claims.id)}`);
  }
  const direct = parseDirectEndpoint(await readJsonBody(req, res, ctx.settings.maxBodyBytes));
  ctx.marketHttp.book.setDirect(id, direct);
  sendJson(res, 200, { worker: id, ...(direct ?? { endpoints: [] }) });
};

/**
 * POST /api/workers/:id/direct/served with that worker's token: what it answered over direct
 * links per backbone and model. Credited where the backbones' own receipts agree (the minimum).
 */
export const postDirectServed: Handler = async (ctx, { req, res, params }) => {
  const id = params.id as string;
  const claims = ctx.marketHttp.authorize(req, "worker");
  // only the worker itself: an admin token does not speak for a worker's work either
  if (claims.role !== "worker" || (claims.id !== undefined && claims.id !== id)) {
    throw new AuthError(
      "MOESWARM_AUTH_ROLE",
      `only worker ${JSON.stringify(id)}'s own token reports its work`,
    );
  }
  const report = parseDirectServed(await readJsonBody(req, res, ctx.settings.maxBodyBytes));
  const book = ctx.marketHttp.book;
  const outcome = book.ingestDirect(id, report, (model) => ctx.models.find(model) !== undefined);
  await book.commit(); // on disk before it is acknowledged, as a backbone's stats
  sendJson(res, 200, { worker: id, ...outcome } satisfies DirectServedOutcomeJson);
};

// The coverage market's routes: demand, placement (long-poll), backbone stats and leases. The
// bodies and answers are market-http.ts's; this adds the hub's lease events.
import { getDemand, getPlacement, leaseRoute, postClaim, postStats } from "../market-http.js";
import type { Handler } from "./context.js";

export const demand: Handler = (ctx, { req, res, query }) => {
  getDemand(ctx.marketHttp, req, res, query);
};

export const placement: Handler = (ctx, { req, res, params, query }) =>
  getPlacement(ctx.marketHttp, req, res, params.model as string, query);

export const stats: Handler = (ctx, { req, res, params }) =>
  postStats(ctx.marketHttp, req, res, params.model as string);

export const claim: Handler = async (ctx, { req, res }) => {
  ctx.emitLease("granted", await postClaim(ctx.marketHttp, req, res, false));
};

export const autoClaim: Handler = async (ctx, { req, res }) => {
  ctx.emitLease("granted", await postClaim(ctx.marketHttp, req, res, true));
};

/** GET/HEAD/DELETE /api/claims/:id. */
export const lease: Handler = async (ctx, { req, res, method, params }) => {
  const done = await leaseRoute(ctx.marketHttp, req, res, method, params.id as string, false);
  if (done) ctx.emitLease(done.action, done.lease);
};

export const renew: Handler = async (ctx, { req, res, method, params }) => {
  const done = await leaseRoute(ctx.marketHttp, req, res, method, params.id as string, true);
  if (done) ctx.emitLease(done.action, done.lease);
};

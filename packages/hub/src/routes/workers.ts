// /api/workers: the workers the hub knows, draining one (admin), pausing and resuming one;
// /api/pauses: the pauses in force.
import { isHubId, type WorkerPauseListJson } from "@moeswarm/core";
import { readJsonBody } from "../http-body.js";
import { badRequest, notFound, sendJson } from "../http-errors.js";
import { pauserOf } from "../worker-pause.js";
import type { Handler, RouteCall, RouteContext } from "./context.js";

export const listWorkers: Handler = (ctx, { res, head }) => {
  sendJson(res, 200, { workers: ctx.workers() }, {}, head);
};

/** POST /api/workers/:id/drain: the relay sends the worker `drain` and routes it nothing new. */
export const drainWorker: Handler = async (ctx, { req, res, params }) => {
  const id = params.id as string;
  const body = await readJsonBody(req, res, ctx.settings.maxBodyBytes);
  if (body !== undefined && (typeof body !== "object" || body === null || Array.isArray(body))) {
    throw badRequest('the body must be empty or a JSON object {"reason"?: "<text>"}');
  }
  const reason = (body as { reason?: unknown } | undefined)?.reason;
  if (reason !== undefined && (typeof reason !== "string" || Buffer.byteLength(reason) > 1024)) {
    throw badRequest('"reason" must be a string of at most 1024 bytes');
  }
  if (!ctx.relay.drainWorker(id, reason)) {
    throw notFound(`no worker ${JSON.stringify(id)} is connected to this hub's relay`);
  }
  const live = ctx.relay.workers().find((w) => w.id === id);
  sendJson(res, 200, { worker: id, draining: true, inFlight: live?.inFlight ?? 0 });
};

/** GET /api/workers/:id/pause: the pauses in force (`WorkerPauseJson`). */
export const getWorkerPause: Handler = (ctx, { res, params, head }) => {
  sendJson(res, 200, ctx.pauses.state(params.id as string), {}, head);
};

/** GET /api/pauses: every worker under a pause, the hub's or its own (`WorkerPauseListJson`). */
export const listPauses: Handler = (ctx, { res, head }) => {
  const body: WorkerPauseListJson = { pauses: ctx.pauses.list() };
  sendJson(res, 200, body, {}, head);
};

/** The body of a pause or resume: `{"reason"?: "<text>", "self"?: true}` (empty allowed). */
async function pauseBody(ctx: RouteContext, call: RouteCall): Promise<{ reason?: string; self: boolean }> {
  const body = await readJsonBody(call.req, call.res, ctx.settings.maxBodyBytes);
  if (body !== undefined && (typeof body !== "object" || body === null || Array.isArray(body))) {
    throw badRequest('the body must be empty or a JSON object {"reason"?: "<text>", "self"?: true}');
  }
  const { reason, self } = (body ?? {}) as { reason?: unknown; self?: unknown };
  if (reason !== undefined && (typeof reason !== "string" || Buffer.byteLength(reason) > 1024)) {
    throw badRequest('"reason" must be a string of at most 1024 bytes');
  }
  if (self !== undefined && typeof self !== "boolean") throw badRequest('"self" must be true or false');
  return { ...(reason !== undefined ? { reason } : {}), self: self === true };
}

/**
 * POST /api/workers/:id/pause and /resume: the worker's owner (a worker token of its principal),
 * the operator (admin), or the worker itself (`"self": true`: its battery or heat) pauses it or
 * lifts that pause. Another owner's token: 403 MOESWARM_HUB_NOT_OWNER.
 */
const pauseOrResume =
  (paused: boolean): Handler =>
  async (ctx, call) => {
    const id = call.params.id as string;
    if (!isHubId(id)) throw badRequest("a worker id is 1..128 bytes");
    const claims = ctx.marketHttp.authorize(call.req, "worker");
    const { reason, self } = await pauseBody(ctx, call);
    const by = pauserOf(claims, id, await ctx.workerOwner(id), self);
    // the hub's pause is on disk before it is answered (a restart on the same store keeps it)
    sendJson(call.res, 200, await (paused ? ctx.pauses.pause(id, by, reason) : ctx.pauses.resume(id, by)));
  };

export const pauseWorker = pauseOrResume(true);
export const resumeWorker = pauseOrResume(false);

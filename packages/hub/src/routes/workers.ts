// /api/workers: the workers the hub knows, and draining one (admin).
import { readJsonBody } from "../http-body.js";
import { badRequest, notFound, sendJson } from "../http-errors.js";
import type { Handler } from "./context.js";

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

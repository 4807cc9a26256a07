// Quarantine reports (backbone token) and reinstating a worker (admin).
import { AuthError, type QuarantinesJson } from "@moeswarm/core";
import { clientAddress } from "../client-address.js";
import { readJsonBody } from "../http-body.js";
import { badRequest, notFound, sendJson } from "../http-errors.js";
import { MAX_REPORT_BYTES, parseEvidence } from "../reputation.js";
import { authorize, type Handler } from "./context.js";

/** POST /api/models/:model/reports/quarantine: a backbone reports a worker that answered wrong. */
export const reportQuarantine: Handler = async (ctx, { req, res, params }) => {
  const claims = authorize(ctx.settings, req, "backbone");
  const model = params.model as string;
  if (!ctx.models.find(model)) throw notFound(`no model ${JSON.stringify(model)} on this hub`);
  const evidence = parseEvidence(
    await readJsonBody(req, res, Math.min(MAX_REPORT_BYTES, ctx.settings.maxBodyBytes)),
  );
  const backbone = claims.id ?? "admin";
  // a backbone may accuse only a worker this hub's relay carried its requests to
  if (claims.role !== "admin" && !ctx.forwardedTo(backbone, evidence.worker)) {
    throw new AuthError(
      "MOESWARM_AUTH_ROLE",
      `this hub routed no request of backbone ${JSON.stringify(backbone)} to worker ${JSON.stringify(evidence.worker)}`,
    );
  }
  const record = await ctx.quarantine(backbone, model, evidence);
  sendJson(res, 201, { quarantined: record.worker, at: record.at, by: record.by });
};

/** POST /api/workers/:id/reinstate (admin): lifts a quarantine. */
export const reinstateWorker: Handler = async (ctx, { res, params }) => {
  const id = params.id as string;
  if (!(await ctx.reinstate(id))) throw notFound(`worker ${JSON.stringify(id)} is not quarantined`);
  sendJson(res, 200, { worker: id, quarantined: false });
};

/** GET /api/quarantines: the workers quarantined on this hub (a backbone seeds its own from it). */
export const listQuarantines: Handler = async (ctx, { res }) => {
  const body: QuarantinesJson = {
    quarantined: ctx
      .quarantines()
      .map((q) => ({ worker: q.worker, at: q.at, by: q.by, model: q.model, reason: q.evidence.reason })),
  };
  sendJson(res, 200, body);
};

/** POST /api/enrol {code}: a worker token bound to a fresh id under the code's owner (public). */
export const enrol: Handler = async (ctx, { req, res }) => {
  const body = (await readJsonBody(req, res, 1024)) as { code?: unknown } | null;
  // tries are rate-limited per client address (behind a trusted proxy: the forwarded one)
  const { address } = clientAddress(req, ctx.settings.trustProxy);
  const e = await ctx.enrol(body && typeof body === "object" ? body.code : undefined, address);
  sendJson(res, 201, e);
};

/** POST /api/enrol-codes {owner, uses?, ttlMs?} (admin): issues a code; the answer is its only copy. */
export const issueEnrolCode: Handler = async (ctx, { req, res }) => {
  const body = (await readJsonBody(req, res, 1024)) as Record<string, unknown> | null;
  if (!body || typeof body !== "object") throw badRequest('the body must be {"owner", "uses"?, "ttlMs"?}');
  const { owner, uses, ttlMs } = body;
  sendJson(
    res,
    201,
    await ctx.issueEnrolCode({
      owner: owner as string,
      ...(uses !== undefined ? { uses: uses as number } : {}),
      ...(ttlMs !== undefined ? { ttlMs: ttlMs as number } : {}),
    }),
  );
};

// Quarantine reports (backbone token) and reinstating a worker (admin).
import { AuthError } from "@moeswarm/core";
import { readJsonBody } from "../http-body.js";
import { notFound, sendJson } from "../http-errors.js";
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

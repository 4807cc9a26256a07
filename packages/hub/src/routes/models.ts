// /api/models: list, register (POST, admin), describe, remove (DELETE, admin) and the manifest.
import { readJsonBody } from "../http-body.js";
import { badRequest, sendJson } from "../http-errors.js";
import { noneMatchHits } from "../http-range.js";
import { resolveInside } from "../hub-models.js";
import { defaultModelId } from "../model.js";
import { isModelId } from "../store.js";
import { type Handler, headerOf } from "./context.js";

export const listModels: Handler = (ctx, { res, head }) => {
  sendJson(res, 200, { models: ctx.models.list() }, {}, head);
};

export const getModel: Handler = (ctx, { res, head, params }) => {
  sendJson(res, 200, structuredClone(ctx.models.get(params.model as string).info), {}, head);
};

/** POST /api/models {"path", "id"?}: serves a file of the model directory. */
export const registerModel: Handler = async (ctx, { req, res }) => {
  const dir = ctx.settings.modelDir;
  if (dir === undefined) {
    throw badRequest("this hub registers no models at run time (it was started without a model directory)");
  }
  const body = await readJsonBody(req, res, ctx.settings.maxBodyBytes);
  if (typeof body !== "object" || body === null || Array.isArray(body)) {
    throw badRequest(
      'the body must be a JSON object {"path": "<file in the model directory>", "id"?: "<name>"}',
    );
  }
  const { path, id: wanted } = body as Record<string, unknown>;
  if (typeof path !== "string" || path.length === 0 || path.length > 4096 || path.includes("\0")) {
    throw badRequest('"path" must name a file in the model directory');
  }
  if (wanted !== undefined && !isModelId(wanted)) {
    throw badRequest('"id" must be 1..128 characters [A-Za-z0-9._-] starting with a letter or digit');
  }
  const file = await resolveInside(dir, path);
  const id = (wanted as string | undefined) ?? defaultModelId(file);
  const { model, created } = await ctx.models.register(id, file, path);
  if (!created) {
    sendJson(res, 200, structuredClone(model.info));
    return;
  }
  sendJson(res, 201, structuredClone(model.info), {
    location: model.info.links.manifest.replace(/\/manifest$/, ""),
  });
};

export const removeModel: Handler = async (ctx, { res, params }) => {
  const id = params.model as string;
  await ctx.models.remove(id);
  sendJson(res, 200, { removed: id });
};

export const getManifest: Handler = (ctx, { req, res, head, params }) => {
  const model = ctx.models.get(params.model as string);
  const headers = { etag: model.manifestEtag, "cache-control": "no-cache" };
  if (noneMatchHits(headerOf(req, "if-none-match"), model.manifestEtag)) {
    res.writeHead(304, headers);
    res.end();
    return;
  }
  res.writeHead(200, {
    ...headers,
    "content-type": "application/json; charset=utf-8",
    "content-length": model.manifestJson.byteLength,
  });
  res.end(head ? undefined : model.manifestJson);
  ctx.metrics.bytes("/api/models/:model/manifest", head ? 0 : model.manifestJson.byteLength);
};

// GET/HEAD /api/models/:model/expert-shard: a slice of experts as a GGUF file, with ETags,
// conditional requests and byte ranges, streamed from the model file.
import { pipeline } from "node:stream/promises";
import { formatRange, GgufError, HubError, isMoeswarmError, parseRange } from "@moeswarm/core";
import { badRequest, notFound } from "../http-errors.js";
import { ifRangeHolds, interpretRange, noneMatchHits } from "../http-range.js";
import { type ServedModel, sliceEtag } from "../model.js";
import { type Handler, headerOf, type RouteCall, type RouteContext } from "./context.js";

export const getExpertShard: Handler = async (ctx, call) => {
  const model = ctx.models.get(call.params.model as string);
  if (!model.acquire()) throw notFound(`model ${JSON.stringify(model.id)} was removed`);
  try {
    await expertShard(ctx, call, model);
  } finally {
    model.release();
  }
};

/** The slice the query names (`layers=a:b&experts=c:d`), checked against the model. */
function sliceQuery(model: ServedModel, query: string) {
  const params = new URLSearchParams(query);
  const one = (name: string): string => {
    const all = params.getAll(name);
    if (all.length === 0) throw badRequest(`the query needs ${name}=a:b (a half-open range)`);
    if (all.length > 1) throw badRequest(`${name} is given ${all.length} times`);
    return all[0] as string;
  };
  const layers = parseRange(one("layers"), { max: model.layerCount });
  const experts = parseRange(one("experts"), { max: model.expertCount });
  for (let l = layers.start; l < layers.end; l++) {
    // said here rather than by the slicer, whose message names the file on the hub's disk
    if (!model.manifest.layers.some((x) => x.layer === l)) {
      throw new GgufError("MOESWARM_GGUF_NOT_MOE", `layer ${l} of ${model.id} has no routed experts`, {
        details: { layer: l, moeLayers: model.info.moeLayers },
      });
    }
  }
  return { layers, experts };
}

async function expertShard(ctx: RouteContext, call: RouteCall, model: ServedModel): Promise<void> {
  const { req, res, head } = call;
  const { layers, experts } = sliceQuery(model, call.query);
  const normalised = `layers=${formatRange(layers)}&experts=${formatRange(experts)}`;
  const slice = await model.slice(layers, experts);
  let etag = ctx.etags.get(slice);
  if (etag === undefined) {
    etag = sliceEtag(model.manifest.source.headerSha256, normalised, slice);
    ctx.etags.set(slice, etag);
  }
  const headers: Record<string, string | number> = {
    etag,
    "accept-ranges": "bytes",
    "cache-control": "no-cache",
    "x-moeswarm-source-sha256": model.manifest.source.headerSha256,
  };
  if (noneMatchHits(headerOf(req, "if-none-match"), etag)) {
    res.writeHead(304, headers);
    res.end();
    return;
  }
  const range = headerOf(req, "range");
  const answer =
    range !== undefined && ifRangeHolds(headerOf(req, "if-range"), etag)
      ? interpretRange(range, slice.length)
      : ({ kind: "full" } as const);
  const [start, end] = answer.kind === "full" ? [0, slice.length] : [answer.start, answer.end];
  const file = `${model.id}.layers-${layers.start}-${layers.end}.experts-${experts.start}-${experts.end}.gguf`;
  Object.assign(headers, {
    "content-type": "application/octet-stream",
    "content-length": end - start,
    "content-disposition": `attachment; filename="${file}"`,
  });
  if (answer.kind === "partial") headers["content-range"] = `bytes ${start}-${end - 1}/${slice.length}`;
  const status = answer.kind === "partial" ? 206 : 200;
  if (head) {
    res.writeHead(status, headers);
    res.end();
    return;
  }

  const abort = new AbortController();
  // the client went away (or the hub closes): stop reading the file at once
  const onClose = () => abort.abort(new HubError("MOESWARM_HUB_INTERNAL", "the download was cut"));
  res.once("close", onClose);
  ctx.downloads.add(abort);
  res.setTimeout(ctx.settings.idleTimeoutMs, () => res.destroy());
  const metrics = ctx.metrics;
  async function* counted(chunks: AsyncIterable<Uint8Array>): AsyncGenerator<Uint8Array> {
    for await (const chunk of chunks) {
      yield chunk;
      metrics.bytes("/api/models/:model/expert-shard", chunk.byteLength);
    }
  }
  try {
    res.writeHead(status, headers);
    await pipeline(counted(slice.range(start, end, { signal: abort.signal })), res);
  } catch (error) {
    res.destroy();
    // a client that left is not a failure of the hub; a read that failed is
    if (clientLeft(error, abort.signal)) return;
    throw error;
  } finally {
    res.off("close", onClose);
    ctx.downloads.delete(abort);
  }
}

const CLIENT_GONE = new Set([
  "ERR_STREAM_PREMATURE_CLOSE",
  "ERR_STREAM_DESTROYED",
  "ERR_STREAM_WRITE_AFTER_END",
  "EPIPE",
  "ECONNRESET",
  "ABORT_ERR",
]);

function clientLeft(error: unknown, signal: AbortSignal): boolean {
  if (signal.aborted && error === signal.reason) return true;
  if (isMoeswarmError(error)) return error.code === "MOESWARM_ABORTED";
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" && CLIENT_GONE.has(code);
}

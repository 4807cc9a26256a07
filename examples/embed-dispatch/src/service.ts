// A third-party service that owns an MoE layer's router and hands the expert FFNs to workers
// with `dispatchExperts`. Here the "model" is a tiny deterministic one and the workers are
// in-process functions; a real service would load a GGUF and use the relay transport.
import { createServer, type IncomingMessage, type Server } from "node:http";
import {
  createReferenceWorker,
  DispatchMetrics,
  dispatchExpertsDetailed,
  type ExpertMatrices,
  type ExpertWeights,
  InProcessTransport,
  Placement,
  type RoutingConfig,
  route,
} from "@moeswarm/dispatch";

export const N_EMBD = 16;
export const N_FF = 8;
export const N_EXPERT = 8;
export const LAYER = 0;
const MAX_BODY = 1 << 20;

/** Qwen3-MoE style routing: softmax, top-2, normalised. */
export const ROUTING: RoutingConfig = {
  nExpert: N_EXPERT,
  nExpertUsed: 2,
  gating: "softmax",
  normalize: true,
};

/** Deterministic expert weights (a real service dequantises them from its GGUF slice). */
export function tinyExperts(): ExpertWeights {
  let s = 42;
  const next = () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return Math.fround((s / 2 ** 32 - 0.5) * 0.5);
  };
  const experts: ExpertMatrices[] = Array.from({ length: N_EXPERT }, () => ({
    gate: Float64Array.from({ length: N_FF * N_EMBD }, next),
    up: Float64Array.from({ length: N_FF * N_EMBD }, next),
    down: Float64Array.from({ length: N_EMBD * N_FF }, next),
  }));
  return { nEmbd: N_EMBD, expert: (_layer, e) => experts[e]! };
}

class BadRequest extends Error {}

async function readJson(req: IncomingMessage): Promise<unknown> {
  let size = 0;
  const chunks: Buffer[] = [];
  for await (const chunk of req) {
    size += (chunk as Buffer).length;
    if (size > MAX_BODY) throw new BadRequest("body too large");
    chunks.push(chunk as Buffer);
  }
  try {
    return JSON.parse(Buffer.concat(chunks).toString("utf8"));
  } catch {
    throw new BadRequest("body is not JSON");
  }
}

function rows(value: unknown, width: number, name: string): Float32Array {
  if (!Array.isArray(value) || value.length === 0 || value.length > 1024) {
    throw new BadRequest(`${name} must be a non-empty array of rows`);
  }
  const out = new Float32Array(value.length * width);
  value.forEach((row: unknown, i) => {
    if (
      !Array.isArray(row) ||
      row.length !== width ||
      !row.every((v) => typeof v === "number" && Number.isFinite(v))
    ) {
      throw new BadRequest(`${name}[${i}] must be ${width} finite numbers`);
    }
    out.set(row as number[], i * width);
  });
  return out;
}

/**
 * `POST /moe` with `{ "hidden": number[][], "logits": number[][] }` (one row per token) answers
 * `{ "output": number[][], "ids": number[][], "weights": number[][], "metrics": {...} }`.
 */
export function createMoeService(options: { workers?: number; deadlineMs?: number } = {}): {
  server: Server;
  metrics: DispatchMetrics;
} {
  const nWorkers = options.workers ?? 4;
  const experts = tinyExperts();
  const registrations = Array.from({ length: nWorkers }, (_, w) => ({
    id: `worker-${w}`,
    model: "tiny-moe",
    layers: [LAYER],
    experts: Array.from({ length: N_EXPERT }, (_, e) => e).filter((e) => e % nWorkers === w),
  }));
  const placement = Placement.fromRegistrations(registrations);
  // every expert must have an owner before the first request, not mid-way
  placement.validate({ layers: [LAYER], nExpert: N_EXPERT });
  const transport = new InProcessTransport(
    registrations.map((r) => [r.id, createReferenceWorker(experts)] as const),
  );
  const fallback = createReferenceWorker(experts);
  const metrics = new DispatchMetrics();

  const server = createServer(async (req, res) => {
    const send = (status: number, body: unknown) => {
      res.writeHead(status, { "content-type": "application/json" });
      res.end(JSON.stringify(body));
    };
    if (req.method !== "POST" || req.url !== "/moe") return send(404, { error: "POST /moe" });
    const abort = new AbortController();
    res.on("close", () => abort.abort(new Error("client went away")));
    try {
      const body = (await readJson(req)) as { hidden?: unknown; logits?: unknown };
      const hidden = rows(body.hidden, N_EMBD, "hidden");
      const logits = rows(body.logits, N_EXPERT, "logits");
      if (hidden.length / N_EMBD !== logits.length / N_EXPERT)
        throw new BadRequest("hidden and logits differ in rows");
      const routing = route(logits, ROUTING);
      const { output, metrics: call } = await dispatchExpertsDetailed(hidden, routing, {
        layer: LAYER,
        placement,
        transport,
        fallback,
        signal: abort.signal,
        deadlineMs: options.deadlineMs ?? 5000,
        metrics,
      });
      const perToken = <T extends ArrayLike<number>>(a: T, w: number) =>
        Array.from({ length: a.length / w }, (_, i) => Array.from(a).slice(i * w, (i + 1) * w));
      send(200, {
        output: perToken(output, N_EMBD),
        ids: perToken(routing.ids, routing.k),
        weights: perToken(routing.weights, routing.k),
        metrics: call,
      });
    } catch (error) {
      if (error instanceof BadRequest) return send(400, { error: error.message });
      const code = (error as { code?: string }).code ?? "internal";
      send(502, { error: (error as Error).message, code });
    }
  });
  return { server, metrics };
}

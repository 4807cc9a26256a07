// What the throughput benchmarks share: the model they run on (MOESWARM_BENCH_TP_MODEL), the hub
// with its two llama-cpu workers behind the relay, and the delay proxy that adds RTT.
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { isQuantizedActivationDtype, WIRE_ACTIVATION_DTYPES } from "@moeswarm/core";
import { createHub, mintToken } from "@moeswarm/hub";
import { connectRelay } from "@moeswarm/relay-client";
import {
  ensureSyntheticModel,
  findExpertTensors,
  ggmlTypeName,
  readGguf,
  sliceExperts,
} from "@moeswarm/shard";
import { ggmlQuantize, spawnLlamaExpertWorker, type WorkerProcessCompute } from "@moeswarm/worker-native";

export const ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const CACHE_DIR = join(ROOT, ".cache", "models");
export const SECRET = "bench-throughput-secret-0123456789ab";

export type DelayProxy = (o: {
  target: string;
  rttMs: number;
}) => Promise<{ url: string; close(): Promise<void> }>;

export async function loadDelayProxy(): Promise<DelayProxy> {
  const mod = (await import(join(ROOT, "tools/delay-proxy.mjs"))) as { startDelayProxy: DelayProxy };
  return mod.startDelayProxy;
}

/**
 * The model: MOESWARM_BENCH_TP_MODEL=shape is the shape-true qwen35moe (Qwen3.5-122B-A10B's layers,
 * 4 of them, Q4_K_M, 6.1 GB, synthesised once in ~100 s: a real layer's compute per step), "small"
 * or "medium" a synthetic qwen3moe; the default is "small" with MOESWARM_BENCH_SHORT=1, else
 * "medium". The shape preset has no draft model.
 */
export interface TpModel {
  preset: "small" | "medium" | "shape";
  path: string;
  draftPath: string | undefined;
}

export function tpPreset(): TpModel["preset"] {
  const asked =
    process.env.MOESWARM_BENCH_TP_MODEL ?? (process.env.MOESWARM_BENCH_SHORT === "1" ? "small" : "medium");
  if (asked !== "small" && asked !== "medium" && asked !== "shape") {
    throw new Error(`MOESWARM_BENCH_TP_MODEL: expected small, medium or shape, got ${asked}`);
  }
  return asked;
}

export async function tpModel(preset: TpModel["preset"], withDraft: boolean): Promise<TpModel> {
  if (preset === "shape") {
    const model = await ensureSyntheticModel("shape", {
      cacheDir: CACHE_DIR,
      arch: "qwen35moe",
      quantize: (type, values, ne0) => ggmlQuantize(ggmlTypeName(type), values, ne0),
    });
    return { preset, path: model.path, draftPath: undefined };
  }
  const model = await ensureSyntheticModel(preset, { cacheDir: CACHE_DIR });
  const draft = withDraft
    ? await ensureSyntheticModel(`${preset}-draft`, { cacheDir: CACHE_DIR })
    : undefined;
  return { preset, path: model.path, draftPath: draft?.path };
}

/** A worker process behind the hub's relay, answering the dispatches it is sent. */
function relayWorker(relayUrl: string, id: string, compute: WorkerProcessCompute) {
  return connectRelay(relayUrl, {
    role: "worker",
    id,
    token: mintToken({ role: "worker", id, ttlS: 3600 }, SECRET),
    reconnect: false,
    // a llama-cpu process takes every wire dtype (q8 rows go to ggml as they are), and says so
    caps: { dtypes: [...WIRE_ACTIVATION_DTYPES] },
    onDispatch: async (d) => ({
      y: await compute.run(
        {
          layer: d.layer,
          // q8_0/q8_K rows as they came (the worker's core takes them), else f32
          ...(isQuantizedActivationDtype(d.dtype)
            ? { x: d.x as Uint8Array, xType: d.dtype }
            : { x: d.activations() }),
          ids: d.ids,
          k: d.k,
          ...(d.w ? { w: d.w } : {}),
          mode: d.mode,
        },
        { signal: d.signal },
      ),
    }),
  });
}

/**
 * A hub serving `modelId` and 2 llama-cpu workers (half the experts each, one thread) registered
 * on its relay. What it starts goes into `workers` and `closers`, for the caller to end.
 */
export async function startSwarm(
  model: string,
  modelId: string,
  dir: string,
  workers: WorkerProcessCompute[],
  closers: Array<() => Promise<unknown>>,
): Promise<{ layers: number[]; hubPort: string }> {
  const layout = findExpertTensors(await readGguf(model));
  const layers = layout.layers.map((l) => l.layer);
  const nExpert = layout.layers[0]!.nExpert;
  const hub = createHub({
    secret: SECRET,
    models: [{ id: modelId, path: model }],
    requireLeases: false,
    replicas: 1,
    trustReports: true,
  });
  closers.push(() => hub.close());
  const listener = await hub.listen(0);
  for (let w = 0; w < 2; w++) {
    const experts = [...Array(nExpert / 2).keys()].map((i) => i + (w * nExpert) / 2);
    const path = join(dir, `w${w}.gguf`);
    {
      await using slice = await sliceExperts(model, { layers, experts });
      await slice.write(path);
    }
    // a shape-true slice (3 GB) loads in minutes on a loaded machine
    const worker = await spawnLlamaExpertWorker(path, { threads: 1, startTimeoutMs: 1_800_000 });
    workers.push(worker);
    const c = await relayWorker(listener.relayUrl, `w${w}`, worker);
    closers.push(() => c.close());
    c.register({ model: modelId, layers, experts });
  }
  return { layers, hubPort: new URL(listener.url).port };
}

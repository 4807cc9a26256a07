// Shared by the direct-endpoint tests of runWorker (direct, direct-hub): a worker with its endpoint
// on loopback, a backbone that dials it with the hub's tickets, and a request for the tiny model.
import { mintToken } from "@moeswarm/hub";
import {
  connectRelay,
  DirectTransport,
  type DirectTransportOptions,
  RelayTransport,
} from "@moeswarm/relay-client";
import type { WorkerEvent } from "../src/events.js";
import { runWorker } from "../src/run-worker.js";

/** A worker started by {@link startDirectWorker}: its run, the events it logged, its drain. */
export interface DirectWorker {
  readonly run: ReturnType<typeof runWorker>;
  readonly events: WorkerEvent[];
  /** Aborted: the worker drains. */
  readonly stop: AbortController;
}

/**
 * runWorker as `id` on the TypeScript backend (10 MB of RAM offered, placements polled every 50 ms)
 * with a direct endpoint on 127.0.0.1, logging into `events`; `relay` when it is not the hub's own.
 */
export function startDirectWorker(options: {
  hub: string;
  relay?: string;
  id: string;
  secret: string;
  cacheDir: string;
}): DirectWorker {
  const stop = new AbortController();
  const events: WorkerEvent[] = [];
  const run = runWorker({
    hub: options.hub,
    ...(options.relay !== undefined ? { relay: options.relay } : {}),
    token: mintToken({ role: "worker", id: options.id, ttlS: 600 }, options.secret),
    capacity: { ramBytes: 10_000_000 },
    cacheDir: options.cacheDir,
    backend: "ts",
    pollMs: 50,
    signal: stop.signal,
    direct: { listen: "127.0.0.1:0" },
    log: (e) => events.push(e),
  });
  return { run, events, stop };
}

/** Drains a worker and waits for it, whatever its run ended with. */
export async function drain(worker: DirectWorker): Promise<void> {
  worker.stop.abort("test done");
  await worker.run.catch(() => {});
}

/**
 * A backbone's DirectTransport (`t`) over a fresh relay connection to a hub, its tickets asked of
 * that hub (POST /api/direct/tickets with the backbone's `token`). close(): the transport, then
 * the relay connection.
 */
export async function directBackbone(
  hub: { url: string; relayUrl: string },
  options: {
    id: string;
    secret: string;
    /** The relay connection's reconnect (connectRelay's default when not given). */
    reconnect?: false;
    /** DirectTransport's options beyond its fallback, id and tickets. */
    direct?: Omit<DirectTransportOptions, "fallback" | "id" | "ticket">;
  },
) {
  const { id } = options;
  const token = mintToken({ role: "backbone", id, ttlS: 600 }, options.secret);
  const relay = await connectRelay(hub.relayUrl, {
    role: "backbone",
    id,
    token,
    ...(options.reconnect === false ? { reconnect: false } : {}),
  });
  const t = new DirectTransport({
    fallback: new RelayTransport(relay),
    id,
    ticket: async (worker) => {
      const r = await fetch(`${hub.url}/api/direct/tickets`, {
        method: "POST",
        headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
        body: JSON.stringify({ worker }),
      });
      return ((await r.json()) as { ticket: string }).ticket;
    },
    ...options.direct,
  });
  return {
    t,
    relay,
    token,
    async close() {
      await t.close();
      await relay.close();
    },
  };
}

/** 3 tokens of 64 values (the tiny model's n_embd) for its layer 1, top-2 ("each"): x[i] = xOf(i). */
export function tinyRequest(model: string, xOf: (i: number) => number) {
  const n = 3;
  const embd = 64;
  return {
    model,
    layer: 1,
    n,
    embd,
    k: 2,
    dtype: "f32" as const,
    x: Float32Array.from({ length: n * embd }, (_, i) => xOf(i)),
    ids: Int32Array.from([0, 5, 1, 7, 3, 2]),
    mode: "each" as const,
  };
}

// A worker's direct endpoint and the hub's life: (1) a hub restarted on the same store forgot
// the endpoints: the worker tells it again when its relay connection comes back, the placement
// carries them again, and a backbone links with a ticket from the new hub (a new ticket key the
// worker fetches); (2) a hub from before direct links (404 on the route): the worker closes its
// endpoint, says so in an event, and serves through the relay alone.
import { createServer, request as httpRequest, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import type { PlacementRegistrationJson } from "@moeswarm/core";
import { createHub, type Hub, mintToken } from "@moeswarm/hub";
import { connectRelay, DirectTransport, RelayTransport } from "@moeswarm/relay-client";
import { ensureSyntheticModel } from "@moeswarm/shard";
import { type TempDir, tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { WorkerEvent } from "../src/events.js";
import { runWorker } from "../src/run-worker.js";
import { MODEL_CACHE, waitPlacement } from "./fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-direct-hub-secret-0123456789";
const N = 3;
const EMBD = 64;

let modelPath: string;
let work: TempDir;

const newHub = (store: string) =>
  createHub({
    secret: SECRET,
    models: [{ id: MODEL, path: modelPath }],
    manifestDir: work.dir,
    dashboard: false,
    replicas: 1,
    store,
  });

const req = () => ({
  model: MODEL,
  layer: 1,
  n: N,
  embd: EMBD,
  k: 2,
  dtype: "f32" as const,
  x: Float32Array.from({ length: N * EMBD }, (_, i) => Math.sin(i * 0.07)),
  ids: Int32Array.from([0, 5, 1, 7, 3, 2]),
  mode: "each" as const,
});

beforeAll(async () => {
  modelPath = (await ensureSyntheticModel("tiny", { cacheDir: MODEL_CACHE })).path;
  work = tempDir("moeswarm-direct-hub-");
});
afterAll(() => work?.remove());

/** A backbone's DirectTransport over a fresh relay connection to `url`'s hub, tickets from it. */
async function backbone(url: string, relayUrl: string, id: string) {
  const token = mintToken({ role: "backbone", id, ttlS: 600 }, SECRET);
  const relay = await connectRelay(relayUrl, { role: "backbone", id, token, reconnect: false });
  const t = new DirectTransport({
    fallback: new RelayTransport(relay),
    id,
    ticket: async (worker) => {
      const r = await fetch(`${url}/api/direct/tickets`, {
        method: "POST",
        headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
        body: JSON.stringify({ worker }),
      });
      return ((await r.json()) as { ticket: string }).ticket;
    },
  });
  return {
    t,
    async close() {
      await t.close();
      await relay.close();
    },
  };
}

const directOf = async (url: string) => {
  const p = await waitPlacement(url, MODEL, "wd's slice with its endpoint", (pl) =>
    pl.registrations.some((r) => r.id === "wd" && (r as PlacementRegistrationJson).direct !== undefined),
  );
  return (p.registrations.find((r) => r.id === "wd") as PlacementRegistrationJson).direct!;
};

describe("a worker's direct endpoint across the hub's life", () => {
  it("is published again to a hub restarted on the same store, and a backbone links with the new hub's ticket", async () => {
    const store = join(work.dir, "hub.db");
    let hub: Hub = newHub(store);
    const { url, relayUrl } = await hub.listen(0);
    const port = Number(new URL(url).port);
    const stop = new AbortController();
    const events: WorkerEvent[] = [];
    const run = runWorker({
      hub: url,
      token: mintToken({ role: "worker", id: "wd", ttlS: 600 }, SECRET),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: join(work.dir, "cache-restart"),
      backend: "ts",
      pollMs: 50,
      signal: stop.signal,
      direct: { listen: "127.0.0.1:0" },
      log: (e) => events.push(e),
    });
    try {
      const before = await directOf(url);
      await hub.close();
      // the same store, the same port: a new process's memory (no endpoints, a new ticket key)
      hub = newHub(store);
      await hub.listen(port);
      const after = await directOf(url);
      expect(after).toEqual(before);
      expect(events.filter((e) => e.event === "direct")).toHaveLength(1);
      expect(events.some((e) => e.event === "relay" && e.state === "connected")).toBe(true);

      const bb = await backbone(url, relayUrl, "bb");
      try {
        bb.t.update(new Map([["wd", after]]));
        expect(await bb.t.linked("wd")).toBe(true);
        const r = await bb.t.request("wd", req(), {
          signal: new AbortController().signal,
          deadlineMs: 10_000,
        });
        expect(r.y.length).toBe(N * 2 * EMBD);
        expect(bb.t.counters()).toMatchObject({ direct: 1, relay: 0, dialFailures: 0 });
      } finally {
        await bb.close();
      }
    } finally {
      stop.abort("test done");
      await run.catch(() => {});
      await hub.close();
    }
  });

  it("against a hub without the route (404): closes its endpoint, emits direct-unsupported, serves over the relay", async () => {
    const hub = newHub(join(work.dir, "old.db"));
    const { url, relayUrl } = await hub.listen(0);
    // an older hub: everything but PUT /api/workers/:id/direct is the real hub's
    let refused = 0;
    const old: Server = createServer((req, res) => {
      if (/^\/api\/workers\/[^/?]+\/direct(\?|$)/.test(req.url ?? "")) {
        refused++;
        req.resume();
        res.writeHead(404, { "content-type": "text/plain" }).end("Not Found");
        return;
      }
      const up = httpRequest(`${url}${req.url}`, { method: req.method, headers: req.headers }, (r) => {
        res.writeHead(r.statusCode ?? 502, r.headers);
        r.pipe(res);
      });
      up.on("error", () => res.destroy());
      req.pipe(up);
    });
    await new Promise<void>((resolve) => old.listen(0, "127.0.0.1", resolve));
    const oldUrl = `http://127.0.0.1:${(old.address() as AddressInfo).port}`;
    const stop = new AbortController();
    const events: WorkerEvent[] = [];
    const run = runWorker({
      hub: oldUrl,
      relay: relayUrl,
      token: mintToken({ role: "worker", id: "wo", ttlS: 600 }, SECRET),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: join(work.dir, "cache-old"),
      backend: "ts",
      pollMs: 50,
      signal: stop.signal,
      direct: { listen: "127.0.0.1:0" },
      log: (e) => events.push(e),
    });
    try {
      const p = await waitPlacement(url, MODEL, "wo's slice", (pl) =>
        pl.registrations.some((r) => r.id === "wo"),
      );
      expect(refused).toBe(1);
      expect(events.find((e) => e.event === "direct-unsupported")).toMatchObject({
        event: "direct-unsupported",
        hub: `${oldUrl}/`,
      });
      expect(events.some((e) => e.event === "direct")).toBe(false);
      expect(
        (p.registrations.find((r) => r.id === "wo") as PlacementRegistrationJson).direct,
      ).toBeUndefined();
      // it serves over the relay
      const token = mintToken({ role: "backbone", id: "bb-old", ttlS: 600 }, SECRET);
      await using relay = await connectRelay(relayUrl, {
        role: "backbone",
        id: "bb-old",
        token,
        reconnect: false,
      });
      const r = await new RelayTransport(relay).request("wo", req(), {
        signal: new AbortController().signal,
        deadlineMs: 10_000,
      });
      expect(r.y.length).toBe(N * 2 * EMBD);
      stop.abort("test done");
      expect(await run).toMatchObject({ served: true, requests: 1 });
      expect(refused).toBe(1); // asked once, never again (not at the relay's reconnects either)
    } finally {
      stop.abort("test done");
      await run.catch(() => {});
      await new Promise<void>((resolve) => old.close(() => resolve()));
      old.closeAllConnections();
      await hub.close();
    }
  });
});

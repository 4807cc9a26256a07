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
import { connectRelay, RelayTransport } from "@moeswarm/relay-client";
import { ensureSyntheticModel } from "@moeswarm/shard";
import { type TempDir, tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { directBackbone, drain, startDirectWorker, tinyRequest } from "./direct-fixtures.js";
import { MODEL_CACHE, waitPlacement } from "./fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-direct-hub-secret-0123456789";

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

const req = () => tinyRequest(MODEL, (i) => Math.sin(i * 0.07));
/** What a worker answers it: 3 tokens x top-2 slots x n_embd 64. */
const Y_LENGTH = 3 * 2 * 64;

beforeAll(async () => {
  modelPath = (await ensureSyntheticModel("tiny", { cacheDir: MODEL_CACHE })).path;
  work = tempDir("moeswarm-direct-hub-");
});
afterAll(() => work?.remove());

/** A worker with a direct endpoint, its cache in `cache` under the work folder. */
const startWorker = (options: { hub: string; relay?: string; id: string }, cache: string) =>
  startDirectWorker({ ...options, secret: SECRET, cacheDir: join(work.dir, cache) });

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
    const worker = startWorker({ hub: url, id: "wd" }, "cache-restart");
    const { events } = worker;
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

      const bb = await directBackbone({ url, relayUrl }, { id: "bb", secret: SECRET, reconnect: false });
      try {
        bb.t.update(new Map([["wd", after]]));
        expect(await bb.t.linked("wd")).toBe(true);
        const r = await bb.t.request("wd", req(), {
          signal: new AbortController().signal,
          deadlineMs: 10_000,
        });
        expect(r.y.length).toBe(Y_LENGTH);
        expect(bb.t.counters()).toMatchObject({ direct: 1, relay: 0, dialFailures: 0 });
      } finally {
        await bb.close();
      }
    } finally {
      await drain(worker);
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
    const worker = startWorker({ hub: oldUrl, relay: relayUrl, id: "wo" }, "cache-old");
    const { events } = worker;
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
      expect(r.y.length).toBe(Y_LENGTH);
      worker.stop.abort("test done");
      expect(await worker.run).toMatchObject({ served: true, requests: 1 });
      expect(refused).toBe(1); // asked once, never again (not at the relay's reconnects either)
    } finally {
      await drain(worker);
      await new Promise<void>((resolve) => old.close(() => resolve()));
      old.closeAllConnections();
      await hub.close();
    }
  });
});

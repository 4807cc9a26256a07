import { existsSync } from "node:fs";
import { join } from "node:path";
import { connectRelay, type IncomingDispatch, type RelayConnection } from "@moeswarm/relay-client";
import { bufferSource, parseManifest, verifySlice } from "@moeswarm/shard";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  createHub,
  createLoopbackCertificates,
  type HubWorkerInfo,
  type LoopbackCertificates,
  mintToken,
} from "../src/index.js";
import { fakeExperts, sameBytes } from "./helpers.js";
import {
  call,
  copyModel,
  json,
  parsePrometheus,
  referenceSlice,
  sampleValue,
  syntheticModel,
  type TempDir,
  tempDir,
  waitFor,
} from "./hub-helpers.js";

const SECRET = "hub-test-secret-0123456789abcdef";

let certs: LoopbackCertificates;
let tmp: TempDir;
let modelDir: string;
let dbPath: string;
const open: RelayConnection[] = [];

beforeAll(async () => {
  certs = await createLoopbackCertificates({ hosts: ["localhost", "127.0.0.1"], days: 2 });
  tmp = tempDir();
  modelDir = join(tmp.dir, "models");
  const { mkdirSync } = await import("node:fs");
  mkdirSync(modelDir);
  copyModel(await syntheticModel("tiny"), modelDir, "tiny.gguf");
  dbPath = join(tmp.dir, "state", "hub.db");
});

afterAll(async () => {
  await Promise.all(open.map((c) => c.close()));
  tmp?.remove();
});

function worker(relayUrl: string, id: string): Promise<RelayConnection> {
  return connectRelay(relayUrl, {
    role: "worker",
    id,
    token: mintToken({ role: "worker", id, ttlS: 600 }, SECRET),
    ca: certs.ca,
    reconnect: false,
    onDispatch: async (req: IncomingDispatch) => ({
      y: fakeExperts(1, {
        layer: req.layer,
        n: req.n,
        embd: req.embd,
        k: req.k,
        x: req.activations(),
        ids: req.ids,
        w: req.w,
        mode: req.mode,
      }),
    }),
  }).then((c) => {
    open.push(c);
    return c;
  });
}

describe("one port for https and wss, state that survives a restart", () => {
  it("serves the API and the relay on one TLS port, and remembers models and workers", async () => {
    const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
    const first = createHub({
      secret: SECRET,
      modelDir,
      store: dbPath,
      tls: { cert: certs.cert, key: certs.key },
      relay: { heartbeatMs: 100, deadPeerMs: 2000 },
      // fake workers register without claiming (trust.test.ts tests leases)
      requireLeases: false,
    });
    const l1 = await first.listen(0, "127.0.0.1");
    expect(l1.url).toMatch(/^https:\/\/127\.0\.0\.1:\d+$/);
    expect(l1.relayUrl).toBe(`wss://127.0.0.1:${l1.port}/relay`);
    expect(existsSync(dbPath)).toBe(true);
    expect(json(await call(`${l1.url}/api/models`, { ca: certs.ca }))).toEqual({ models: [] });

    // register a model file at run time (admin), then download a slice over https
    const created = await call(`${l1.url}/api/models`, {
      method: "POST",
      ca: certs.ca,
      headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
      body: JSON.stringify({ path: "tiny.gguf", id: "tiny" }),
    });
    expect(created.status).toBe(201);
    const manifest = parseManifest(json(await call(`${l1.url}/api/models/tiny/manifest`, { ca: certs.ca })));
    const slice = await call(`${l1.url}/api/models/tiny/expert-shard?layers=0:1&experts=0:4`, {
      ca: certs.ca,
    });
    expect(slice.status).toBe(200);
    const reference = await referenceSlice(join(modelDir, "tiny.gguf"), {
      layers: [0],
      experts: { start: 0, end: 4 },
    });
    expect(slice.body.equals(reference)).toBe(true);
    await verifySlice(bufferSource(slice.body), manifest);

    // a worker and a backbone on the same port, through wss with the test CA
    const w1 = await worker(l1.relayUrl, "w1");
    w1.register({ model: "tiny", layers: [0], experts: [0, 1, 2, 3], capacity: 123_456_789, backend: "cpu" });
    const bb = await connectRelay(l1.relayUrl, {
      role: "backbone",
      id: "bb",
      token: mintToken({ role: "backbone", id: "bb", ttlS: 600 }, SECRET),
      ca: certs.ca,
      reconnect: false,
    });
    open.push(bb);
    await waitFor(() => first.workers().some((w) => w.slices.length === 1 && w.live), "w1 registered");
    const x = new Float32Array([0.5, -2, 1, 3]);
    const ids = new Int32Array([1, 3]);
    const reply = await bb.request("w1", {
      model: "tiny",
      layer: 0,
      n: 1,
      embd: 4,
      k: 2,
      x,
      ids,
      mode: "each",
    });
    const expected = fakeExperts(1, { layer: 0, n: 1, embd: 4, k: 2, x, ids, w: undefined, mode: "each" });
    expect(sameBytes(reply.y, expected)).toBe(true);

    // /metrics saw it: connections by role, frames, the routed dispatch's latency
    const m = parsePrometheus((await call(`${l1.url}/metrics`, { ca: certs.ca })).body.toString()).samples;
    expect(sampleValue(m, "moeswarm_relay_connections", { role: "worker" })).toBe(1);
    expect(sampleValue(m, "moeswarm_relay_connections", { role: "backbone" })).toBe(1);
    expect(sampleValue(m, "moeswarm_relay_connects_total", { role: "worker" })).toBe(1);
    expect(sampleValue(m, "moeswarm_relay_dispatches_total", { outcome: "routed" })).toBe(1);
    expect(sampleValue(m, "moeswarm_relay_route_seconds_count", { outcome: "result" })).toBe(1);
    expect(sampleValue(m, "moeswarm_relay_frames_total", { direction: "in" })).toBeGreaterThanOrEqual(4);
    expect(sampleValue(m, "moeswarm_hub_workers_known")).toBe(1);

    const workersLive = json(await call(`${l1.url}/api/workers`, { ca: certs.ca })) as {
      workers: HubWorkerInfo[];
    };
    expect(workersLive.workers).toHaveLength(1);
    expect(workersLive.workers[0]).toMatchObject({
      id: "w1",
      live: true,
      draining: false,
      inFlight: 0,
      slices: [{ model: "tiny", layers: [0], experts: [0, 1, 2, 3], capacity: 123_456_789, backend: "cpu" }],
    });
    const seenAt = workersLive.workers[0]!.lastSeen;

    await bb.close();
    await first.close();
    await w1.close();

    // a new hub on the same database: the registered model and the worker's slice are back
    const second = createHub({
      secret: SECRET,
      modelDir,
      store: dbPath,
      tls: { cert: certs.cert, key: certs.key },
      requireLeases: false,
    });
    try {
      const l2 = await second.listen(0);
      const models = json(await call(`${l2.url}/api/models`, { ca: certs.ca })) as {
        models: Array<{ id: string }>;
      };
      expect(models.models.map((x) => x.id)).toEqual(["tiny"]);
      const again = await call(`${l2.url}/api/models/tiny/expert-shard?layers=0:1&experts=0:4`, {
        ca: certs.ca,
      });
      expect(again.body.equals(slice.body)).toBe(true);
      expect(again.headers.etag).toBe(slice.headers.etag);
      const workers = json(await call(`${l2.url}/api/workers`, { ca: certs.ca })) as {
        workers: HubWorkerInfo[];
      };
      expect(workers.workers).toHaveLength(1);
      const w = workers.workers[0]!;
      expect(w).toMatchObject({
        id: "w1",
        live: false,
        slices: [
          { model: "tiny", layers: [0], experts: [0, 1, 2, 3], capacity: 123_456_789, backend: "cpu" },
        ],
      });
      expect(w.lastSeen).toBeGreaterThanOrEqual(seenAt);
      expect(w.inFlight).toBeUndefined();

      // the worker comes back and registers two new slices: live again, its old slice replaced
      const w1b = await worker(l2.relayUrl, "w1");
      w1b.register({ model: "tiny", layers: [1], experts: [4, 5] });
      w1b.register({ model: "tiny", layers: [0], experts: [6, 7] });
      await waitFor(
        () => second.workers().some((x) => x.live && x.slices.length === 2),
        "w1 registered again",
      );
      expect(second.workers()[0]).toMatchObject({
        live: true,
        slices: [
          { layers: [1], experts: [4, 5] },
          { layers: [0], experts: [6, 7] },
        ],
      });
      await w1b.close();
    } finally {
      await second.close();
    }

    // a third start sees the new slices
    const third = createHub({ secret: SECRET, store: dbPath });
    try {
      await third.ready;
      expect(third.workers()).toMatchObject([
        {
          id: "w1",
          live: false,
          slices: [
            { layers: [1], experts: [4, 5] },
            { layers: [0], experts: [6, 7] },
          ],
        },
      ]);
      expect(third.models().map((x) => x.id)).toEqual(["tiny"]);
    } finally {
      await third.close();
    }
  });

  it("reports a stored model whose file is gone, and serves the others", async () => {
    const dir = tempDir();
    try {
      const db = join(dir.dir, "hub.db");
      const path = copyModel(join(modelDir, "tiny.gguf"), dir.dir, "soon-gone.gguf");
      const h1 = createHub({ secret: SECRET, modelDir: dir.dir, store: db });
      const l1 = await h1.listen(0);
      const r = await call(`${l1.url}/api/models`, {
        method: "POST",
        headers: { authorization: `Bearer ${mintToken({ role: "admin", ttlS: 60 }, SECRET)}` },
        body: JSON.stringify({ path: "soon-gone.gguf" }),
      });
      expect(r.status).toBe(201);
      await h1.close();
      const { rmSync } = await import("node:fs");
      rmSync(path);
      const events: string[] = [];
      const h2 = createHub({
        secret: SECRET,
        store: db,
        models: [{ id: "tiny", path: join(modelDir, "tiny.gguf") }],
        onEvent: (e) => {
          if (e.type === "model-unavailable") events.push(`${e.id}: ${(e.error as { code?: string }).code}`);
        },
      });
      try {
        await h2.ready;
        expect(h2.models().map((m) => m.id)).toEqual(["tiny"]);
        expect(events).toEqual(["soon-gone: MOESWARM_GGUF_IO"]);
      } finally {
        await h2.close();
      }
    } finally {
      dir.remove();
    }
  });
});

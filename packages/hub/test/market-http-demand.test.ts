import { sleep } from "@moeswarm/core";
import { Placement } from "@moeswarm/dispatch";
import { connectRelay } from "@moeswarm/relay-client";
import type { SliceManifest } from "@moeswarm/shard";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { Hub, HubEvent } from "../src/index.js";
import {
  call,
  parsePrometheus,
  referenceSlice,
  relayDispatch,
  sampleValue,
  type TempDir,
  waitFor,
} from "./hub-helpers.js";
import {
  bearer,
  capacity,
  get,
  ID,
  open,
  post,
  startMarketHub,
  T0,
  token,
  worker,
} from "./market-http-fixture.js";

let tmp: TempDir;
let tinyPath: string;
let hub: Hub;
let base: string;
let relayUrl: string;
let manifest: SliceManifest;
let now = T0;
let events: HubEvent[];

beforeAll(async () => {
  ({ tmp, tinyPath, hub, base, relayUrl, manifest, events } = await startMarketHub(() => now));
});

afterAll(async () => {
  await Promise.all(open.map((c) => c.close()));
  await hub?.close();
  tmp?.remove();
});

describe("demand, claims and leases over HTTP", () => {
  it("lists every expert as demand at first, with bytes from the manifest and its download URL", async () => {
    const { status, body } = await get(`/api/demand?model=${ID}`);
    expect(status).toBe(200);
    const per = manifest.layers[0]!.bytesPerExpert;
    expect(body.ranges).toEqual(
      [0, 1].map((layer) => ({
        model: ID,
        layer,
        layers: `${layer}:${layer + 1}`,
        experts: "0:8",
        count: 8,
        target: 1,
        coverage: 0,
        pending: 0,
        missing: 1,
        hot: false,
        value: 8 * (100 + 1),
        bytes: 8 * per,
        bytesPerExpert: per,
        nExpert: 8,
        url: `/api/models/${ID}/expert-shard?layers=${layer}:${layer + 1}&experts=0:8`,
      })),
    );
    expect(body.models).toEqual([
      {
        model: ID,
        cells: 16,
        uncovered: 16,
        belowTarget: 16,
        hot: 0,
        leases: 0,
        version: expect.any(Number),
      },
    ]);
    expect(body.policy).toMatchObject({
      maxReplicas: 4,
      hotLoad: 2,
      uncoveredValue: 100,
      halfLifeMs: 600_000,
    });
    expect((await get("/api/demand?model=nope")).status).toBe(404);
    expect((await get("/api/demand?limit=0")).status).toBe(400);
    expect((await get("/api/demand?limit=1")).body.ranges).toHaveLength(1);
  });

  it("grants a lease whose URL downloads the slice, and refuses the same cells to another worker", async () => {
    const a = await post(
      "/api/claims",
      { model: ID, layers: "0:1", experts: "0:4", capacity },
      token("worker", "w1"),
    );
    expect(a.status).toBe(201);
    const per = manifest.layers[0]!.bytesPerExpert;
    expect(a.body).toEqual({
      leaseId: expect.stringMatching(/^[A-Za-z0-9_-]{22}$/),
      worker: "w1",
      model: ID,
      layers: "0:1",
      experts: "0:4",
      bytes: 4 * per,
      grantedAt: now,
      expiresAt: now + 60_000,
      ttlMs: 60_000,
      url: `/api/models/${ID}/expert-shard?layers=0:1&experts=0:4`,
      manifest: `/api/models/${ID}/manifest`,
      capacity,
    });
    expect(a.headers.location).toBe(`/api/claims/${a.body.leaseId}`);
    const download = await call(`${base}${a.body.url}`);
    expect(
      download.body.equals(await referenceSlice(tinyPath, { layers: [0], experts: { start: 0, end: 4 } })),
    ).toBe(true);

    // leased cells are pending coverage: they leave the demand
    const demand = (await get(`/api/demand?model=${ID}`)).body;
    expect(demand.ranges.map((r: { layers: string; experts: string }) => `${r.layers}/${r.experts}`)).toEqual(
      ["1:2/0:8", "0:1/4:8"],
    );

    now += 10_000;
    const b = await post(
      "/api/claims",
      { model: ID, layers: "0:1", experts: "2:6", capacity },
      token("worker", "w2"),
    );
    expect(b.status).toBe(409);
    expect(b.body.error).toMatchObject({
      code: "MOESWARM_HUB_CONFLICT",
      details: { reason: "leased", cells: [{ layer: 0, experts: "2:4" }], retryAfterMs: 50_000 },
    });
    const small = await post(
      "/api/claims",
      { model: ID, layers: "1:2", experts: "0:8", capacity: { ramBytes: per } },
      token("worker", "w2"),
    );
    expect(small.status).toBe(409);
    expect(small.body.error.details).toEqual({ reason: "capacity", bytes: 8 * per, capacity: per });
    await post(`/api/claims/${a.body.leaseId}`, undefined, token("worker", "w1"), "DELETE");
  });

  it("answers bad claims with 400/404 and typed codes", async () => {
    const w = token("worker", "w3");
    const cases: Array<[unknown, number, string]> = [
      [{ model: ID, layers: "0:1", experts: "0:9", capacity }, 400, "MOESWARM_INVALID_RANGE"],
      [{ model: ID, layers: "0:3", experts: "0:1", capacity }, 400, "MOESWARM_GGUF_NOT_MOE"],
      [{ model: ID, layers: "1:0", experts: "0:1", capacity }, 400, "MOESWARM_INVALID_RANGE"],
      [{ model: ID, layers: 0, experts: "0:1", capacity }, 400, "MOESWARM_HUB_BAD_REQUEST"],
      [{ model: "nope", layers: "0:1", experts: "0:1", capacity }, 404, "MOESWARM_HUB_NOT_FOUND"],
      [{ model: "../x", layers: "0:1", experts: "0:1", capacity }, 400, "MOESWARM_HUB_BAD_REQUEST"],
      [{ model: ID, layers: "0:1", experts: "0:1" }, 400, "MOESWARM_HUB_BAD_REQUEST"],
      [
        { model: ID, layers: "0:1", experts: "0:1", capacity: { ramBytes: -5 } },
        400,
        "MOESWARM_INVALID_ARGUMENT",
      ],
      [{ model: ID, layers: "0:1", experts: "0:1", capacity, ttlMs: 1.5 }, 400, "MOESWARM_HUB_BAD_REQUEST"],
      [[1, 2], 400, "MOESWARM_HUB_BAD_REQUEST"],
    ];
    for (const [body, status, code] of cases) {
      const r = await post("/api/claims", body, w);
      expect([JSON.stringify(body), r.status, r.body.error?.code]).toEqual([
        JSON.stringify(body),
        status,
        code,
      ]);
    }
    const garbage = await call(`${base}/api/claims`, {
      method: "POST",
      headers: bearer(w),
      body: "{not json",
    });
    expect(garbage.status).toBe(400);
    expect((await get("/api/claims")).status).toBe(405);
  });

  it("checks tokens: workers claim (for themselves), backbones report, admins may do both", async () => {
    const body = { model: ID, layers: "1:2", experts: "0:1", capacity };
    expect((await post("/api/claims", body)).status).toBe(401);
    expect((await post("/api/claims", body, "msw1.garbage.x")).status).toBe(401);
    const asBackbone = await post("/api/claims", body, token("backbone", "b1"));
    expect([asBackbone.status, asBackbone.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    const other = await post("/api/claims", { ...body, worker: "w9" }, token("worker", "w1"));
    expect([other.status, other.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    const unbound = await post("/api/claims", body, token("worker"));
    expect([unbound.status, unbound.body.error.message]).toEqual([
      400,
      expect.stringMatching(/"worker" is required/),
    ]);
    const admin = await post("/api/claims", { ...body, worker: "w9" }, token("admin"));
    expect([admin.status, admin.body.worker]).toEqual([201, "w9"]);
    // another bound worker cannot renew or give up w9's lease; the admin can
    const renew = await post(`/api/claims/${admin.body.leaseId}/renew`, {}, token("worker", "w1"));
    expect([renew.status, renew.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    const gone = await post(`/api/claims/${admin.body.leaseId}`, undefined, token("admin"), "DELETE");
    expect(gone.body).toEqual({ released: admin.body.leaseId });
    const stats = await post(`/api/models/${ID}/stats`, { counts: {} }, token("worker", "w1"));
    expect([stats.status, stats.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    expect((await post(`/api/models/${ID}/stats`, { counts: {} }, token("admin"))).status).toBe(200);
  });

  it("renews leases on the hub's clock, expires them, and puts their cells back in demand", async () => {
    const w = token("worker", "w4");
    const a = await post("/api/claims", { model: ID, layers: "1:2", experts: "4:8", capacity }, w);
    expect(a.status).toBe(201);
    now += 50_000;
    const r = await post(`/api/claims/${a.body.leaseId}/renew`, { ttlMs: 30_000 }, w);
    expect([r.status, r.body.expiresAt, r.body.ttlMs]).toEqual([200, now + 30_000, 30_000]);
    expect((await get(`/api/claims/${a.body.leaseId}`, w)).body.expiresAt).toBe(now + 30_000);
    now += 29_999;
    expect((await get(`/api/demand?model=${ID}`)).body.models[0].leases).toBe(1);
    now += 1;
    const demand = (await get(`/api/demand?model=${ID}`)).body;
    expect(demand.models[0].leases).toBe(0);
    expect(
      demand.ranges.some(
        (x: { layers: string; experts: string }) => x.layers === "1:2" && x.experts === "0:8",
      ),
    ).toBe(true);
    const late = await post(`/api/claims/${a.body.leaseId}/renew`, {}, w);
    expect([late.status, late.body.error.code]).toEqual([404, "MOESWARM_HUB_NOT_FOUND"]);
    expect(events).toContainEqual(
      expect.objectContaining({ type: "lease", action: "expired", id: a.body.leaseId, worker: "w4" }),
    );
  });

  it("turns a lease into coverage when the worker registers the slice on the relay", async () => {
    const w = token("worker", "w5");
    const a = await post("/api/claims", { model: ID, layers: "0:2", experts: "0:2", capacity }, w);
    expect(a.status).toBe(201);
    const v0 = (await get(`/api/models/${ID}/placement`)).body.version as number;
    const conn = await worker("w5");
    conn.register({ model: ID, layers: [0, 1], experts: [0, 1] });
    // the lease is fulfilled (and stays, in service, as the registration's title)
    await waitFor(
      () => events.some((e) => e.type === "lease" && e.action === "fulfilled" && e.id === a.body.leaseId),
      "the lease to be fulfilled",
    );
    const placement = (await get(`/api/models/${ID}/placement`)).body;
    expect(placement.version).toBeGreaterThan(v0);
    expect(placement.registrations).toEqual([
      { id: "w5", model: ID, layers: [0, 1], experts: [0, 1], owner: "w5" },
    ]);
    const demand = (await get(`/api/demand?model=${ID}`)).body;
    expect(demand.models[0]).toMatchObject({ uncovered: 12, leases: 0 });
    expect(
      demand.ranges.map((x: { layers: string; experts: string }) => `${x.layers}/${x.experts}`).sort(),
    ).toEqual(["0:1/2:8", "1:2/2:8"]);
    expect(events).toContainEqual(
      expect.objectContaining({ type: "lease", action: "fulfilled", id: a.body.leaseId }),
    );
  });

  it("auto-claims the most valuable slice that fits the capacity", async () => {
    const per = manifest.layers[0]!.bytesPerExpert;
    const a = await post("/api/claims/auto", { capacity: { ramBytes: 3 * per } }, token("worker", "w6"));
    expect(a.status).toBe(201);
    expect([a.body.layers, a.body.experts, a.body.bytes]).toEqual(["0:1", "2:5", 3 * per]);
    const tooSmall = await post(
      "/api/claims/auto",
      { model: ID, capacity: { ramBytes: per - 1 } },
      token("worker", "w7"),
    );
    expect([tooSmall.status, tooSmall.body.error.details.reason]).toEqual([409, "capacity"]);
    await post(`/api/claims/${a.body.leaseId}`, undefined, token("worker", "w6"), "DELETE");
  });
});

describe("placement for backbones", () => {
  it("publishes what dispatch's Placement is built from, and long-polls until it changes", async () => {
    const first = await get(`/api/models/${ID}/placement`);
    expect(first.headers.etag).toBe(`"p${first.body.version}"`);
    const placement = Placement.fromRegistrations(first.body.registrations, { model: first.body.model });
    expect(placement.owners(1, 0)).toEqual(["w5"]);
    expect(first.body.missing).toEqual(placement.missing({ layers: [0, 1], nExpert: 8 }));

    // unchanged: 304 at once for If-None-Match, after `wait` for since=
    const same = await call(`${base}/api/models/${ID}/placement`, {
      headers: { "if-none-match": first.headers.etag as string },
    });
    expect(same.status).toBe(304);
    const quick = await call(`${base}/api/models/${ID}/placement?since=${first.body.version}&wait=0`);
    expect(quick.status).toBe(304);

    const started = Date.now();
    const polled = get(`/api/models/${ID}/placement?since=${first.body.version}&wait=5`);
    await sleep(100);
    const w8 = await worker("w8");
    w8.register({ model: ID, layers: [1], experts: [6, 7] });
    const changed = await polled;
    expect(Date.now() - started).toBeLessThan(4500);
    expect(changed.status).toBe(200);
    expect(changed.body.version).toBeGreaterThan(first.body.version);
    expect(changed.body.registrations.map((r: { id: string }) => r.id)).toEqual(["w5", "w8"]);

    const polledDrain = get(`/api/models/${ID}/placement?since=${changed.body.version}&wait=5`);
    await sleep(50);
    w8.drain("going away");
    const drained = await polledDrain;
    expect(drained.body.registrations.map((r: { id: string }) => r.id)).toEqual(["w5"]);
    expect((await get(`/api/models/${ID}/placement?since=x`)).status).toBe(400);
    expect((await get(`/api/models/nope/placement`)).status).toBe(404);
  });
});

describe("backbone stats: demand, tokens/s and credits", () => {
  it("learns hot experts from routing counts, credits workers from receipts, shows both", async () => {
    const b = token("backbone", "bb1");
    // what the report claims is bounded by what the relay carried from bb1: route enough to w5
    const bb1 = await connectRelay(relayUrl, {
      role: "backbone",
      id: "bb1",
      token: b,
      reconnect: false,
    });
    open.push(bb1);
    await Promise.allSettled([
      relayDispatch(bb1, "w5", ID, 0, new Int32Array(1000).fill(0), 1),
      relayDispatch(
        bb1,
        "w5",
        ID,
        1,
        Int32Array.from({ length: 40 }, (_, i) => i % 8),
        8,
      ),
    ]);
    const counts = {
      "0": [1000, 0, 0, 0, 0, 0, 0, 0],
      "1": Buffer.from(new Uint32Array([5, 5, 5, 5, 5, 5, 5, 5]).buffer).toString("base64"),
    };
    const r = await post(
      `/api/models/${ID}/stats`,
      {
        seq: 1,
        tokens: 50,
        ms: 10_000,
        counts,
        receipts: { w5: { expertTokens: 700, ms: 12.5 }, ghost: { expertTokens: 5 } },
      },
      b,
    );
    expect(r.status).toBe(200);
    expect(r.body).toEqual({
      model: ID,
      backbone: "bb1",
      accepted: true,
      layers: 2,
      credited: ["w5"],
      ignored: ["ghost"],
      // nothing asked beyond what the relay carried from bb1, but the ghost's 5 (it carried none)
      cut: { expertTokens: 5, counts: 0, tokens: 0 },
      creditedExpertTokens: 700,
    });
    // a retry of the same report counts nothing twice
    const again = await post(
      `/api/models/${ID}/stats`,
      { seq: 1, counts, receipts: { w5: { expertTokens: 700 } } },
      b,
    );
    expect(again.body.accepted).toBe(false);

    // h = 8 (1000 + 1) / (1000 + 8) = 7.94 for expert 0 of layer 0: ceil(7.94 / 2) = 4 replicas
    const status = (await get("/api/status")).body;
    const m = status.models[0];
    expect(m.grid.targets[0]).toEqual([4, 1, 1, 1, 1, 1, 1, 1]);
    expect(m.grid.load[0][0]).toBe(Math.round(((8 * (1000 + 1)) / (1000 + 8)) * 1000) / 1000);
    expect(m.grid.replicas[0]).toEqual([1, 1, 0, 0, 0, 0, 0, 0]);
    expect(m.hot).toBe(1);
    expect(status.tokensPerSecond).toBe(5);
    expect(status.backbones).toEqual([{ id: "bb1", model: ID, tokensPerSecond: 5, at: now }]);
    const w5 = status.workers.find((w: { id: string }) => w.id === "w5");
    expect(w5).toMatchObject({
      live: true,
      expertTokens: 700,
      slices: [{ model: ID, layers: "0:2", experts: "0:2" }],
    });

    const hot = (await get(`/api/demand?model=${ID}`)).body.ranges.find(
      (x: { layers: string; experts: string }) => x.layers === "0:1" && x.experts === "0:1",
    );
    expect(hot).toMatchObject({ target: 4, coverage: 1, missing: 3, hot: true });

    const workers = (await get("/api/workers")).body.workers;
    expect(workers.find((w: { id: string }) => w.id === "w5")).toMatchObject({
      credits: { expertTokens: 700, byModel: { [ID]: 700 } },
      reportedLatencyMs: 12.5,
    });

    // decay: one half-life later the counts weigh half, and the prior a little more
    now += 600_000;
    const decayed = (await get("/api/status")).body.models[0].grid.load[0][0];
    expect(decayed).toBe(Math.round(((8 * (500 + 1)) / (500 + 8)) * 1000) / 1000);
    // the report is older than statsStaleMs: no longer live tokens/s
    expect((await get("/api/status")).body.tokensPerSecond).toBe(0);

    const text = (await call(`${base}/metrics`)).body.toString();
    const { samples } = parsePrometheus(text);
    expect(sampleValue(samples, "moeswarm_hub_expert_tokens_served_total", { model: ID })).toBe(700);
    expect(sampleValue(samples, "moeswarm_hub_cells", { model: ID, state: "total" })).toBe(16);
    expect(sampleValue(samples, "moeswarm_hub_cells", { model: ID, state: "hot" })).toBe(1);
    expect(sampleValue(samples, "moeswarm_hub_stats_reports_total", { outcome: "duplicate" })).toBe(1);
    expect(sampleValue(samples, "moeswarm_hub_claims_total", { outcome: "granted" })).toBeGreaterThan(3);
    expect(sampleValue(samples, "moeswarm_hub_claims_total", { outcome: "leased" })).toBeGreaterThan(0);
    expect(sampleValue(samples, "moeswarm_hub_leases_ended_total", { reason: "fulfilled" })).toBe(1);
  });

  it("refuses malformed reports whole", async () => {
    const b = token("backbone", "bb2");
    const bad: unknown[] = [
      { counts: { "0": [1, 2, 3] } },
      { counts: { "2": [0, 0, 0, 0, 0, 0, 0, 0] } },
      { counts: { "0": [0, 0, 0, 0, 0, 0, 0, -1] } },
      { counts: { "0": "AAAA" } },
      { counts: { "0": [0, 0, 0, 0, 0, 0, 0, 0] }, tokens: 5 },
      { receipts: { w5: { expertTokens: 1.5 } } },
      { receipts: { w5: 7 } },
      { seq: -1 },
      { backbone: "someone-else" },
      "nope",
    ];
    const before = (await get("/api/status")).body.models[0].grid.load;
    for (const body of bad) {
      const r = await post(`/api/models/${ID}/stats`, body, b);
      expect([JSON.stringify(body), r.status]).toEqual([JSON.stringify(body), body === bad[8] ? 403 : 400]);
    }
    expect((await get("/api/status")).body.models[0].grid.load).toEqual(before);
    const big = await call(`${base}/api/models/${ID}/stats`, {
      method: "POST",
      headers: bearer(b),
      body: `{"pad":"${"x".repeat(300_000)}"}`,
    });
    expect(big.status).toBe(413);
  });
});

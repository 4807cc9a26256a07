import { join } from "node:path";
import { HubError } from "@moeswarm/core";
import { connectRelay } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createHub, createMemoryStore, type Hub, mintToken } from "../src/index.js";
import {
  call,
  copyModel,
  json,
  relayDispatch,
  syntheticModel,
  type TempDir,
  tempDir,
  waitFor,
} from "./hub-helpers.js";

const SECRET = "hub-persist-secret-0123456789abcdef";
const ID = "tiny";

let tmp: TempDir;
let modelPath: string;
let dbPath: string;
let now = 1_700_000_000_000;

beforeAll(async () => {
  tmp = tempDir();
  modelPath = copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf");
  dbPath = join(tmp.dir, "state", "hub.db");
});

afterAll(() => tmp?.remove());

const token = (role: "worker" | "backbone", id: string) => mintToken({ role, id, ttlS: 600 }, SECRET);

function start(): Hub {
  return createHub({
    secret: SECRET,
    models: [{ id: ID, path: modelPath }],
    store: dbPath,
    clock: () => now,
    market: { leaseTtlMs: 60_000 },
    // one copy per expert, and a fake worker that registers without claiming
    replicas: 1,
    requireLeases: false,
  });
}

async function req(
  base: string,
  path: string,
  options: { method?: string; body?: unknown; token?: string } = {},
) {
  const a = await call(`${base}${path}`, {
    method: options.method ?? "GET",
    headers: {
      "content-type": "application/json",
      ...(options.token === undefined ? {} : { authorization: `Bearer ${options.token}` }),
    },
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  return { status: a.status, body: a.body.byteLength > 0 ? (json(a) as Record<string, unknown>) : {} };
}

describe("the market survives a restart (SQLite)", () => {
  it("keeps leases, decayed demand and credits; drops leases that expired meanwhile", async () => {
    const first = start();
    const l1 = await first.listen(0);
    const w = await connectRelay(l1.relayUrl, {
      role: "worker",
      id: "wp",
      token: token("worker", "wp"),
      reconnect: false,
      onDispatch: () => ({ y: new Float32Array(0) }),
    });
    w.register({ model: ID, layers: [0], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
    await waitFor(() => first.market.summary(ID, now).uncovered === 8, "the registration");
    // the report below is bounded by what the relay carried from bb: 900 selections of expert 2
    const bb = await connectRelay(l1.relayUrl, {
      role: "backbone",
      id: "bb",
      token: token("backbone", "bb"),
      reconnect: false,
    });
    await relayDispatch(bb, "wp", ID, 1, new Int32Array(900).fill(2), 1).catch(() => undefined);
    await bb.close();
    const stats = await req(l1.url, `/api/models/${ID}/stats`, {
      method: "POST",
      token: token("backbone", "bb"),
      body: { counts: { "1": [0, 0, 900, 0, 0, 0, 0, 0] }, receipts: { wp: { expertTokens: 123 } } },
    });
    expect(stats.body).toMatchObject({ accepted: true, credited: ["wp"] });
    const lease = await req(l1.url, "/api/claims", {
      method: "POST",
      token: token("worker", "wq"),
      body: { model: ID, layers: "1:2", experts: "4:8", capacity: { ramBytes: 1 << 30 } },
    });
    expect(lease.status).toBe(201);
    const short = await req(l1.url, "/api/claims", {
      method: "POST",
      token: token("worker", "wr"),
      body: { model: ID, layers: "1:2", experts: "0:2", capacity: { ramBytes: 1 << 30 }, ttlMs: 1000 },
    });
    expect(short.status).toBe(201);
    const before = first.status();
    await w.close();
    await first.close();

    now += 2000; // the short lease expired while the hub was down
    const second = start();
    const l2 = await second.listen(0);
    try {
      const kept = await req(l2.url, `/api/claims/${lease.body.leaseId}`, { token: token("worker", "wq") });
      expect(kept.body).toMatchObject({
        leaseId: lease.body.leaseId,
        expiresAt: lease.body.expiresAt,
        layers: "1:2",
      });
      const gone = await req(l2.url, `/api/claims/${short.body.leaseId}`, { token: token("worker", "wr") });
      expect(gone.status).toBe(404);

      const after = second.status();
      const [m0, m1] = [before.models[0], after.models[0]];
      // the demand is the same counts, decayed by 2 s of a 10 min half-life
      expect(m1?.grid.targets).toEqual(m0?.grid.targets);
      expect(m1?.grid.targets[1]).toEqual([1, 1, 4, 1, 1, 1, 1, 1]);
      const h = (d: number) => Math.round(((8 * (d + 1)) / (d + 8)) * 1000) / 1000;
      expect(m1?.grid.load[1]?.[2]).toBe(h(900 * 2 ** (-2000 / 600_000)));
      // the worker is offline after the restart, its lease is still pending
      expect(m1?.grid.replicas).toEqual([new Array(8).fill(0), new Array(8).fill(0)]);
      expect(m1?.grid.pending[1]).toEqual([0, 0, 0, 0, 1, 1, 1, 1]);
      const workers = (await req(l2.url, "/api/workers")).body.workers as Array<Record<string, unknown>>;
      expect(workers.find((x) => x.id === "wp")).toMatchObject({
        live: false,
        credits: { expertTokens: 123, byModel: { [ID]: 123 } },
      });
    } finally {
      await second.close();
    }

    now += 120_000; // the long lease expires too; the next start finds none
    const third = start();
    try {
      await third.ready;
      expect(third.market.leases()).toEqual([]);
    } finally {
      await third.close();
    }
    const fourth = start();
    try {
      await fourth.ready;
      expect(fourth.market.leases()).toEqual([]);
      expect(fourth.market.creditsOf("wp").expertTokens).toBe(123);
    } finally {
      await fourth.close();
    }
  });
});

describe("a lease is written before it is answered", () => {
  it("answers 503 and grants nothing when the store cannot write it", async () => {
    const store = createMemoryStore();
    let failing = true;
    const putLeases = store.putLeases.bind(store);
    store.putLeases = async (leases) => {
      if (failing) throw new HubError("MOESWARM_HUB_STORE", "disk full");
      await putLeases(leases);
    };
    const hub = createHub({ secret: SECRET, models: [{ id: ID, path: modelPath }], store });
    try {
      const { url } = await hub.listen(0);
      const body = { model: ID, layers: "0:1", experts: "0:8", capacity: { ramBytes: 1 << 30 } };
      const refused = await req(url, "/api/claims", { method: "POST", token: token("worker", "wz"), body });
      expect([refused.status, (refused.body.error as { code: string }).code]).toEqual([
        503,
        "MOESWARM_HUB_STORE",
      ]);
      expect(hub.market.leases()).toEqual([]);
      expect(await store.listLeases()).toEqual([]);
      failing = false;
      const granted = await req(url, "/api/claims", { method: "POST", token: token("worker", "wz"), body });
      expect(granted.status).toBe(201);
      expect((await store.listLeases()).map((l) => l.id)).toEqual([granted.body.leaseId]);
    } finally {
      await hub.close();
      await store.close();
    }
  });
});

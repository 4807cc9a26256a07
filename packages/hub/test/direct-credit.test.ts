// Credits for direct traffic: each side reports its own half (the worker what it answered per
// backbone, the backbone its receipts), the hub credits the minimum, only for pairs it ticketed.
// The forgers: a worker over-reporting, a backbone under-reporting, a report naming a pair
// without a ticket, a replayed report, and another peer's token.
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import fc from "fast-check";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { DirectCredit } from "../src/direct-credit.js";
import { createHub, type Hub, mintToken } from "../src/index.js";
import { call, json, syntheticModel, waitFor } from "./hub-helpers.js";

const SECRET = "hub-direct-credit-test-secret-012345";
const MODEL = "m";

let hub: Hub;
let url: string;
let worker: RelayConnection;

const token = (role: "worker" | "backbone" | "admin", id?: string) =>
  mintToken({ role, ...(id ? { id } : {}), ttlS: 600 }, SECRET);
async function post(path: string, body: unknown, auth: string) {
  const r = await call(`${url}${path}`, {
    method: "POST",
    headers: { authorization: `Bearer ${auth}`, "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  // biome-ignore lint/suspicious/noExplicitAny: the answers' shapes are what these tests check
  return { status: r.status, body: json(r) as any };
}
const served = (seq: number, entries: Array<[backbone: string, expertTokens: number]>, model = MODEL) => ({
  seq,
  served: entries.map(([backbone, expertTokens]) => ({ backbone, model, expertTokens, requests: 1 })),
});
const report = (seq: number, expertTokens: number, w = "wd") => ({
  seq,
  counts: {},
  receipts: { [w]: { expertTokens } },
});
const credits = () => hub.market.creditsOf("wd").expertTokens;

beforeAll(async () => {
  const path = await syntheticModel("tiny");
  hub = createHub({
    secret: SECRET,
    models: [{ id: MODEL, path }],
    requireLeases: false,
    replicas: 1,
    dashboard: false,
  });
  ({ url } = await hub.listen(0));
  worker = await connectRelay(`${url.replace(/^http/, "ws")}/relay`, {
    role: "worker",
    id: "wd",
    token: token("worker", "wd"),
    reconnect: false,
  });
  worker.register({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
  await waitFor(() => hub.workers().some((w) => w.id === "wd"), "wd known");
  // bb was given a ticket to wd (it dialed it directly); bb2 never was
  expect((await post("/api/direct/tickets", { worker: "wd" }, token("backbone", "bb"))).status).toBe(200);
});
afterAll(async () => {
  await worker?.close();
  await hub?.close();
});

describe("credits for direct traffic: the minimum of both sides' reports", () => {
  it("an honest pair is credited what both said, whichever reports first", async () => {
    const w = await post("/api/workers/wd/direct/served", served(1, [["bb", 40]]), token("worker", "wd"));
    expect(w.status, JSON.stringify(w.body)).toBe(200);
    expect(w.body).toEqual({
      worker: "wd",
      accepted: true,
      credited: [{ backbone: "bb", model: MODEL, expertTokens: 0 }],
      refused: [],
    });
    const b = await post(`/api/models/${MODEL}/stats`, report(1, 40), token("backbone", "bb"));
    expect([b.body.creditedExpertTokens, b.body.cut.expertTokens]).toEqual([40, 0]);
    expect(credits()).toBe(40);
    // the other order: backbone first, then the worker's report credits it
    expect(
      (await post(`/api/models/${MODEL}/stats`, report(2, 12), token("backbone", "bb"))).body
        .creditedExpertTokens,
    ).toBe(0);
    const w2 = await post("/api/workers/wd/direct/served", served(2, [["bb", 12]]), token("worker", "wd"));
    expect(w2.body.credited).toEqual([{ backbone: "bb", model: MODEL, expertTokens: 12 }]);
    expect(credits()).toBe(52);
  });

  it("a worker over-reporting gains only what the backbone accepted; a backbone under-reporting pays only what it said", async () => {
    const before = credits();
    // the worker claims 2^32-1, the backbone accepted 30
    await post("/api/workers/wd/direct/served", served(3, [["bb", 0xffff_ffff]]), token("worker", "wd"));
    const b = await post(`/api/models/${MODEL}/stats`, report(3, 30), token("backbone", "bb"));
    expect(b.body.creditedExpertTokens).toBe(30);
    expect(credits() - before).toBe(30);
    // the worker's excess waits for a backbone that never confirms it: a later honest round adds
    // exactly what the backbone says
    expect(hub.market.creditsOf("wd").expertTokens).toBe(before + 30);
  });

  it("a backbone under-reporting an honest worker's work: credited what the backbone said, the rest waits", async () => {
    expect((await post("/api/direct/tickets", { worker: "wd" }, token("backbone", "bb4"))).status).toBe(200);
    const before = credits();
    // the worker answered 100 slots; the backbone admits 60, then (a later report) 40 more
    const w = await post("/api/workers/wd/direct/served", served(4, [["bb4", 100]]), token("worker", "wd"));
    expect(w.body.credited).toEqual([{ backbone: "bb4", model: MODEL, expertTokens: 0 }]);
    const b1 = await post(`/api/models/${MODEL}/stats`, report(1, 60), token("backbone", "bb4"));
    expect(b1.body.creditedExpertTokens).toBe(60);
    expect(credits() - before).toBe(60);
    const b2 = await post(`/api/models/${MODEL}/stats`, report(2, 40), token("backbone", "bb4"));
    expect(b2.body.creditedExpertTokens).toBe(40);
    // and never past what the worker claimed
    const b3 = await post(`/api/models/${MODEL}/stats`, report(3, 500), token("backbone", "bb4"));
    expect([b3.body.creditedExpertTokens, b3.body.cut.expertTokens]).toEqual([0, 500]);
    expect(credits() - before).toBe(100);
  });

  it("refuses entries naming a backbone with no ticket to this worker, on both sides", async () => {
    const before = credits();
    const w = await post(
      "/api/workers/wd/direct/served",
      served(5, [
        ["bb2", 500],
        ["bb", 0],
      ]),
      token("worker", "wd"),
    );
    expect(w.body.refused).toEqual([{ backbone: "bb2", model: MODEL }]);
    // bb2's receipts beyond the relay (nothing) are cut: no ticket, no direct traffic
    const b = await post(`/api/models/${MODEL}/stats`, report(1, 500), token("backbone", "bb2"));
    expect([b.body.creditedExpertTokens, b.body.cut.expertTokens]).toEqual([0, 500]);
    // an unknown model is refused too
    const m = await post(
      "/api/workers/wd/direct/served",
      served(6, [["bb", 9]], "nope"),
      token("worker", "wd"),
    );
    expect(m.body.refused).toEqual([{ backbone: "bb", model: "nope" }]);
    expect(credits()).toBe(before);
  });

  it("a replayed report counts nothing again, on either side", async () => {
    // a fresh pair (bb3, with a ticket): the backbone has 1e6 confirmed, the worker claims 100
    expect((await post("/api/direct/tickets", { worker: "wd" }, token("backbone", "bb3"))).status).toBe(200);
    const before = credits();
    expect(
      (await post(`/api/models/${MODEL}/stats`, report(1, 1_000_000), token("backbone", "bb3"))).body
        .creditedExpertTokens,
    ).toBe(0);
    const first = await post(
      "/api/workers/wd/direct/served",
      served(7, [["bb3", 100]]),
      token("worker", "wd"),
    );
    expect(first.body.credited[0].expertTokens).toBe(100);
    for (const seq of [7, 6, 1]) {
      const again = await post(
        "/api/workers/wd/direct/served",
        served(seq, [["bb3", 100]]),
        token("worker", "wd"),
      );
      expect([again.status, again.body.accepted, again.body.credited]).toEqual([200, false, []]);
    }
    const bAgain = await post(`/api/models/${MODEL}/stats`, report(1, 1_000_000), token("backbone", "bb3"));
    expect(bAgain.body.accepted).toBe(false);
    expect(credits() - before).toBe(100);
  });

  it("only the worker's own token reports its work", async () => {
    for (const t of [token("worker", "other"), token("backbone", "bb"), token("admin")]) {
      const r = await post("/api/workers/wd/direct/served", served(99, [["bb", 1]]), t);
      expect([r.status, r.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    }
    for (const bad of [
      { seq: -1, served: [] },
      { seq: 1, served: {} },
      served(1, [["bb", 1.5]]),
      {
        seq: 1,
        served: [
          ...served(1, [
            ["bb", 1],
            ["bb", 2],
          ]).served,
        ],
      },
    ]) {
      const r = await post("/api/workers/wd/direct/served", bad, token("worker", "wd"));
      expect([r.status, r.body.error.code], JSON.stringify(bad)).toEqual([400, "MOESWARM_HUB_BAD_REQUEST"]);
    }
  });
});

describe("DirectCredit", () => {
  it("credits exactly min(sum of the worker's, sum of the backbone's) whatever the order (fast-check)", () => {
    fc.assert(
      fc.property(fc.array(fc.tuple(fc.boolean(), fc.nat(1000)), { maxLength: 40 }), (steps) => {
        const d = new DirectCredit({ clock: () => 0, ticketed: () => true });
        let w = 0;
        let b = 0;
        let credited = 0;
        let seq = 0;
        for (const [fromWorker, n] of steps) {
          if (fromWorker) {
            w += n;
            credited += d.fromWorker("w", {
              seq: seq++,
              served: [{ backbone: "b", model: "m", expertTokens: n }],
            }).credited[0]!.expertTokens;
          } else {
            b += n;
            credited += d.fromBackbone("b", "w", "m", n);
          }
          expect(credited).toBe(Math.min(w, b));
        }
      }),
    );
  });

  it("an unmatched half lapses after the window (fake clock)", () => {
    let now = 0;
    const d = new DirectCredit({ clock: () => now, ticketed: (b) => b === "b", windowMs: 1000 });
    expect(d.fromBackbone("b", "w", "m", 50)).toBe(0);
    expect(d.fromBackbone("x", "w", "m", 50)).toBe(0);
    expect(d.pending("b", "w", "m")).toEqual({ worker: 0, backbone: 50 });
    expect(d.pending("x", "w", "m")).toEqual({ worker: 0, backbone: 0 });
    now = 1001;
    expect(d.pending("b", "w", "m")).toEqual({ worker: 0, backbone: 0 });
    expect(
      d.fromWorker("w", { seq: 1, served: [{ backbone: "b", model: "m", expertTokens: 50 }] }).credited,
    ).toEqual([{ backbone: "b", model: "m", expertTokens: 0 }]);
  });
});

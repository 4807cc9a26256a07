// Credits for direct traffic: each side reports its own half (the worker what it answered per
// backbone, the backbone its receipts), the hub credits the minimum, only for pairs it ticketed.
// The forgers: a worker over-reporting, a backbone under-reporting, a report naming a pair
// without a ticket, a replayed report, and another peer's token.

import { join } from "node:path";
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import fc from "fast-check";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { DirectCredit } from "../src/direct-credit.js";
import { type DirectHub, DIRECT_MODEL as MODEL, type Role, startDirectHub } from "./direct-fixture.js";
import { parsePrometheus, sampleValue, tempDir, waitFor } from "./hub-helpers.js";

const SECRET = "hub-direct-credit-test-secret-012345";

let h: DirectHub;
let worker: RelayConnection;

const token = (role: Role, id?: string) => h.token(role, id);
const post = (path: string, body: unknown, auth: string) => h.send("POST", path, body, auth);
const served = (seq: number, entries: Array<[backbone: string, expertTokens: number]>, model = MODEL) => ({
  seq,
  served: entries.map(([backbone, expertTokens]) => ({ backbone, model, expertTokens, requests: 1 })),
});
const report = (seq: number, expertTokens: number, w = "wd") => ({
  seq,
  counts: {},
  receipts: { [w]: { expertTokens } },
});
const credits = () => h.hub.market.creditsOf("wd").expertTokens;

/** Worker `id` connected to `d`'s relay with a slice of MODEL, known to the hub. */
async function liveWorker(d: DirectHub, id: string): Promise<RelayConnection> {
  const w = await connectRelay(d.relayUrl, {
    role: "worker",
    id,
    token: d.token("worker", id),
    reconnect: false,
  });
  w.register({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
  await waitFor(() => d.hub.workers().some((x) => x.id === id), `${id} known`);
  return w;
}

beforeAll(async () => {
  h = await startDirectHub(SECRET);
  worker = await liveWorker(h, "wd");
  // bb was given a ticket to wd (it dialed it directly); bb2 never was
  expect((await post("/api/direct/tickets", { worker: "wd" }, token("backbone", "bb"))).status).toBe(200);
});
afterAll(async () => {
  await worker?.close();
  await h?.close();
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
    expect(h.hub.market.creditsOf("wd").expertTokens).toBe(before + 30);
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

  it("/metrics shows the unmatched halves by side, gone once matched", async () => {
    const scrape = async () => parsePrometheus(await h.hub.metrics.registry.metrics());
    const before = (await scrape()).samples;
    expect((await post("/api/direct/tickets", { worker: "wd" }, token("backbone", "bb6"))).status).toBe(200);
    await post("/api/workers/wd/direct/served", served(50, [["bb6", 70]]), token("worker", "wd"));
    const { samples: after, types } = await scrape();
    const delta = (name: string, side: string) =>
      sampleValue(after, name, { side }) - sampleValue(before, name, { side });
    expect(delta("moeswarm_hub_direct_pending_halves", "worker")).toBe(1);
    expect(delta("moeswarm_hub_direct_pending_expert_tokens", "worker")).toBe(70);
    expect(delta("moeswarm_hub_direct_pending_halves", "backbone")).toBe(0);
    expect(
      sampleValue(after, "moeswarm_hub_direct_pending_oldest_seconds", { side: "worker" }),
    ).toBeGreaterThan(0);
    expect(types.get("moeswarm_hub_direct_pending_oldest_seconds")).toBe("gauge");
    expect(types.get("moeswarm_hub_direct_lapsed_expert_tokens_total")).toBe("counter");
    // the backbone's half matches it: the worker's half is gone again
    expect(
      (await post(`/api/models/${MODEL}/stats`, report(1, 70), token("backbone", "bb6"))).body
        .creditedExpertTokens,
    ).toBe(70);
    const matched = (await scrape()).samples;
    for (const name of ["moeswarm_hub_direct_pending_halves", "moeswarm_hub_direct_pending_expert_tokens"]) {
      expect(sampleValue(matched, name, { side: "worker" }), name).toBe(
        sampleValue(before, name, { side: "worker" }),
      );
    }
  });
});

describe("direct credits across a hub restart on the same store (SQLite)", () => {
  it("a half reported before the restart is matched after it; the ticketed pairs and the worker's seq are kept", async () => {
    const dir = tempDir();
    const store = join(dir.dir, "hub.db");
    const stats = `/api/models/${MODEL}/stats`;
    const servedPath = "/api/workers/wr/direct/served";
    try {
      const first = await startDirectHub(SECRET, { store });
      const w = await liveWorker(first, "wr");
      for (const bb of ["rb1", "rb2"]) {
        const t = await first.send(
          "POST",
          "/api/direct/tickets",
          { worker: "wr" },
          first.token("backbone", bb),
        );
        expect(t.status).toBe(200);
      }
      // rb1: the worker's half comes before the restart; rb2: the backbone's
      const ws = await first.send("POST", servedPath, served(1, [["rb1", 40]]), first.token("worker", "wr"));
      expect(ws.body.credited).toEqual([{ backbone: "rb1", model: MODEL, expertTokens: 0 }]);
      const bs = await first.send("POST", stats, report(1, 25, "wr"), first.token("backbone", "rb2"));
      expect(bs.body.creditedExpertTokens).toBe(0);
      await w.close();
      await first.close();

      const second = await startDirectHub(SECRET, { store });
      try {
        const before = second.hub.market.creditsOf("wr").expertTokens;
        // this hub minted no ticket: the pairs the first one ticketed still count, and the halves wait
        const b = await second.send("POST", stats, report(1, 40, "wr"), second.token("backbone", "rb1"));
        expect([b.body.creditedExpertTokens, b.body.cut.expertTokens]).toEqual([40, 0]);
        // the worker's retry of its report from before the restart is still a duplicate
        const again = await second.send(
          "POST",
          servedPath,
          served(1, [["rb1", 40]]),
          second.token("worker", "wr"),
        );
        expect([again.status, again.body.accepted]).toEqual([200, false]);
        const w2 = await second.send(
          "POST",
          servedPath,
          served(2, [["rb2", 25]]),
          second.token("worker", "wr"),
        );
        expect(w2.body.credited).toEqual([{ backbone: "rb2", model: MODEL, expertTokens: 25 }]);
        expect(second.hub.market.creditsOf("wr").expertTokens - before).toBe(65);
        // a pair neither hub ticketed is still refused
        const stranger = await second.send(
          "POST",
          servedPath,
          served(3, [["rb9", 5]]),
          second.token("worker", "wr"),
        );
        expect(stranger.body.refused).toEqual([{ backbone: "rb9", model: MODEL }]);
      } finally {
        await second.close();
      }
    } finally {
      dir.remove();
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

  it("figures: unmatched halves, their tokens and oldest age per side; what lapsed, expired or evicted (fake clock)", () => {
    let now = 0;
    const d = new DirectCredit({ clock: () => now, ticketed: () => true, windowMs: 1000, maxPending: 2 });
    const zero = { worker: 0, backbone: 0 };
    d.fromBackbone("b1", "w", "m", 10);
    now = 100;
    d.fromWorker("w", { seq: 1, served: [{ backbone: "b2", model: "m", expertTokens: 7 }] });
    now = 300;
    expect(d.figures()).toEqual({
      halves: { worker: 1, backbone: 1 },
      expertTokens: { worker: 7, backbone: 10 },
      oldestMs: { worker: 200, backbone: 300 },
      lapsed: { expired: zero, evicted: zero },
    });
    // a third pair past the bound evicts the stalest (b1's backbone half)
    d.fromBackbone("b3", "w", "m", 5);
    expect(d.figures()).toMatchObject({
      halves: { worker: 1, backbone: 1 },
      expertTokens: { worker: 7, backbone: 5 },
      lapsed: { expired: zero, evicted: { worker: 0, backbone: 10 } },
    });
    // past the window b2 (last touched at 100) lapses; b3 (at 300) waits on
    now = 1201;
    expect(d.figures()).toMatchObject({
      halves: { worker: 0, backbone: 1 },
      oldestMs: { worker: 0, backbone: 901 },
      lapsed: { expired: { worker: 7, backbone: 0 }, evicted: { worker: 0, backbone: 10 } },
    });
  });

  it("hands the store what changed (dropped pairs as zeros) and loads it back: a restart keeps halves and seqs", () => {
    let now = 0;
    const d = new DirectCredit({ clock: () => now, ticketed: () => true, windowMs: 1000 });
    d.fromBackbone("b1", "w", "m", 10);
    d.fromWorker("w", { seq: 5, served: [{ backbone: "b2", model: "m", expertTokens: 7 }] });
    d.fromWorker("w", { seq: 6, served: [{ backbone: "b1", model: "m", expertTokens: 10 }] }); // b1 matched
    const c = d.takeChanges();
    const byPair = (a: { backbone: string }, b: { backbone: string }) => (a.backbone < b.backbone ? -1 : 1);
    expect([...(c?.pending ?? [])].sort(byPair)).toEqual([
      { backbone: "b1", worker: "w", model: "m", workerExpertTokens: 0, backboneExpertTokens: 0, at: 0 },
      { backbone: "b2", worker: "w", model: "m", workerExpertTokens: 7, backboneExpertTokens: 0, at: 0 },
    ]);
    expect(c?.seqs).toEqual([{ worker: "w", seq: 6 }]);
    expect(d.takeChanges()).toBeUndefined();
    // a failed write: the same pairs go with the next one
    d.restoreChanges(c!);
    expect(d.takeChanges()?.pending).toHaveLength(2);

    now = 500;
    const kept = c!.pending.filter((r) => r.workerExpertTokens + r.backboneExpertTokens > 0);
    const d2 = new DirectCredit({ clock: () => now, ticketed: () => true, windowMs: 1000 });
    d2.load({ pending: kept, seqs: c!.seqs });
    expect(d2.pending("b2", "w", "m")).toEqual({ worker: 7, backbone: 0 });
    expect(d2.fromWorker("w", { seq: 6, served: [] }).accepted).toBe(false);
    expect(d2.fromBackbone("b2", "w", "m", 9)).toBe(7);
    // the window still runs from the last report before the restart
    const d3 = new DirectCredit({ clock: () => 1001, ticketed: () => true, windowMs: 1000 });
    d3.load({ pending: kept, seqs: [] });
    expect(d3.pending("b2", "w", "m")).toEqual({ worker: 0, backbone: 0 });
    expect(d3.figures().lapsed.expired).toEqual({ worker: 7, backbone: 0 });
  });
});

// Pauses that survive a hub restart (issue 19): the hub's pause (its owner's or the operator's)
// is kept in the store, so a hub started again on the same store still leaves the worker out of
// placements and tells it so when it comes back; a worker's own pause (battery, heat) is not kept:
// the restart forgets it, and the worker tells it again while it lasts. A real hub on loopback,
// restarted on one SQLite file (and on one memory store object, an embedder's restart in tests).
import { join } from "node:path";
import { HubError } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import {
  createMemoryStore,
  type HubStore,
  loadSqliteDriver,
  openSqliteStore,
  SQLITE_DRIVERS,
} from "../src/index.js";
import { openPauseStore, type PauseStore } from "../src/store-pauses.js";
import { WorkerPauses } from "../src/worker-pause.js";
import { waitFor } from "./hub-helpers.js";
import { type Body, usePauseHubs } from "./pause-fixture.js";

const SECRET = "hub-pause-persist-secret-0123456789";

const fx = usePauseHubs(SECRET, "moeswarm-hub-pause-persist-");
const { admin, workerToken, request, placed, connect, serve } = fx;
/** A hub on `store`: a SQLite path, or a store object (an embedder's). */
const start = (store: string | HubStore) => fx.start({ store });

describe("a hub restarted on the same store", () => {
  it("keeps an owner's or the operator's pause (out of placement, the worker told at its return); forgets a self-pause", async () => {
    const db = join(fx.tmp.dir, "state", "hub.db");
    const first = await start(db);
    await serve(first.base, first.relayUrl, "phone", "alice", [0, 4]);
    await serve(first.base, first.relayUrl, "tablet", "alice", [4, 8]);
    const p = await request(first.base, "/api/workers/phone/pause", admin, { reason: "maintenance" });
    expect(p.status).toBe(200);
    const at = p.body.hub.at as number;
    expect(p.body).toEqual({
      worker: "phone",
      paused: true,
      hub: { at, by: "operator", reason: "maintenance" },
    });
    // the tablet pauses itself (its battery)
    const self = await request(first.base, "/api/workers/tablet/pause", workerToken("tablet", "alice"), {
      self: true,
      reason: "battery",
    });
    expect(self.body).toMatchObject({ paused: true, self: { reason: "battery" } });
    expect(await placed(first.base)).toEqual([]);
    await fx.closePeers();
    await first.hub.close();

    const second = await start(db);
    // before any worker is back: the operator's pause is there, as it was set; the self-pause is not
    const state = await request(second.base, "/api/workers/phone/pause", admin, undefined, "GET");
    // offline now: when the hub last saw it (the book's time, kept in the store) and when the pause
    // lapses unless it returns (the default retention, 30 days from that sighting)
    const away = state.body.away;
    expect(away.lastSeen).toBeGreaterThanOrEqual(at);
    expect(state.body).toEqual({
      worker: "phone",
      paused: true,
      hub: { at, by: "operator", reason: "maintenance" },
      away: { lastSeen: away.lastSeen, listed: true, dropsAt: away.lastSeen + 30 * 86_400_000 },
    });
    expect((await request(second.base, "/api/workers/tablet/pause", admin, undefined, "GET")).body).toEqual({
      worker: "tablet",
      paused: false,
    });
    expect((await request(second.base, "/api/pauses", admin, undefined, "GET")).body).toEqual({
      pauses: [{ worker: "phone", paused: true, hub: { at, by: "operator", reason: "maintenance" }, away }],
    });
    // both come back on their leases (kept by the store too): the phone is told it is paused and
    // stays out of the placement; the tablet serves
    const notices: string[] = [];
    await connect(second.relayUrl, "phone", "alice", [0, 1, 2, 3], notices);
    await connect(second.relayUrl, "tablet", "alice", [4, 5, 6, 7], []);
    await waitFor(() => notices.length > 0, "the pause notice after the restart");
    expect(notices).toEqual(["MOESWARM_HUB_PAUSED: paused by the hub (operator): maintenance"]);
    await waitFor(async () => (await placed(second.base)).includes("tablet"), "the tablet registered again");
    await waitFor(
      () => second.hub.workers().find((w) => w.id === "phone")?.slices.length === 1,
      "the phone registered again",
    );
    expect(await placed(second.base)).toEqual(["tablet"]);
    const status = (await request(second.base, "/api/status", admin, undefined, "GET")).body;
    expect(status.workers.find((w: Body) => w.id === "phone").paused).toEqual({
      at,
      by: "operator",
      reason: "maintenance",
    });
    expect(status.workers.find((w: Body) => w.id === "tablet").paused).toBeUndefined();

    // its owner resumes it: the store forgets the pause too, so a third start lists it
    expect(
      (await request(second.base, "/api/workers/phone/resume", workerToken("laptop", "alice"))).body,
    ).toEqual({
      worker: "phone",
      paused: false,
    });
    await waitFor(async () => (await placed(second.base)).includes("phone"), "the phone listed again");
    await waitFor(() => notices.length > 1, "the resume notice");
    expect(notices[1]).toBe("MOESWARM_HUB_RESUMED: resumed by the hub (owner)");
    await fx.closePeers();
    await second.hub.close();

    const third = await start(db);
    expect((await request(third.base, "/api/pauses", admin, undefined, "GET")).body).toEqual({ pauses: [] });
  }, 60_000);

  it("keeps it on an embedder's own store object too (the pause table lives beside it, per store)", async () => {
    const store = createMemoryStore();
    const first = await start(store);
    await request(first.base, "/api/workers/w9/pause", workerToken("w9", "dana"), { reason: "mine" });
    await first.hub.close();
    const second = await start(store);
    expect((await request(second.base, "/api/workers/w9/pause", admin, undefined, "GET")).body).toMatchObject(
      {
        paused: true,
        hub: { by: "owner", reason: "mine" },
      },
    );
    // a fresh store knows nothing of it
    const other = await start(createMemoryStore());
    expect((await request(other.base, "/api/pauses", admin, undefined, "GET")).body).toEqual({ pauses: [] });
  });
});

describe("the pause table", () => {
  // node:sqlite exists from Node 22.5 only: the drivers that load here
  const drivers = SQLITE_DRIVERS.filter((d) => {
    try {
      d.load();
      return true;
    } catch (error) {
      console.warn(`the pause table is not checked on ${d.name} here: ${(error as Error).message}`);
      return false;
    }
  });

  it.each(drivers.map((d) => [d.name, d] as const))(
    "keeps, replaces and deletes pauses on %s",
    async (_name, driver) => {
      const path = join(fx.tmp.dir, `pauses-${driver.name.replace(/\W/g, "")}.db`);
      for (const round of [0, 1]) {
        const store = openSqliteStore(path, { drivers: [driver] });
        const pauses = openPauseStore(path, store);
        try {
          if (round === 0) {
            await pauses.put({ worker: "b", by: "owner", at: 2 });
            await pauses.put({ worker: "a", by: "owner", at: 1, reason: "first" });
            await pauses.put({ worker: "a", by: "operator", at: 3, reason: "replaced" });
            await pauses.put({ worker: "c", by: "operator", at: 4 });
            expect(await pauses.delete("c")).toBe(true);
            expect(await pauses.delete("c")).toBe(false);
          } else {
            // opened again: what round 0 left
            expect(await pauses.list()).toEqual([
              { worker: "a", by: "operator", at: 3, reason: "replaced" },
              { worker: "b", by: "owner", at: 2 },
            ]);
          }
        } finally {
          await pauses.close();
          await store.close();
        }
      }
    },
  );
});

describe("the pause table of an earlier release", () => {
  it("gains the `seen` column and keeps its pauses", async () => {
    const path = join(fx.tmp.dir, "pauses-before-seen.db");
    const store = openSqliteStore(path);
    const db = loadSqliteDriver().open(path);
    db.exec(`CREATE TABLE worker_pauses (worker TEXT PRIMARY KEY, by TEXT NOT NULL, at INTEGER NOT NULL, reason TEXT);
             INSERT INTO worker_pauses VALUES ('old', 'operator', 5, 'kept')`);
    db.close();
    const pauses = openPauseStore(path, store);
    try {
      expect(await pauses.list()).toEqual([{ worker: "old", by: "operator", at: 5, reason: "kept" }]);
      await pauses.setSeen("old", 9);
      await pauses.setSeen("none", 9); // no pause: nothing
      await pauses.put({ worker: "old", by: "owner", at: 10 }); // a new pause keeps the sighting
      expect(await pauses.list()).toEqual([{ worker: "old", by: "owner", at: 10, seen: 9 }]);
    } finally {
      await pauses.close();
      await store.close();
    }
  });
});

describe("WorkerPauses and its store", () => {
  it("stores the hub's pause before it takes effect: a failed write pauses nothing, tells no one", async () => {
    const calls: string[] = [];
    let fail = false;
    const kept = new Map<string, unknown>();
    const store: PauseStore = {
      list: async () => [],
      put: async (p) => {
        if (fail) throw new HubError("MOESWARM_HUB_STORE", "storing a pause: disk full");
        kept.set(p.worker, p);
      },
      delete: async (w) => {
        if (fail) throw new HubError("MOESWARM_HUB_STORE", "deleting a pause: disk full");
        return kept.delete(w);
      },
      setSeen: async () => {},
      close: async () => {},
    };
    const pauses = new WorkerPauses({
      store,
      setPaused: (id, paused) => calls.push(`${paused ? "out" : "in"} ${id}`),
      notice: (id, code) => calls.push(`${code} ${id}`) > 0,
      clock: () => 1000,
      retentionMs: 1e9,
      seen: () => ({ live: true, lastSeen: 1000 }),
    });
    fail = true;
    await expect(pauses.pause("w", "operator", "x")).rejects.toMatchObject({ code: "MOESWARM_HUB_STORE" });
    expect(pauses.state("w")).toEqual({ worker: "w", paused: false });
    expect(calls).toEqual([]);
    // a worker's own pause is not stored: it holds even while the store fails
    expect((await pauses.pause("w", "self", "battery")).self).toEqual({ at: 1000, reason: "battery" });
    fail = false;
    await pauses.pause("w", "owner");
    expect(kept.get("w")).toEqual({ worker: "w", by: "owner", at: 1000 });
    fail = true;
    await expect(pauses.resume("w", "owner")).rejects.toMatchObject({ code: "MOESWARM_HUB_STORE" });
    expect(pauses.state("w").hub).toEqual({ at: 1000, by: "owner" });
    fail = false;
    // changes are made one at a time, in order: the store ends as memory does
    await Promise.all([
      pauses.pause("w", "operator", "a"),
      pauses.resume("w", "operator"),
      pauses.pause("w", "owner", "b"),
    ]);
    expect(pauses.state("w").hub).toEqual({ at: 1000, by: "owner", reason: "b" });
    expect(kept.get("w")).toEqual({ worker: "w", by: "owner", at: 1000, reason: "b" });
    expect(calls).toEqual([
      "out w",
      "out w",
      "MOESWARM_HUB_PAUSED w",
      "out w",
      "MOESWARM_HUB_PAUSED w",
      "out w",
      "MOESWARM_HUB_RESUMED w",
      "out w",
      "MOESWARM_HUB_PAUSED w",
    ]);
  });
});

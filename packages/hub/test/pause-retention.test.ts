// Pauses of workers the hub stopped seeing (issue 19): a pause outlives a hub restart, but not its
// worker. One that is not connected says when the hub last saw it and when its pause lapses; the
// hub keeps that sighting with the pause once it forgets the worker (after forgetWorkersAfterMs),
// so a restart still counts from it; past the operator's retention (pauseRetentionMs, counted
// from the later of the pause and the sighting) the pause is dropped, and a quarantine (the hub's
// revocation of an identity) drops it at once. Time is faked (vi.useFakeTimers): days pass in ms.
import { createHash } from "node:crypto";
import { join } from "node:path";
import { afterEach, describe, expect, it, vi } from "vitest";
import { createMemoryStore, type HubEvent, mintToken } from "../src/index.js";
import { openPauseStore, type PauseStore } from "../src/store-pauses.js";
import { type PauseDropReason, WorkerPauses } from "../src/worker-pause.js";
import { parsePrometheus, relayDispatch, sampleValue, waitFor } from "./hub-helpers.js";
import { type Body, http, ID, useHubs } from "./hub-http-fixture.js";

const SECRET = "hub-pause-retention-secret-0123456789";
const DAY = 86_400_000;
const T0 = Date.UTC(2026, 0, 10);

afterEach(() => {
  vi.useRealTimers();
});

/** WorkerPauses over a memory pause table, the worker book replaced by `book`. */
function pausesWith(book: Map<string, { live: boolean; lastSeen: number }>, retentionMs = 10 * DAY) {
  const store = openPauseStore(undefined, createMemoryStore());
  const dropped: PauseDropReason[] = [];
  const events: Array<Record<string, unknown>> = [];
  const out: string[] = [];
  const pauses = new WorkerPauses({
    store,
    setPaused: (id, paused) => {
      if (!paused) out.push(id);
    },
    notice: () => true,
    clock: Date.now,
    retentionMs,
    seen: (id) => book.get(id),
    emit: (e) => events.push(e),
    dropped: (why) => dropped.push(why),
  });
  return { pauses, store, dropped, events, out };
}

const storedWorkers = async (store: PauseStore) => (await store.list()).map((p) => p.worker);

describe("WorkerPauses: the retention of a pause whose worker is away", () => {
  it("drops a hub pause once its worker is unseen for the retention, from the later of pause and sighting; never while connected", async () => {
    vi.useFakeTimers({ now: T0 - 3 * DAY });
    const book = new Map([
      ["gone", { live: false, lastSeen: T0 - DAY }],
      ["live", { live: true, lastSeen: T0 - 50 * DAY }],
    ]);
    const { pauses, store, dropped, events, out } = pausesWith(book);
    await pauses.pause("gone", "operator", "broken fan");
    await pauses.pause("live", "owner");
    await pauses.pause("never", "operator"); // a worker the hub has not seen (the book lacks it)
    vi.setSystemTime(T0);
    // the sighting after the pause counts for "gone"; the pause itself for "never"
    expect(pauses.state("gone").away).toEqual({ lastSeen: T0 - DAY, listed: true, dropsAt: T0 + 9 * DAY });
    expect(pauses.state("never").away).toEqual({ listed: false, dropsAt: T0 + 7 * DAY });
    expect(pauses.state("live").away).toBeUndefined();
    expect(pauses.unlisted().map((p) => p.worker)).toEqual(["never"]);

    vi.setSystemTime(T0 + 7 * DAY - 1);
    expect(await pauses.sweep()).toBe(0);
    vi.setSystemTime(T0 + 7 * DAY);
    expect(await pauses.sweep()).toBe(1);
    expect(pauses.state("never")).toEqual({ worker: "never", paused: false });
    expect(await storedWorkers(store)).toEqual(["gone", "live"]);
    vi.setSystemTime(T0 + 9 * DAY);
    expect(await pauses.sweep()).toBe(1);
    vi.setSystemTime(T0 + 400 * DAY);
    expect(await pauses.sweep()).toBe(0);
    expect(pauses.list().map((p) => p.worker)).toEqual(["live"]);
    expect(await storedWorkers(store)).toEqual(["live"]);
    expect(dropped).toEqual(["retention", "retention"]);
    expect(out).toEqual(["never", "gone"]);
    expect(events.slice(-2)).toEqual([
      { worker: "never", paused: false, by: "operator", dropped: "retention" },
      { worker: "gone", paused: false, by: "operator", dropped: "retention" },
    ]);
  });

  it("lets a worker's own pause lapse the same way (it is kept in memory only)", async () => {
    vi.useFakeTimers({ now: T0 });
    const book = new Map([["phone", { live: false, lastSeen: T0 - 2 * DAY }]]);
    const { pauses, store, events } = pausesWith(book, 5 * DAY);
    await pauses.pause("phone", "self", "battery");
    expect(await store.list()).toEqual([]);
    expect(pauses.state("phone").away?.dropsAt).toBe(T0 + 5 * DAY);
    vi.setSystemTime(T0 + 5 * DAY - 1);
    expect(await pauses.sweep()).toBe(0);
    vi.setSystemTime(T0 + 5 * DAY);
    expect(await pauses.sweep()).toBe(1);
    expect(pauses.isPaused("phone")).toBe(false);
    expect(events.at(-1)).toEqual({ worker: "phone", paused: false, by: "self", dropped: "retention" });
  });

  it("drops both pauses at once when the worker's identity is revoked (a quarantine)", async () => {
    vi.useFakeTimers({ now: T0 });
    const book = new Map([["liar", { live: true, lastSeen: T0 }]]);
    const { pauses, store, dropped, events } = pausesWith(book);
    await pauses.pause("liar", "owner", "mine");
    await pauses.pause("liar", "self", "hot");
    expect(await pauses.revoke("liar")).toBe(2);
    expect(pauses.state("liar")).toEqual({ worker: "liar", paused: false });
    expect(await store.list()).toEqual([]);
    expect(dropped).toEqual(["revoked", "revoked"]);
    expect(events.slice(-2)).toEqual([
      { worker: "liar", paused: true, by: "owner", dropped: "revoked" },
      { worker: "liar", paused: false, by: "self", dropped: "revoked" },
    ]);
    expect(await pauses.revoke("liar")).toBe(0);
  });

  it("keeps the last sighting of a worker forgotten before the pauses load (the book loads first) in the store", async () => {
    vi.useFakeTimers({ now: T0 });
    const hubStore = createMemoryStore();
    const table = openPauseStore(undefined, hubStore);
    await table.put({ worker: "phone", by: "operator", at: T0 - 20 * DAY });
    const { pauses } = pausesWith(new Map());
    const loaded = new WorkerPauses({
      store: table,
      setPaused: () => {},
      notice: () => true,
      clock: Date.now,
      retentionMs: 10 * DAY,
      seen: () => undefined,
    });
    await loaded.forgotten([
      { id: "phone", lastSeen: T0 - 8 * DAY },
      { id: "unpaused", lastSeen: T0 - 9 * DAY },
    ]);
    await loaded.load();
    expect(await table.list()).toEqual([
      { worker: "phone", by: "operator", at: T0 - 20 * DAY, seen: T0 - 8 * DAY },
    ]);
    // counted from the sighting, not from the pause 20 days ago: 2 days left
    expect(loaded.state("phone").away).toEqual({
      lastSeen: T0 - 8 * DAY,
      listed: false,
      dropsAt: T0 + 2 * DAY,
    });
    expect(await loaded.sweep()).toBe(0);
    // a re-pause keeps the sighting; a later forget updates it
    await loaded.pause("phone", "owner", "again");
    await loaded.forgotten([{ id: "phone", lastSeen: T0 - DAY }]);
    expect((await table.list())[0]).toMatchObject({ by: "owner", at: T0, seen: T0 - DAY });
    expect(pauses.list()).toEqual([]);
  });
});

describe("a hub's pauses of workers it stopped seeing", () => {
  const fx = useHubs(SECRET);
  afterEach(() => fx.closeAll());
  // tokens that outlive the days the tests skip
  const long = (role: "worker" | "backbone" | "admin", id?: string) =>
    mintToken({ role, ...(id ? { id } : {}), ttlS: 400 * 86_400 }, SECRET);

  it("shows a forgotten worker's pause with its last sighting, keeps it across a restart, drops it at the retention", async () => {
    vi.useFakeTimers({ toFake: ["Date"], shouldAdvanceTime: true, now: T0 });
    const db = join(fx.tmp.dir, "retention.db");
    const events: HubEvent[] = [];
    const options = {
      store: db,
      requireLeases: false,
      persistIntervalMs: 20,
      pauseRetentionMs: 10 * DAY,
      onEvent: (e: HubEvent) => events.push(e),
    };
    const admin = long("admin");
    const first = await fx.start(options);
    const phone = await fx.peer(first.relayUrl, "worker", "phone", long("worker", "phone"));
    phone.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(() => first.hub.workers().some((w) => w.id === "phone" && w.live), "the phone live");
    expect((await http(first.base, "/api/workers/phone/pause", { reason: "repair" }, admin)).status).toBe(
      200,
    );
    await phone.close();
    await waitFor(() => first.hub.workers().some((w) => w.id === "phone" && !w.live), "the phone gone");
    const lastSeen = first.hub.workers().find((w) => w.id === "phone")?.lastSeen as number;

    // 8 days on, the hub forgets the worker (7 days by default): its pause stays, shown apart
    vi.setSystemTime(lastSeen + 8 * DAY);
    await waitFor(() => first.hub.workers().length === 0, "the phone forgotten");
    const away = { lastSeen, listed: false, dropsAt: lastSeen + 10 * DAY };
    const listed = (await http(first.base, "/api/pauses", undefined, admin)).body;
    expect(listed.pauses).toEqual([
      {
        worker: "phone",
        paused: true,
        hub: { at: expect.any(Number), by: "operator", reason: "repair" },
        away,
      },
    ]);
    expect((await http(first.base, "/api/status", undefined, admin)).body.unlistedPauses).toEqual(
      listed.pauses,
    );
    const metrics = async (base: string) =>
      parsePrometheus(
        await (await fetch(`${base}/metrics`, { headers: { authorization: `Bearer ${admin}` } })).text(),
      ).samples;
    expect(sampleValue(await metrics(first.base), "moeswarm_hub_pauses_unlisted")).toBe(1);
    await fx.closeAll();

    // a restart: the worker is not in the store's worker table any more, its sighting is with the pause
    const second = await fx.start(options);
    expect((await http(second.base, "/api/pauses", undefined, admin)).body).toEqual(listed);
    // a minute short of the retention (the faked clock still runs, as the hub's timers need):
    // several sweeps (every 20 ms) keep it
    vi.setSystemTime(lastSeen + 10 * DAY - 60_000);
    await new Promise((r) => setTimeout(r, 100));
    expect((await http(second.base, "/api/pauses", undefined, admin)).body.pauses).toHaveLength(1);
    vi.setSystemTime(lastSeen + 10 * DAY);
    await waitFor(
      async () => (await http(second.base, "/api/pauses", undefined, admin)).body.pauses.length === 0,
      "the pause dropped",
    );
    expect(events).toContainEqual({
      type: "pause",
      worker: "phone",
      paused: false,
      by: "operator",
      dropped: "retention",
    });
    const after = await metrics(second.base);
    expect(sampleValue(after, "moeswarm_hub_pauses_dropped_total", { reason: "retention" })).toBe(1);
    expect(sampleValue(after, "moeswarm_hub_pauses_unlisted")).toBe(0);
    await fx.closeAll();
    const third = await fx.start(options);
    expect((await http(third.base, "/api/pauses", undefined, admin)).body).toEqual({ pauses: [] });
  }, 30_000);

  it("drops a worker's pause when a quarantine revokes its identity", async () => {
    const events: HubEvent[] = [];
    const { base, relayUrl } = await fx.start({ requireLeases: false, onEvent: (e) => events.push(e) });
    const liar = await fx.peer(relayUrl, "worker", "liar");
    liar.register({ model: ID, layers: [0], experts: [0, 1] });
    const bb = await fx.peer(relayUrl, "backbone", "bb");
    await waitFor(
      async () => ((await http(base, `/api/models/${ID}/placement`)).body.registrations as Body[]).length > 0,
      "liar registered",
    );
    await relayDispatch(bb, "liar", ID, 0, Int32Array.from([0, 1]), 2).catch(() => undefined);
    const admin = fx.token("admin");
    expect((await http(base, "/api/workers/liar/pause", { reason: "odd" }, admin)).body.paused).toBe(true);
    const filed = await http(
      base,
      `/api/models/${ID}/reports/quarantine`,
      {
        worker: "liar",
        layer: 0,
        reason: "scaled outputs",
        requestDigest: createHash("sha256").update("dispatch payload").digest("hex"),
        expected: { norm: 1.5, cosine: 1 },
        got: { norm: 1.575, cosine: 0.999 },
        at: Date.now(),
      },
      fx.token("backbone", "bb"),
    );
    expect(filed.status).toBe(201);
    expect((await http(base, "/api/pauses", undefined, admin)).body).toEqual({ pauses: [] });
    expect(events).toContainEqual({
      type: "pause",
      worker: "liar",
      paused: false,
      by: "operator",
      dropped: "revoked",
    });
  });
});

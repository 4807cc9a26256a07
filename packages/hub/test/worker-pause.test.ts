// Pausing a worker (issue 19): its owner or the operator pauses it through the hub, or it pauses
// itself (battery, heat). While paused the placement leaves it out, its leases and coverage stay,
// and the relay tells it (a connection-level notice). Another owner may never pause it. A real
// hub on loopback, workers speaking HTTP and the relay with tokens that name their owner.
import { describe, expect, it } from "vitest";
import { mintToken } from "../src/index.js";
import { waitFor } from "./hub-helpers.js";
import { cap, EXAMPLE, MiB, market, T0 } from "./market-fixtures.js";
import { type Body, ID, usePauseHubs } from "./pause-fixture.js";

const SECRET = "hub-worker-pause-secret-0123456789";

const fx = usePauseHubs(SECRET, "moeswarm-hub-worker-pause-");
const { admin, workerToken, request, placed, serve } = fx;
const start = () => fx.start();
const backbone = mintToken({ role: "backbone", id: "bb", ttlS: 600 }, SECRET);

const pause = (base: string, id: string, auth: string, body?: unknown) =>
  request(base, `/api/workers/${id}/pause`, auth, body);
const resume = (base: string, id: string, auth: string, body?: unknown) =>
  request(base, `/api/workers/${id}/resume`, auth, body);

describe("pausing a worker through the hub", () => {
  it("its owner pauses it: out of placement, told by the relay, leases and coverage kept; resume lists it again", async () => {
    const { base, relayUrl, hub, events } = await start();
    const notices: string[] = [];
    await serve(base, relayUrl, "phone", "alice", [0, 4], notices);
    await serve(base, relayUrl, "other", "bob", [4, 8]);
    const serving = hub.market.servingLeases({ worker: "phone" }).map((l) => l.id);
    expect(serving).toHaveLength(1);
    const covered = hub.market.coverage(ID, Date.now()).replicas[0]?.slice(0, 4);

    // alice's laptop (another worker of hers) pauses her phone
    const p = await pause(base, "phone", workerToken("laptop", "alice"), { reason: "I need the phone" });
    expect(p.status).toBe(200);
    expect(p.body).toMatchObject({
      worker: "phone",
      paused: true,
      hub: { by: "owner", reason: "I need the phone" },
    });
    expect(p.body.self).toBeUndefined();
    expect(await placed(base)).toEqual(["other"]);
    await waitFor(() => notices.length > 0, "the pause notice");
    expect(notices).toEqual(["MOESWARM_HUB_PAUSED: paused by the hub (owner): I need the phone"]);
    // a pause is not a departure: the registration's lease and its coverage stay
    expect(hub.market.servingLeases({ worker: "phone" }).map((l) => l.id)).toEqual(serving);
    expect(hub.market.coverage(ID, Date.now()).replicas[0]?.slice(0, 4)).toEqual(covered);
    const listed = (await request(base, "/api/workers", admin, undefined, "GET")).body.workers;
    expect(listed.find((w: Body) => w.id === "phone").paused).toMatchObject({ hub: { by: "owner" } });
    expect(listed.find((w: Body) => w.id === "other").paused).toBeUndefined();
    const state = await request(base, "/api/workers/phone/pause", admin, undefined, "GET");
    expect(state.body).toMatchObject({ worker: "phone", paused: true, hub: { by: "owner" } });

    // the operator pauses it too: one hub pause, now the operator's, and the worker is told;
    // the same pause again changes nothing
    await pause(base, "phone", admin, { reason: "maintenance" });
    await pause(base, "phone", admin, { reason: "maintenance" });
    await waitFor(() => notices.length > 1, "the operator's notice");
    // the phone's own token resumes it (it is the owner's too)
    const r = await resume(base, "phone", workerToken("phone", "alice"));
    expect(r.body).toEqual({ worker: "phone", paused: false });
    expect(await placed(base)).toEqual(["other", "phone"]);
    await waitFor(() => notices.length > 2, "the resume notice");
    expect(notices.slice(1)).toEqual([
      "MOESWARM_HUB_PAUSED: paused by the hub (operator): maintenance",
      "MOESWARM_HUB_RESUMED: resumed by the hub (owner)",
    ]);
    expect(events.filter((e) => e.type === "pause")).toMatchObject([
      { worker: "phone", paused: true, by: "owner", reason: "I need the phone" },
      { worker: "phone", paused: true, by: "operator", reason: "maintenance" },
      { worker: "phone", paused: false, by: "owner" },
    ]);
  });

  it("the operator pauses any worker; a worker that connects while paused is told at once", async () => {
    const { base, relayUrl } = await start();
    const first: string[] = [];
    const c = await serve(base, relayUrl, "w1", "carol", [0, 8], first);
    const p = await pause(base, "w1", admin, { reason: "maintenance" });
    expect(p.body).toMatchObject({ paused: true, hub: { by: "operator", reason: "maintenance" } });
    expect(await placed(base)).toEqual([]);
    await c.close();
    // it comes back (a new connection replays its registration): still paused, and told so
    const again: string[] = [];
    await fx.connect(relayUrl, "w1", "carol", [0, 1, 2, 3, 4, 5, 6, 7], again);
    await waitFor(() => again.length > 0, "the pause notice on reconnect");
    expect(again).toEqual(["MOESWARM_HUB_PAUSED: paused by the hub (operator): maintenance"]);
    await waitFor(
      async () =>
        (await request(base, "/api/workers", admin, undefined, "GET")).body.workers[0]?.slices.length === 1,
      "w1 registered again",
    );
    expect(await placed(base)).toEqual([]);
    expect((await resume(base, "w1", admin)).body).toEqual({ worker: "w1", paused: false });
    expect(await placed(base)).toEqual(["w1"]);
  });

  it("refuses another owner's token (MOESWARM_HUB_NOT_OWNER), a backbone's and none", async () => {
    const { base, relayUrl } = await start();
    await serve(base, relayUrl, "phone", "alice", [0, 8]);
    const mallory = await pause(base, "phone", workerToken("m1", "mallory"));
    expect(mallory.status).toBe(403);
    expect(mallory.body.error).toMatchObject({
      code: "MOESWARM_HUB_NOT_OWNER",
      details: { worker: "phone" },
    });
    // a token without an owner claim is its own principal: not alice
    expect((await pause(base, "phone", workerToken("stranger"))).body.error.code).toBe(
      "MOESWARM_HUB_NOT_OWNER",
    );
    // an owner may not pose as the worker itself
    const posing = await pause(base, "phone", workerToken("laptop", "alice"), { self: true });
    expect(posing.body.error.code).toBe("MOESWARM_HUB_NOT_OWNER");
    expect((await resume(base, "phone", workerToken("m1", "mallory"))).status).toBe(403);
    expect((await pause(base, "phone", backbone)).body.error.code).toBe("MOESWARM_AUTH_ROLE");
    expect((await pause(base, "phone", "")).status).toBe(401);
    expect((await pause(base, "phone", admin, { reason: 3 })).body.error.code).toBe(
      "MOESWARM_HUB_BAD_REQUEST",
    );
    // nothing was paused by any of those
    expect(await placed(base)).toEqual(["phone"]);
    expect((await request(base, "/api/workers/phone/pause", admin, undefined, "GET")).body).toEqual({
      worker: "phone",
      paused: false,
    });
  });

  it("keeps the worker's own pause apart from the hub's: one side's resume never lifts the other's", async () => {
    const { base, relayUrl } = await start();
    const notices: string[] = [];
    await serve(base, relayUrl, "phone", "alice", [0, 8], notices);
    const own = workerToken("phone", "alice");
    const self = await pause(base, "phone", own, { self: true, reason: "battery" });
    expect(self.body).toMatchObject({ paused: true, self: { reason: "battery" } });
    expect(self.body.hub).toBeUndefined();
    expect(await placed(base)).toEqual([]);
    await pause(base, "phone", admin);
    // the operator's resume leaves the battery pause in force
    expect((await resume(base, "phone", admin)).body).toMatchObject({
      paused: true,
      self: { reason: "battery" },
    });
    expect(await placed(base)).toEqual([]);
    await pause(base, "phone", admin);
    // the phone recovers: its own pause ends, the operator's stays
    expect((await resume(base, "phone", own, { self: true })).body).toMatchObject({
      paused: true,
      hub: { by: "operator" },
    });
    expect(await placed(base)).toEqual([]);
    await resume(base, "phone", admin);
    expect(await placed(base)).toEqual(["phone"]);
    // the worker is told of the hub's pauses only (it knows its own)
    await waitFor(() => notices.length === 4, "four notices");
    expect(notices.map((n) => n.split(":")[0])).toEqual([
      "MOESWARM_HUB_PAUSED",
      "MOESWARM_HUB_RESUMED",
      "MOESWARM_HUB_PAUSED",
      "MOESWARM_HUB_RESUMED",
    ]);
  });
});

describe("CoverageMarket.setPaused", () => {
  it("leaves a paused worker out of the placement only: coverage, leases and demand stay; a new version each way", () => {
    const m = market();
    m.addModel(EXAMPLE, T0);
    for (const [w, experts] of [
      ["a", { start: 0, end: 2 }],
      ["b", { start: 2, end: 4 }],
    ] as const) {
      m.claim({ worker: w, model: "ex", layers: { start: 0, end: 1 }, experts, capacity: cap(4 * MiB) }, T0);
      m.register(w, "ex", [0], [experts.start, experts.start + 1], T0);
    }
    const v0 = m.version("ex");
    const coverage = m.coverage("ex", T0);
    const demand = m.demand(T0);
    expect(m.setPaused("a", true, T0 + 1)).toBe(true);
    expect(m.setPaused("a", true, T0 + 2)).toBe(false); // already paused: nothing changes
    expect(m.isPaused("a")).toBe(true);
    const p = m.placement("ex");
    expect(p.version).toBeGreaterThan(v0);
    expect(p.registrations.map((r) => r.id)).toEqual(["b"]);
    expect(p.missing).toEqual([{ layer: 0, experts: "0:2", count: 2 }]);
    expect(m.coverage("ex", T0)).toEqual(coverage);
    expect(m.demand(T0)).toEqual(demand);
    expect(m.servingLeases({ worker: "a" })).toHaveLength(1);
    expect(m.serves("a", "ex")).toBe(true);
    const v1 = p.version;
    expect(m.setPaused("a", false, T0 + 3)).toBe(true);
    expect(m.placement("ex").version).toBeGreaterThan(v1);
    expect(m.placement("ex").registrations.map((r) => r.id)).toEqual(["a", "b"]);
    // a pause set before the worker registers holds when it does
    m.setPaused("c", true, T0 + 4);
    // (the market takes any register; on a hub the relay admits only a leased slice)
    m.register("c", "ex", [0], [0, 1, 2, 3], T0 + 4);
    expect(m.placement("ex").registrations.map((r) => r.id)).toEqual(["a", "b"]);
  });
});

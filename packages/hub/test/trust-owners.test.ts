// One owner's second copy is no replica (issue 14): the coverage market counts replicas by
// distinct principals, so it must not lease a cell to a worker whose owner already holds it
// through another worker (that worker would download a copy that adds nothing). A real hub on
// loopback, workers speaking HTTP and the relay with tokens that name their owner. Also the
// per-address limit on enrolment tries (codes are guessed only by trying).
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { createHub, type HubOptions } from "../src/index.js";
import { call, json, waitFor } from "./hub-helpers.js";
import { type Body, http, ID, useHubs } from "./hub-http-fixture.js";

const SECRET = "hub-trust-owners-secret-0123456789";
const T0 = 1_700_000_000_000;

const fx = useHubs(SECRET, { clock: () => T0, market: { leaseTtlMs: 60_000 } });
const worker = (id: string, owner?: string) => fx.token("worker", id, owner);
const capacity = { ramBytes: 1 << 30 };

const start = (store?: string) => fx.start(store ? { store } : {});

const claim = (base: string, id: string, tok: string, experts = "0:8") =>
  http(base, "/api/claims", { worker: id, model: ID, layers: "0:1", experts, capacity }, tok);

describe("a second copy held by the same owner is not a replica", () => {
  it("refuses a claim on cells another worker of the owner has leased or registered (reason owner)", async () => {
    const { base, relayUrl } = await start();
    const m1 = await claim(base, "m1", worker("m1", "mallory"));
    expect(m1.status).toBe(201);
    // leased (not yet registered) by m1: m2 of the same owner is refused, with the cells
    const leased = await claim(base, "m2", worker("m2", "mallory"), "4:8");
    expect(leased.status).toBe(409);
    expect(leased.body.error).toMatchObject({
      code: "MOESWARM_HUB_CONFLICT",
      details: { reason: "owner", cells: [{ layer: 0, experts: "4:8" }] },
    });
    expect(leased.body.error.message).toMatch(/owner "mallory".*not a replica/);
    // m1 registers what it leased: still refused (now held, no longer pending)
    const c = await fx.peer(relayUrl, "worker", "m1", worker("m1", "mallory"));
    c.register({ model: ID, layers: [0], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
    await waitFor(async () => {
      const p = await call(`${base}/api/models/${ID}/placement`);
      return (json(p) as Body).registrations.some((r: Body) => r.id === "m1");
    }, "m1 registered");
    const held = await claim(base, "m2", worker("m2", "mallory"));
    expect(held.body.error?.details?.reason).toBe("owner");
    // the cell is still in demand (one replica of two): another owner gets it
    expect((await claim(base, "bob", worker("bob"))).status).toBe(201);
    // a third owner is refused only because the target (two) is reached: m1's copy and bob's lease
    expect((await claim(base, "carol", worker("carol", "carol"))).body.error?.details?.reason).toBe("leased");
  });

  it("keeps a lease's owner across a hub restart (SQLite): the owner's other worker is still refused", async () => {
    const db = join(fx.tmp.dir, "owners.db");
    const first = await start(db);
    expect((await claim(first.base, "m1", worker("m1", "mallory"))).status).toBe(201);
    await first.hub.close();
    // m1 never registered: only its lease (now read back from the file) says whose the cells are
    const { base } = await start(db);
    const again = await claim(base, "m2", worker("m2", "mallory"), "4:8");
    expect(again.status).toBe(409);
    expect(again.body.error).toMatchObject({
      code: "MOESWARM_HUB_CONFLICT",
      details: { reason: "owner", cells: [{ layer: 0, experts: "4:8" }] },
    });
    // a stranger still gets the cells' second copy
    expect((await claim(base, "bob", worker("bob"), "4:8")).status).toBe(201);
  });

  it("GET /api/demand as a worker leaves out what it and its owner's other workers hold", async () => {
    const { base } = await start();
    expect((await claim(base, "m1", worker("m1", "mallory"))).status).toBe(201);
    // layer 0's cells as each reader sees them in demand (tiny: two MoE layers of 8 experts)
    const layer0 = async (tok?: string) => {
      const a = await call(
        `${base}/api/demand?model=${ID}`,
        tok ? { headers: { authorization: `Bearer ${tok}` } } : {},
      );
      expect(a.status).toBe(200);
      return (json(a) as Body).ranges.filter((r: Body) => r.layer === 0).map((r: Body) => r.experts);
    };
    // anyone, and another owner: m1's lease is one replica of the two wanted
    expect(await layer0()).toEqual(["0:8"]);
    expect(await layer0(worker("bob"))).toEqual(["0:8"]);
    // m1 itself holds them; m2 of the same owner would only be refused them (reason owner)
    expect(await layer0(worker("m1", "mallory"))).toEqual([]);
    expect(await layer0(worker("m2", "mallory"))).toEqual([]);
    // layer 1 is still in m2's demand, and a token that does not verify reads as anyone
    const m2 = await call(`${base}/api/demand?model=${ID}`, {
      headers: { authorization: `Bearer ${worker("m2", "mallory")}` },
    });
    expect((json(m2) as Body).ranges.map((r: Body) => `${r.layer}/${r.experts}`)).toEqual(["1/0:8"]);
    expect(await layer0("not-a-token")).toEqual(["0:8"]);
  });

  it("leaves the owner's cells out of an auto-claim's choice", async () => {
    const { base } = await start();
    // tiny has two MoE layers (0, 1) of 8 experts. m1 holds layer 0: m2 of the same owner takes
    // layer 1 only, though its capacity fits both (a stranger would take 0:2 whole)
    const auto = (id: string, owner?: string) =>
      http(base, "/api/claims/auto", { worker: id, capacity }, worker(id, owner));
    expect((await claim(base, "m1", worker("m1", "mallory"))).status).toBe(201);
    const m2 = await auto("m2", "mallory");
    expect(m2.status, JSON.stringify(m2.body)).toBe(201);
    expect(m2.body).toMatchObject({ layers: "1:2", experts: "0:8" });
    // mallory now holds both layers: m3 is refused with the reason, though both are still in demand
    const m3 = await auto("m3", "mallory");
    expect(m3.body.error).toMatchObject({ code: "MOESWARM_HUB_CONFLICT", details: { reason: "owner" } });
    // another owner takes both layers' second copy
    const bob = await auto("bob");
    expect(bob.body).toMatchObject({ layers: "0:2", experts: "0:8" });
  });
});

/** A hub on loopback that trusts loopback as its proxy (X-Forwarded-For names the client), and one enrolment try. */
async function enrolHub(clock: () => number, enrolment?: HubOptions["enrolment"]) {
  const { base } = await fx.start({ clock, trustProxy: ["127.0.0.1"], ...(enrolment ? { enrolment } : {}) });
  return async (from: string) => {
    const a = await call(`${base}/api/enrol`, {
      method: "POST",
      headers: { "content-type": "application/json", "x-forwarded-for": from },
      body: JSON.stringify({ code: "not-a-code" }),
    });
    const error = (json(a) as Body).error;
    return { status: a.status, code: error?.code as string, details: error?.details as Body | undefined };
  };
}

describe("POST /api/enrol: tries are rate-limited per address", () => {
  it("answers 429 MOESWARM_HUB_ENROL_RATE past the burst, per client address, and refills with time", async () => {
    let now = T0;
    const attempt = await enrolHub(() => now);
    const tryCode = async (from: string) => {
      const { status, code } = await attempt(from);
      return { status, code };
    };
    const statuses: number[] = [];
    for (let i = 0; i < 11; i++) statuses.push((await tryCode("203.0.113.7")).status);
    // ten guesses answered (wrong code), the eleventh refused before the code is looked at
    expect(statuses).toEqual([...new Array(10).fill(403), 429]);
    expect(await tryCode("203.0.113.7")).toEqual({ status: 429, code: "MOESWARM_HUB_ENROL_RATE" });
    // another address has its own budget
    expect(await tryCode("198.51.100.9")).toEqual({ status: 403, code: "MOESWARM_HUB_ENROL_INVALID" });
    // 10 a minute: after 6 s the first address may try once more, then not
    now += 6_000;
    expect((await tryCode("203.0.113.7")).status).toBe(403);
    expect((await tryCode("203.0.113.7")).status).toBe(429);
  });

  it("takes its limits as options (enrolment.burst, enrolment.perMinute) and refuses bad ones", async () => {
    let now = T0;
    const tryCode = await enrolHub(() => now, { burst: 3, perMinute: 2 });
    const statuses: number[] = [];
    for (let i = 0; i < 4; i++) statuses.push((await tryCode("203.0.113.7")).status);
    expect(statuses).toEqual([403, 403, 403, 429]);
    expect((await tryCode("203.0.113.7")).details).toEqual({ burst: 3, perMinute: 2, retryAfterMs: 30_000 });
    // 2 a minute: one more try after 30 s, not after 29
    now += 29_000;
    expect((await tryCode("203.0.113.7")).status).toBe(429);
    now += 1_000;
    expect((await tryCode("203.0.113.7")).status).toBe(403);
    expect((await tryCode("203.0.113.7")).status).toBe(429);
    for (const enrolment of [{ burst: 0 }, { perMinute: 1.5 }, { perMinute: -1 }]) {
      expect(() => createHub({ secret: SECRET, enrolment })).toThrow(
        expect.objectContaining({
          code: "MOESWARM_INVALID_ARGUMENT",
          message: expect.stringMatching(/enrolment\./),
        }),
      );
    }
  });
});

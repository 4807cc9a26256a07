// The hub's half of "identities that cannot be taken" (issue 14), attack by attack, with the
// hub's defaults: a real hub on loopback, fake workers and backbones speaking the protocol with
// @moeswarm/relay-client, the market's clock injected where time matters.
import { createHash } from "node:crypto";
import { mkdirSync, readFileSync } from "node:fs";
import type { RelayConnection, RelayEvent } from "@moeswarm/relay-client";
import { describe, expect, it } from "vitest";
import { createMemoryStore, type HubEvent } from "../src/index.js";
import { relayDispatch, waitFor } from "./hub-helpers.js";
import { type Body, http, ID, useHubs } from "./hub-http-fixture.js";

const SECRET = "hub-trust-secret-0123456789abcdef";
const T0 = 1_700_000_000_000;
const U32_MAX = 0xffff_ffff;

let now = T0;
const fx = useHubs(SECRET, { clock: () => now, market: { leaseTtlMs: 60_000 } });
const { start, token, peer, closeAll } = fx;
const capacity = { ramBytes: 1 << 30 };

/** The codes of the connection-level error frames a peer receives. */
function notices(c: RelayConnection): string[] {
  const codes: string[] = [];
  c.on((e: RelayEvent) => {
    if (e.type === "notice") codes.push(e.error.code);
  });
  return codes;
}

const placementIds = async (base: string) =>
  ((await http(base, `/api/models/${ID}/placement`)).body.registrations as Array<{ id: string }>).map(
    (r) => r.id,
  );

describe("the impersonator: identities bound to tokens", () => {
  it("refuses unbound worker and backbone tokens on hello and on writes, saying how to mint a bound one", async () => {
    const { base, relayUrl } = await start();
    for (const role of ["worker", "backbone"] as const) {
      const refused = await peer(relayUrl, role, `${role}-x`, token(role)).then(
        () => undefined,
        (e: { code: string; message: string }) => e,
      );
      expect(refused?.code).toBe("MOESWARM_AUTH_INVALID");
      expect(refused?.message).toMatch(/--id <id>.*--allow-unbound-tokens/);
    }
    const claim = await http(
      base,
      "/api/claims",
      { worker: "victim", model: ID, layers: "0:1", experts: "0:2", capacity },
      token("worker"),
    );
    expect([claim.status, claim.body.error.code]).toEqual([401, "MOESWARM_AUTH_INVALID"]);
    const stats = await http(base, `/api/models/${ID}/stats`, { counts: {} }, token("backbone"));
    expect([stats.status, stats.body.error.code]).toEqual([401, "MOESWARM_AUTH_INVALID"]);
    // an admin token is the operator's: it may act as anyone
    expect((await http(base, `/api/models/${ID}/stats`, { counts: {} }, token("admin"))).status).toBe(200);
  });

  it("keeps a victim's id: another token cannot say hello as it, and the victim stays connected", async () => {
    const { hub, relayUrl } = await start();
    const victim = await peer(relayUrl, "worker", "victim");
    // the thief's own bound token names another id; an unbound one is refused outright
    await expect(peer(relayUrl, "worker", "victim", token("worker", "thief"))).rejects.toMatchObject({
      code: "MOESWARM_AUTH_ROLE",
    });
    await expect(peer(relayUrl, "worker", "victim", token("worker"))).rejects.toMatchObject({
      code: "MOESWARM_AUTH_INVALID",
    });
    expect(victim.state).toBe("connected");
    expect(hub.relay.workers().map((w) => w.id)).toEqual(["victim"]);
  });

  it("accepts unbound tokens only when created with allowUnboundTokens (a private swarm)", async () => {
    const { base, relayUrl } = await start({ allowUnboundTokens: true });
    const w = await peer(relayUrl, "worker", "anyone", token("worker"));
    expect(w.state).toBe("connected");
    const claim = await http(
      base,
      "/api/claims",
      { worker: "anyone", model: ID, layers: "0:1", experts: "0:2", capacity },
      token("worker"),
    );
    expect(claim.status).toBe(201);
  });
});

describe("the unleased registrant: registration needs a lease", () => {
  it("refuses a slice no live lease covers (MOESWARM_HUB_NO_LEASE); it never enters placement", async () => {
    const { hub, base, relayUrl } = await start();
    const rogue = await peer(relayUrl, "worker", "rogue");
    const codes = notices(rogue);
    rogue.register({ model: ID, layers: [0, 1], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
    await waitFor(() => codes.includes("MOESWARM_HUB_NO_LEASE"), "the refusal");
    expect(rogue.state).toBe("connected");
    expect(hub.relay.workers().find((w) => w.id === "rogue")?.slices).toEqual([]);
    expect(await placementIds(base)).toEqual([]);
    // a lease of 0:1 x 0:2 covers that slice, not more
    const lease = await http(
      base,
      "/api/claims",
      { model: ID, layers: "0:1", experts: "0:2", capacity },
      token("worker", "rogue"),
    );
    expect(lease.status).toBe(201);
    rogue.register({ model: ID, layers: [0], experts: [0, 1, 2] });
    await waitFor(
      () => codes.filter((c) => c === "MOESWARM_HUB_NO_LEASE").length === 2,
      "the second refusal",
    );
    rogue.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(async () => (await placementIds(base)).includes("rogue"), "the leased slice in placement");
    expect(
      hub.relay
        .workers()
        .find((w) => w.id === "rogue")
        ?.slices.map((s) => s.experts),
    ).toEqual([[0, 1]]);
  });

  it("withdraws the registration when its lease is released, replaced or expires, and placement follows", async () => {
    const { hub, base, relayUrl } = await start();
    const w = await peer(relayUrl, "worker", "w1");
    const codes = notices(w);
    const wt = token("worker", "w1");
    // released
    const a = await http(base, "/api/claims", { model: ID, layers: "0:1", experts: "0:2", capacity }, wt);
    w.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(async () => (await placementIds(base)).includes("w1"), "registered");
    // the lease stays in service as the registration's title: its holder may still give it up
    const gone = await http(base, `/api/claims/${a.body.leaseId}`, undefined, wt, "DELETE");
    expect(gone.body).toEqual({ released: a.body.leaseId });
    await waitFor(async () => !(await placementIds(base)).includes("w1"), "withdrawn after the release");
    expect(codes).toContain("MOESWARM_HUB_NO_LEASE");
    expect(hub.market.coverage(ID, now).replicas[0]).toEqual([0, 0, 0, 0, 0, 0, 0, 0]);

    // replaced: a fresh start (replaceLeases) gives up the previous run's titles
    const b = await http(base, "/api/claims", { model: ID, layers: "1:2", experts: "0:2", capacity }, wt);
    expect(b.status).toBe(201);
    w.register({ model: ID, layers: [1], experts: [0, 1] });
    await waitFor(async () => (await placementIds(base)).includes("w1"), "registered again");
    const c = await http(
      base,
      "/api/claims",
      { model: ID, layers: "0:1", experts: "4:6", capacity, replaceLeases: true },
      wt,
    );
    expect(c.status).toBe(201);
    await waitFor(async () => !(await placementIds(base)).includes("w1"), "withdrawn after the replacement");

    // expired: a title lives while its worker serves; once the worker is gone it lasts one TTL
    w.register({ model: ID, layers: [0], experts: [4, 5] });
    await waitFor(async () => (await placementIds(base)).includes("w1"), "registered under c");
    now += 59_000;
    await http(base, "/api/demand"); // a sweep: the title of a live registration is extended
    now += 59_000;
    await http(base, "/api/demand");
    expect(await placementIds(base)).toContain("w1");
    await w.close();
    await waitFor(() => hub.relay.workers().length === 0, "w1 gone");
    const back = await peer(relayUrl, "worker", "w1");
    const backCodes = notices(back);
    back.register({ model: ID, layers: [0], experts: [4, 5] }); // a reconnect's replay: still covered
    await waitFor(async () => (await placementIds(base)).includes("w1"), "the replay accepted");
    await back.close();
    await waitFor(() => hub.relay.workers().length === 0, "w1 gone again");
    now += 60_001;
    await http(base, "/api/demand");
    const late = await peer(relayUrl, "worker", "w1");
    const lateCodes = notices(late);
    late.register({ model: ID, layers: [0], experts: [4, 5] });
    await waitFor(() => lateCodes.includes("MOESWARM_HUB_NO_LEASE"), "refused once the title expired");
    expect(backCodes).not.toContain("MOESWARM_HUB_NO_LEASE");
    expect(await placementIds(base)).toEqual([]);
  });

  it("a drain ends the titles: registering again takes a new claim", async () => {
    const { base, relayUrl } = await start();
    const w = await peer(relayUrl, "worker", "w2");
    const codes = notices(w);
    await http(
      base,
      "/api/claims",
      { model: ID, layers: "0:1", experts: "0:2", capacity },
      token("worker", "w2"),
    );
    w.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(async () => (await placementIds(base)).includes("w2"), "registered");
    const drained = await http(base, "/api/workers/w2/drain", {}, token("admin"));
    expect(drained.status).toBe(200);
    w.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(() => codes.includes("MOESWARM_HUB_NO_LEASE"), "refused after the drain");
    expect(await placementIds(base)).toEqual([]);
  });

  it("lets fake workers register freely only with requireLeases: false", async () => {
    const { base, relayUrl } = await start({ requireLeases: false });
    const w = await peer(relayUrl, "worker", "free");
    w.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(async () => (await placementIds(base)).includes("free"), "registered without a lease");
  });
});

describe("the lease thief: lease operations only by their holder", () => {
  it("refuses another worker's claim on the victim's behalf, its renewal and its release (403)", async () => {
    const { hub, base } = await start();
    const victim = token("worker", "victim");
    const thief = token("worker", "thief");
    const lease = await http(
      base,
      "/api/claims",
      { model: ID, layers: "1:2", experts: "0:4", capacity },
      victim,
    );
    expect(lease.status).toBe(201);
    const attack = {
      worker: "victim",
      model: ID,
      layers: "0:1",
      experts: "0:1",
      capacity,
      replaceLeases: true,
    };
    const cancel = await http(base, "/api/claims", attack, thief);
    expect([cancel.status, cancel.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    // the attack: any unbound worker token could claim for the victim and so cancel its leases
    const unbound = await http(base, "/api/claims", attack, token("worker"));
    expect([unbound.status, unbound.body.error.code]).toEqual([401, "MOESWARM_AUTH_INVALID"]);
    const unboundRelease = await http(
      base,
      `/api/claims/${lease.body.leaseId}`,
      undefined,
      token("worker"),
      "DELETE",
    );
    expect(unboundRelease.status).toBe(401);
    const renew = await http(base, `/api/claims/${lease.body.leaseId}/renew`, {}, thief);
    expect([renew.status, renew.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    const release = await http(base, `/api/claims/${lease.body.leaseId}`, undefined, thief, "DELETE");
    expect([release.status, release.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    expect(hub.market.leases().map((l) => [l.id, l.worker])).toEqual([[lease.body.leaseId, "victim"]]);
    // the operator may act for anyone
    const admin = await http(base, `/api/claims/${lease.body.leaseId}`, undefined, token("admin"), "DELETE");
    expect(admin.status).toBe(200);
  });
});

describe("the credit forger: stats only from authenticated backbones, bounded by what was routed", () => {
  it("credits five forged reports of 2^32-1 expert-tokens only with what the relay forwarded", async () => {
    const { hub, base, relayUrl } = await start({ requireLeases: false });
    await peer(relayUrl, "worker", "w5").then((w) =>
      w.register({ model: ID, layers: [0, 1], experts: [0, 1] }),
    );
    await waitFor(async () => (await placementIds(base)).includes("w5"), "w5 registered");
    const bb = await peer(relayUrl, "backbone", "bb");
    // 6 tokens x k=2 with one empty slot: 11 expert-token pairs, expert 1 chosen 5 times in layer 0
    await relayDispatch(bb, "w5", ID, 0, Int32Array.from([0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, -1]), 2).catch(
      () => undefined,
    );
    const forged = (seq: number, backbone?: string) => ({
      ...(backbone === undefined ? {} : { backbone }),
      seq,
      tokens: U32_MAX,
      ms: 1,
      counts: { "0": [U32_MAX, U32_MAX, U32_MAX, U32_MAX, U32_MAX, U32_MAX, U32_MAX, U32_MAX] },
      receipts: { w5: { expertTokens: U32_MAX } },
    });
    // under invented backbone ids: refused (the report's backbone is the token's)
    for (const name of ["bb-a", "bb-b"]) {
      const r = await http(base, `/api/models/${ID}/stats`, forged(1, name), token("backbone", "bb"));
      expect([r.status, r.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    }
    let credited = 0;
    let asked = 0;
    for (let seq = 1; seq <= 5; seq++) {
      const r = await http(base, `/api/models/${ID}/stats`, forged(seq), token("backbone", "bb"));
      expect(r.status).toBe(200);
      asked += U32_MAX;
      credited += r.body.creditedExpertTokens;
    }
    expect(asked).toBe(21_474_836_475);
    expect(credited).toBe(11);
    expect(hub.market.creditsOf("w5").expertTokens).toBe(11);
    // tokens are bounded by the rows relayed (6), the span by the time since the first forward
    const rates = hub.status().backbones;
    expect(rates).toHaveLength(1);
    expect(rates[0]!.tokensPerSecond).toBeLessThanOrEqual(6 / 0.001);
    // no expert becomes hot in a layer the relay carried nothing of beyond what it carried
    const grid = hub.market.coverage(ID, now);
    expect(grid.targets[1]).toEqual(new Array(8).fill(2));
    expect(Math.max(...grid.load[0]!)).toBeLessThan(8);
    // a sixth report, replayed under a new seq, finds nothing left to credit
    const again = await http(base, `/api/models/${ID}/stats`, forged(6), token("backbone", "bb"));
    expect([again.body.creditedExpertTokens, again.body.cut.expertTokens]).toEqual([0, U32_MAX]);
  });

  it("takes reports as they come only with trustReports (a trusted swarm)", async () => {
    const { hub, base, relayUrl } = await start({ requireLeases: false, trustReports: true });
    await peer(relayUrl, "worker", "w6").then((w) => w.register({ model: ID, layers: [0], experts: [0] }));
    await waitFor(() => hub.workers().some((w) => w.id === "w6"), "w6 known");
    const r = await http(
      base,
      `/api/models/${ID}/stats`,
      { counts: {}, receipts: { w6: { expertTokens: 1000 } } },
      token("backbone", "bb"),
    );
    expect([r.body.creditedExpertTokens, r.body.cut]).toEqual([
      1000,
      { expertTokens: 0, counts: 0, tokens: 0 },
    ]);
  });
});

describe("reputation at the hub: quarantine with evidence", () => {
  const digest = createHash("sha256").update("dispatch payload").digest("hex");
  const evidence = (worker: string) => ({
    worker,
    layer: 0,
    reason: "scaled outputs",
    requestDigest: digest,
    expected: { norm: 1.5, cosine: 1 },
    got: { norm: 1.575, cosine: 0.999 },
    at: T0,
  });

  it("excludes a reported worker for every backbone, refuses its id, survives a restart, until reinstated", async () => {
    const store = createMemoryStore();
    const events: HubEvent[] = [];
    const { hub, base, relayUrl } = await start({
      store,
      requireLeases: false,
      onEvent: (e) => events.push(e),
    });
    const liar = await peer(relayUrl, "worker", "liar");
    liar.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(async () => (await placementIds(base)).includes("liar"), "liar registered");
    const bb = await peer(relayUrl, "backbone", "bb");
    const path = `/api/models/${ID}/reports/quarantine`;
    // only about a worker this hub routed the backbone's requests to, with valid evidence
    const unseen = await http(base, path, evidence("liar"), token("backbone", "bb"));
    expect([unseen.status, unseen.body.error.code]).toEqual([403, "MOESWARM_AUTH_ROLE"]);
    await relayDispatch(bb, "liar", ID, 0, Int32Array.from([0, 1]), 2).catch(() => undefined);
    const bad = await http(base, path, { ...evidence("liar"), requestDigest: "zz" }, token("backbone", "bb"));
    expect([bad.status, bad.body.error.code]).toEqual([400, "MOESWARM_HUB_BAD_REQUEST"]);
    expect((await http(base, path, evidence("liar"), token("worker", "liar"))).status).toBe(403);
    const big = await http(
      base,
      path,
      { ...evidence("liar"), reason: "x".repeat(10_000) },
      token("backbone", "bb"),
    );
    expect(big.status).toBe(413);

    const filed = await http(base, path, evidence("liar"), token("backbone", "bb"));
    expect([filed.status, filed.body.quarantined]).toEqual([201, "liar"]);
    await waitFor(() => liar.state === "closed", "the liar cut off");
    expect(events).toContainEqual({
      type: "quarantine",
      worker: "liar",
      by: "bb",
      model: ID,
      reason: "scaled outputs",
    });
    expect(await placementIds(base)).toEqual([]);
    // the ban list a backbone seeds its own quarantine from at start
    expect((await http(base, "/api/quarantines")).body).toEqual({
      quarantined: [{ worker: "liar", at: now, by: "bb", model: ID, reason: "scaled outputs" }],
    });
    const listed = (await http(base, "/api/workers")).body.workers.find((w: Body) => w.id === "liar");
    expect(listed.quarantined).toMatchObject({ by: "bb", model: ID, reason: "scaled outputs" });
    expect(
      (await http(base, "/api/status")).body.workers.find((w: Body) => w.id === "liar").quarantined,
    ).toBe(true);
    await expect(peer(relayUrl, "worker", "liar")).rejects.toMatchObject({ code: "MOESWARM_HUB_BANNED" });
    const claim = await http(
      base,
      "/api/claims",
      { model: ID, layers: "0:1", experts: "0:2", capacity },
      token("worker", "liar"),
    );
    expect([claim.status, claim.body.error.code]).toEqual([403, "MOESWARM_HUB_BANNED"]);

    // a restart on the same store keeps the quarantine
    await hub.close();
    const second = await start({ store, requireLeases: false });
    await expect(peer(second.relayUrl, "worker", "liar")).rejects.toMatchObject({
      code: "MOESWARM_HUB_BANNED",
    });
    const reinstate = await http(second.base, "/api/workers/liar/reinstate", {}, token("backbone", "bb"));
    expect(reinstate.status).toBe(403);
    expect((await http(second.base, "/api/quarantines")).body.quarantined).toHaveLength(1);
    const ok = await http(second.base, "/api/workers/liar/reinstate", {}, token("admin"));
    expect(ok.body).toEqual({ worker: "liar", quarantined: false });
    expect((await http(second.base, "/api/quarantines")).body).toEqual({ quarantined: [] });
    expect((await http(second.base, "/api/workers/liar/reinstate", {}, token("admin"))).status).toBe(404);
    expect((await peer(second.relayUrl, "worker", "liar")).state).toBe("connected");
  });

  it("keeps quarantines in the SQLite file across a restart", async () => {
    const db = `${fx.tmp.dir}/trust.db`;
    const { base, relayUrl } = await start({ store: db, requireLeases: false });
    const w = await peer(relayUrl, "worker", "w-sql");
    w.register({ model: ID, layers: [0], experts: [0] });
    const bb = await peer(relayUrl, "backbone", "bb");
    await waitFor(async () => (await placementIds(base)).includes("w-sql"), "registered");
    await relayDispatch(bb, "w-sql", ID, 0, Int32Array.from([0]), 1).catch(() => undefined);
    const filed = await http(
      base,
      `/api/models/${ID}/reports/quarantine`,
      evidence("w-sql"),
      token("backbone", "bb"),
    );
    expect(filed.status).toBe(201);
    await closeAll();
    const second = await start({ store: db });
    expect(second.hub.workers().find((x) => x.id === "w-sql")?.quarantined?.by).toBe("bb");
    await expect(peer(second.relayUrl, "worker", "w-sql")).rejects.toMatchObject({
      code: "MOESWARM_HUB_BANNED",
    });
  });

  it("rate-limits a backbone's reports", async () => {
    const { base, relayUrl } = await start({ requireLeases: false });
    const bb = await peer(relayUrl, "backbone", "bb");
    const ids: string[] = [];
    for (let i = 0; i < 11; i++) {
      const id = `w${i}`;
      ids.push(id);
      const w = await peer(relayUrl, "worker", id);
      w.register({ model: ID, layers: [0], experts: [0] });
    }
    await waitFor(async () => (await placementIds(base)).length === 11, "eleven workers");
    for (const id of ids) await relayDispatch(bb, id, ID, 0, Int32Array.from([0]), 1).catch(() => undefined);
    const statuses: number[] = [];
    for (const id of ids) {
      statuses.push(
        (await http(base, `/api/models/${ID}/reports/quarantine`, evidence(id), token("backbone", "bb")))
          .status,
      );
    }
    expect(statuses).toEqual([...new Array(10).fill(201), 429]);
  });
});

describe("replicas: an expert counts as covered with two independent owners", () => {
  it("keeps a cell in demand until `replicas` distinct workers hold it (default 2; 1 restores one copy)", async () => {
    for (const [replicas, stillWanted] of [
      [undefined, true],
      [1, false],
    ] as const) {
      const { base, relayUrl } = await start({ requireLeases: false, ...(replicas ? { replicas } : {}) });
      const a = await peer(relayUrl, "worker", "a");
      a.register({ model: ID, layers: [0], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
      await waitFor(async () => (await placementIds(base)).includes("a"), "a registered");
      const demand = (await http(base, `/api/demand?model=${ID}`)).body;
      const layer0 = demand.ranges.filter((r: Body) => r.layer === 0);
      expect(layer0.length > 0, `replicas ${replicas}`).toBe(stillWanted);
      if (stillWanted) {
        expect(layer0[0]).toMatchObject({ target: 2, coverage: 1, missing: 1, hot: false });
        const b = await peer(relayUrl, "worker", "b");
        b.register({ model: ID, layers: [0], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
        await waitFor(async () => (await placementIds(base)).includes("b"), "b registered");
        const after = (await http(base, `/api/demand?model=${ID}`)).body;
        expect(after.ranges.filter((r: Body) => r.layer === 0)).toEqual([]);
        // placement lists both owners of every cell
        const owners = (await http(base, `/api/models/${ID}/placement`)).body.owners.filter(
          (o: Body) => o.layer === 0,
        );
        expect(owners).toEqual([{ layer: 0, experts: "0:8", workers: ["a", "b"] }]);
      }
      await closeAll();
    }
  });
});

describe("independence by principal: two ids of one owner are one replica", () => {
  it("counts replicas by distinct owners (token `own`) and puts the owner in the placement", async () => {
    const { base, relayUrl } = await start({ requireLeases: false });
    const mallory = (id: string) => token("worker", id, "mallory");
    const experts = [0, 1, 2, 3, 4, 5, 6, 7];
    const m1 = await peer(relayUrl, "worker", "m1", mallory("m1"));
    const m2 = await peer(relayUrl, "worker", "m2", mallory("m2"));
    m1.register({ model: ID, layers: [0], experts, backend: "ggml-cpu-x86_64" });
    m2.register({ model: ID, layers: [0], experts });
    await waitFor(async () => (await placementIds(base)).length === 2, "both registered");
    const placement = (await http(base, `/api/models/${ID}/placement`)).body;
    expect(placement.registrations.filter((r: Body) => r.layers.includes(0))).toEqual([
      { id: "m1", model: ID, layers: [0], experts, owner: "mallory", computeClass: "ggml-cpu-x86_64" },
      { id: "m2", model: ID, layers: [0], experts, owner: "mallory" },
    ]);
    // two workers, one principal: still one replica short of the default two
    const layer0 = (await http(base, `/api/demand?model=${ID}`)).body.ranges.filter(
      (r: Body) => r.layer === 0,
    );
    expect(layer0[0]).toMatchObject({ target: 2, coverage: 1, missing: 1 });
    // an owner of its own (default: its id) makes the second replica
    const b = await peer(relayUrl, "worker", "bob");
    b.register({ model: ID, layers: [0], experts });
    await waitFor(async () => (await placementIds(base)).includes("bob"), "bob registered");
    const after = (await http(base, `/api/demand?model=${ID}`)).body.ranges.filter(
      (r: Body) => r.layer === 0,
    );
    expect(after).toEqual([]);
    expect(
      (await http(base, `/api/models/${ID}/placement`)).body.registrations.find((r: Body) => r.id === "bob")
        .owner,
    ).toBe("bob");
    // one of mallory's leaving keeps her replica; both leaving ends it
    await m1.close();
    await waitFor(async () => !(await placementIds(base)).includes("m1"), "m1 gone");
    expect(
      (await http(base, `/api/demand?model=${ID}`)).body.ranges.filter((r: Body) => r.layer === 0),
    ).toEqual([]);
    await m2.close();
    await waitFor(async () => !(await placementIds(base)).includes("m2"), "m2 gone");
    const gone = (await http(base, `/api/demand?model=${ID}`)).body.ranges.filter((r: Body) => r.layer === 0);
    expect(gone[0]).toMatchObject({ coverage: 1, missing: 1 });
  });
});

describe("self-enrolment the operator allows", () => {
  const redeem = (base: string, code: unknown) => http(base, "/api/enrol", { code });

  it("trades a code for a bound token under its owner; refuses unknown, used-up and expired codes", async () => {
    const { base, relayUrl } = await start({ requireLeases: false });
    const refused = await http(base, "/api/enrol-codes", { owner: "alice" }, token("worker", "w"));
    expect(refused.status).toBe(403);
    const issued = await http(base, "/api/enrol-codes", { owner: "alice", uses: 2 }, token("admin"));
    expect(issued.status).toBe(201);
    expect(issued.body).toMatchObject({ owner: "alice", uses: 2 });
    const a = await redeem(base, issued.body.code);
    expect(a.status).toBe(201);
    expect(a.body.id).toMatch(/^alice-[0-9a-f]{8}$/);
    expect(a.body.owner).toBe("alice");
    // the token is bound to the fresh id and names the owner; it says hello as that id
    const c = await peer(relayUrl, "worker", a.body.id, a.body.token);
    expect(c.state).toBe("connected");
    await expect(peer(relayUrl, "worker", "someone-else", a.body.token)).rejects.toMatchObject({
      code: "MOESWARM_AUTH_ROLE",
    });
    const b = await redeem(base, issued.body.code);
    expect(b.status).toBe(201);
    expect(b.body.id).not.toBe(a.body.id);
    const third = await redeem(base, issued.body.code);
    expect([third.status, third.body.error.code]).toEqual([403, "MOESWARM_HUB_ENROL_USED"]);
    for (const junk of ["mse1_nothing-issued", "hello", 42, undefined]) {
      const r = await redeem(base, junk);
      expect([r.status, r.body.error.code]).toEqual([403, "MOESWARM_HUB_ENROL_INVALID"]);
    }
    const short = await http(base, "/api/enrol-codes", { owner: "alice", ttlMs: 1000 }, token("admin"));
    now += 2000;
    const late = await redeem(base, short.body.code);
    expect([late.status, late.body.error.code]).toEqual([403, "MOESWARM_HUB_ENROL_EXPIRED"]);
  });

  it("revokes the owner's unused codes when one of its workers is banned", async () => {
    const { base, relayUrl } = await start({ requireLeases: false });
    const first = await http(base, "/api/enrol-codes", { owner: "mallory", uses: 1 }, token("admin"));
    const spare = await http(base, "/api/enrol-codes", { owner: "mallory", uses: 5 }, token("admin"));
    const other = await http(base, "/api/enrol-codes", { owner: "bob", uses: 1 }, token("admin"));
    const m = (await redeem(base, first.body.code)).body;
    const liar = await peer(relayUrl, "worker", m.id, m.token);
    liar.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(async () => (await placementIds(base)).includes(m.id), "registered");
    const bb = await peer(relayUrl, "backbone", "bb");
    await relayDispatch(bb, m.id, ID, 0, Int32Array.from([0, 1]), 2).catch(() => undefined);
    const filed = await http(
      base,
      `/api/models/${ID}/reports/quarantine`,
      {
        worker: m.id,
        layer: 0,
        reason: "scaled outputs",
        requestDigest: createHash("sha256").update("x").digest("hex"),
        at: T0,
      },
      token("backbone", "bb"),
    );
    expect(filed.status).toBe(201);
    // a new id under the banned owner needs a code issued after the ban
    const again = await redeem(base, spare.body.code);
    expect([again.status, again.body.error.code]).toEqual([403, "MOESWARM_HUB_ENROL_REVOKED"]);
    expect((await redeem(base, other.body.code)).status).toBe(201);
    const fresh = await http(base, "/api/enrol-codes", { owner: "mallory" }, token("admin"));
    expect((await redeem(base, fresh.body.code)).status).toBe(201);
  });

  it("keeps codes (hashed) in the SQLite file: `moeswarm-hub enrol-code` issues, a restarted hub redeems", async () => {
    const dir = `${fx.tmp.dir}/enrol-data`;
    const out: string[] = [];
    const io = {
      stdout: { write: (t: string) => out.push(t) } as unknown as NodeJS.WritableStream,
      stderr: { write: (t: string) => out.push(t) } as unknown as NodeJS.WritableStream,
    };
    const { runCli } = await import("../src/cli/run.js");
    const args = [
      "enrol-code",
      "--data-dir",
      dir,
      "--owner",
      "carol",
      "--uses",
      "1",
      "--ttl",
      "24h",
      "--json",
    ];
    mkdirSync(dir, { recursive: true });
    expect(await runCli(args, io)).toBe(0);
    const issued = JSON.parse(out.join(""));
    expect(issued).toMatchObject({ owner: "carol", uses: 1 });
    expect(readFileSync(`${dir}/moeswarm-hub.db`).includes(Buffer.from(issued.code))).toBe(false);
    expect(await runCli(["enrol-code", "--data-dir", dir, "--owner", "carol", "--ttl", "soon"], io)).toBe(2);
    const { base } = await start({ store: `${dir}/moeswarm-hub.db` });
    const r = await redeem(base, issued.code);
    expect([r.status, r.body.owner]).toEqual([201, "carol"]);
    expect((await redeem(base, issued.code)).body.error.code).toBe("MOESWARM_HUB_ENROL_USED");
  });
});

// connectHub against a real hub (TLS on loopback, a throwaway CA): the placement it follows by
// long-polling, the stats it reports (seq, credits, tokens/s), failures retried and counted, close.
// Workers here only register on the relay; nothing is computed (hub-bridge.test.ts decodes).
import { AuthError, HubError, InvalidArgumentError, sleep, TransportError } from "@moeswarm/core";
import { createHub, type Hub, mintToken } from "@moeswarm/hub";
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import { Agent, request } from "undici";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  type BridgeStatsReport,
  connectHub,
  createSwarmLlama,
  type HubLinkEvent,
  type HubLinkOptions,
  type StatsSource,
  serveBackboneBridge,
} from "../src/index.js";
import {
  type LoopbackCerts,
  loopbackCerts,
  type ModelInfo,
  modelInfo,
  split,
  syntheticModel,
} from "./helpers.js";

const SECRET = "backbone-hub-link-test-secret-0123";
const MODEL_ID = "linked";
const backboneToken = (id?: string) =>
  mintToken({ role: "backbone", ...(id ? { id } : {}), ttlS: 3600 }, SECRET);
const adminToken = mintToken({ role: "admin", ttlS: 3600 }, SECRET);
// fake workers register without claiming, one copy per expert, and the stats below are not
// routed through the relay: the hub trusts them (its defaults are tested in @moeswarm/hub)
const TRUSTED = { requireLeases: false, replicas: 1, trustReports: true } as const;

/** A source that hands out queued reports, then `otherwise` (idle ones by default). */
class QueueSource implements StatsSource {
  readonly queue: BridgeStatsReport[] = [];
  otherwise: BridgeStatsReport | undefined;
  taken = 0;
  takeStatsReport({ nExpert }: { nExpert: number }): BridgeStatsReport {
    this.taken++;
    const next = this.queue.shift();
    if (next) {
      for (const row of Object.values(next.counts)) expect(row.length).toBe(nExpert);
      return next;
    }
    return this.otherwise ? structuredClone(this.otherwise) : { tokens: 0, ms: 50, counts: {}, receipts: {} };
  }
}

function report(info: ModelInfo, receipts: Record<string, number>, tokens = 10): BridgeStatsReport {
  const row = new Array<number>(info.nExpert).fill(0);
  row[1] = 3;
  row[info.nExpert - 1] = 7;
  return {
    tokens,
    ms: 500,
    counts: { [String(info.layers[0])]: row },
    receipts: Object.fromEntries(
      Object.entries(receipts).map(([id, n]) => [id, { expertTokens: n, ms: 1.5 }]),
    ),
  };
}

describe("connectHub", () => {
  let certs: LoopbackCerts;
  let model: string;
  let info: ModelInfo;
  let hub: Hub;
  let url: string;
  let relayUrl: string;
  let agent: Agent;
  const connections: RelayConnection[] = [];

  const base = (extra: Partial<HubLinkOptions> = {}): HubLinkOptions => ({
    url,
    // the hub refuses unbound backbone tokens: bind it to the id the link reports as
    token: backboneToken(extra.id ?? "bb"),
    model: MODEL_ID,
    ca: certs.ca,
    pollWaitS: 5,
    retryMinMs: 20,
    retryMaxMs: 100,
    ...extra,
  });

  const worker = async (id: string, experts: number[]) => {
    const c = await connectRelay(relayUrl, {
      role: "worker",
      id,
      token: mintToken({ role: "worker", id, ttlS: 3600 }, SECRET),
      ca: certs.ca,
      reconnect: false,
    });
    connections.push(c);
    c.register({ model: MODEL_ID, layers: info.layers, experts });
    return c;
  };

  const getJson = async (path: string): Promise<Record<string, unknown>> => {
    const r = await request(`${url}${path}`, { dispatcher: agent });
    expect(r.statusCode).toBe(200);
    return (await r.body.json()) as Record<string, unknown>;
  };
  const credits = async (id: string): Promise<number> => {
    const { workers } = (await getJson("/api/workers")) as {
      workers: Array<{ id: string; credits: { expertTokens: number } }>;
    };
    return workers.find((w) => w.id === id)?.credits.expertTokens ?? 0;
  };

  beforeAll(async () => {
    certs = await loopbackCerts();
    model = await syntheticModel("tiny", "qwen3moe");
    info = await modelInfo(model);
    hub = createHub({ secret: SECRET, models: [{ id: MODEL_ID, path: model }], tls: certs, ...TRUSTED });
    const listener = await hub.listen(0);
    url = listener.url;
    relayUrl = listener.relayUrl;
    agent = new Agent({ connect: { ca: certs.ca } });
  });
  afterAll(async () => {
    await Promise.all(connections.map((c) => c.close().catch(() => {})));
    await agent?.close();
    await hub?.close();
  });

  it("checks its options before connecting, with typed errors", async () => {
    const bad: Array<Partial<HubLinkOptions>> = [
      { url: "not a url" },
      { url: "ftp://127.0.0.1/" },
      { url: "https://user:pw@127.0.0.1/" },
      { model: "../etc/passwd" },
      { token: "" },
      { id: "" },
      { statsIntervalMs: -1 },
      { pollWaitS: 1.5 },
      { relayUrl: "https://127.0.0.1/relay" },
      { ca: 42 as unknown as string },
    ];
    for (const b of bad) await expect(connectHub(base(b))).rejects.toBeInstanceOf(InvalidArgumentError);
    // the bridge and createSwarmLlama take hub or placement + transport, never both
    await expect(
      serveBackboneBridge({
        socket: "/tmp/never.sock",
        hub: base(),
        transport: { request: async () => Promise.reject(new Error("unused")) },
      }),
    ).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(serveBackboneBridge({ socket: "/tmp/never.sock" })).rejects.toBeInstanceOf(
      InvalidArgumentError,
    );
    await expect(
      serveBackboneBridge({ socket: "/tmp/never.sock", hub: base(), model: "another" }),
    ).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(
      createSwarmLlama({ modelPath: model, remoteLayers: "all", hub: { ...base(), url: "nope" } }),
    ).rejects.toBeInstanceOf(InvalidArgumentError);
    const aborted = new AbortController();
    aborted.abort(new Error("stop"));
    await expect(connectHub({ ...base(), signal: aborted.signal })).rejects.toThrow("stop");
  });

  it("refuses at connect what cannot work: unknown model, bad token, untrusted CA", async () => {
    await expect(connectHub(base({ model: "no-such-model" }))).rejects.toSatisfy(
      (e) => e instanceof HubError && e.code === "MOESWARM_HUB_NOT_FOUND",
    );
    // reads are public: the token is refused by the relay's hello
    await expect(
      connectHub(base({ token: mintToken({ role: "backbone", ttlS: 60 }, "another-secret-0123456789") })),
    ).rejects.toBeInstanceOf(AuthError);
    await expect(
      connectHub(base({ token: mintToken({ role: "worker", ttlS: 60 }, SECRET) })),
    ).rejects.toSatisfy((e) => e instanceof AuthError && e.code === "MOESWARM_AUTH_ROLE");
    const { ca: _ca, ...noCa } = base();
    await expect(connectHub(noCa)).rejects.toSatisfy(
      (e) => e instanceof TransportError && e.code === "MOESWARM_TRANSPORT_CONNECT",
    );
  });

  it("follows the placement: registrations, drain and disconnect each replace it", async () => {
    const events: HubLinkEvent[] = [];
    await using link = await connectHub(base({ id: "bb-follow", onEvent: (e) => events.push(e) }));
    expect(link.id).toBe("bb-follow");
    const first = link.current();
    expect(first.layers).toEqual(info.layers);
    expect(first.nExpert).toBe(info.nExpert);
    expect(first.workers).toEqual([]);
    expect(first.missing.reduce((s, m) => s + m.count, 0)).toBe(info.layers.length * info.nExpert);

    const [lo, hi] = split(info.nExpert, 2) as [number[], number[]];
    const a = await worker("fa", lo);
    const withA = await link.waitForPlacement((p) => p.workers.includes("fa"));
    expect(withA.version).toBeGreaterThan(first.version);
    expect(link.placement().owners(info.layers[0]!, lo[0]!)).toEqual(["fa"]);
    // the snapshot a request started with does not change
    expect(first.placement.owners(info.layers[0]!, lo[0]!)).toEqual([]);

    await worker("fb", hi);
    const full = await link.waitForPlacement((p) => p.missing.length === 0);
    expect([...full.workers].sort()).toEqual(["fa", "fb"]);
    expect(link.placement().owners(info.layers.at(-1)!, hi.at(-1)!)).toEqual(["fb"]);

    // an operator drains fb: it is no longer chosen
    const drained = await request(`${url}/api/workers/fb/drain`, {
      method: "POST",
      dispatcher: agent,
      headers: { authorization: `Bearer ${adminToken}`, "content-type": "application/json" },
      body: JSON.stringify({ reason: "test" }),
    });
    expect(drained.statusCode).toBe(200);
    await drained.body.dump();
    const noB = await link.waitForPlacement((p) => !p.workers.includes("fb"));
    expect(noB.version).toBeGreaterThan(full.version);
    expect(link.placement().owners(info.layers[0]!, hi[0]!)).toEqual([]);
    expect(link.placement().choose(info.layers[0]!, hi[0]!, { rotation: 0 })).toBeUndefined();

    // fa goes away (its connection closes)
    await a.close();
    const none = await link.waitForPlacement((p) => p.workers.length === 0);
    expect(none.version).toBeGreaterThan(noB.version);

    const m = link.metrics();
    expect(m.placementVersion).toBe(none.version);
    expect(m.placementUpdates).toBeGreaterThanOrEqual(4);
    expect(m.pollErrors).toBe(0);
    expect(m.relay).toBe("connected");
    const versions = events.flatMap((e) => (e.type === "placement" ? [e.version] : []));
    expect(versions[0]).toBe(first.version);
    expect(versions).toEqual([...versions].sort((x, y) => x - y));
    expect(new Set(versions).size).toBe(versions.length);

    // close ends the long-poll in flight (it would wait 5 s) and the relay connection
    await link.close();
    expect(link.relay.state).toBe("closed");
    await expect(link.waitForPlacement(() => false)).rejects.toBeInstanceOf(Error);
  });

  it("reports periodically with increasing seq; the hub credits the workers and shows tokens/s", async () => {
    await worker("sa", split(info.nExpert, 2)[0]!);
    const source = new QueueSource();
    const events: HubLinkEvent[] = [];
    const link = await connectHub(
      base({ id: "bb-stats", statsIntervalMs: 30, onEvent: (e) => events.push(e) }),
    );
    link.reportStatsFrom(source);
    const before = await credits("sa");
    source.queue.push(report(info, { sa: 11 }), report(info, { sa: 13, stranger: 5 }));
    const stats = () =>
      events.filter((e): e is Extract<HubLinkEvent, { type: "stats" }> => e.type === "stats");
    while (stats().length < 3) await sleep(20);
    const [r1, r2, r3] = stats();
    expect(r1!.accepted && r2!.accepted && r3!.accepted).toBe(true);
    expect(r1!.credited).toEqual(["sa"]);
    expect(r2!.ignored).toEqual(["stranger"]); // never seen by the hub: not credited
    expect(r2!.seq).toBeGreaterThan(r1!.seq);
    expect(r3!.seq).toBeGreaterThan(r2!.seq);
    expect(await credits("sa")).toBe(before + 24);
    // the idle span after the work was reported once (rate 0), later idle spans are not sent
    const takenThen = source.taken;
    while (source.taken < takenThen + 3) await sleep(20);
    expect(stats().length).toBe(3);

    // close sends a final report with what accumulated since
    source.queue.push(report(info, { sa: 5 }, 40));
    await link.close();
    expect(stats().length).toBe(4);
    expect(await credits("sa")).toBe(before + 29);
    const status = (await getJson(`/api/status?model=${MODEL_ID}`)) as { tokensPerSecond: number };
    expect(status.tokensPerSecond).toBeCloseTo(40 / 0.5, 6);
    const m = link.metrics();
    expect(m.statsAccepted).toBe(4);
    expect(m.statsErrors).toBe(0);
  });

  it("retries failures with backoff and counts them; a report the hub refuses is dropped", async () => {
    const source = new QueueSource();
    const events: HubLinkEvent[] = [];
    const link = await connectHub(
      base({ id: "bb-errors", statsIntervalMs: 30, onEvent: (e) => events.push(e) }),
    );
    link.reportStatsFrom(source);
    // counts for a layer the model does not have: 400, never retried
    source.queue.push({
      tokens: 1,
      ms: 10,
      counts: { "999": new Array<number>(info.nExpert).fill(1) },
      receipts: {},
    });
    while (link.metrics().statsDropped < 1) await sleep(20);
    const dropped = events.find((e) => e.type === "error" && e.source === "stats");
    expect(dropped).toMatchObject({ dropped: true, error: { code: "MOESWARM_HUB_BAD_REQUEST" } });

    // an explicit report after it goes through
    source.queue.push(report(info, {}, 3));
    const outcome = await link.reportStats();
    expect(outcome?.accepted).toBe(true);
    await link.close();
    // and one idle report after it (periodic or at close): the hub's tokens/s then reads 0
    expect(link.metrics()).toMatchObject({ statsAccepted: 2, statsDropped: 1, statsErrors: 1 });
  });

  it("survives the hub going away: polls and reports fail and are retried, then resume on a new hub", async () => {
    const secondModel = model;
    const temp = createHub({
      secret: SECRET,
      models: [{ id: MODEL_ID, path: secondModel }],
      tls: certs,
      ...TRUSTED,
    });
    const { url: tempUrl, port } = await temp.listen(0);
    const source = new QueueSource();
    const events: HubLinkEvent[] = [];
    const link = await connectHub(
      base({ url: tempUrl, id: "bb-restart", statsIntervalMs: 30, onEvent: (e) => events.push(e) }),
    );
    link.reportStatsFrom(source);
    const v0 = link.current().version;
    await temp.close();
    // every span from now on has work: whichever report arrives last, the rate is 7 / 0.5 s
    source.otherwise = report(info, {}, 7);
    while (link.metrics().pollErrors < 2 || link.metrics().statsErrors < 2) {
      await sleep(20);
    }
    expect(link.metrics().lastPollError?.code).toMatch(/^MOESWARM_TRANSPORT_/);
    // the same port again: the poller and the pending report get through
    const again = createHub({
      secret: SECRET,
      models: [{ id: MODEL_ID, path: secondModel }],
      tls: certs,
      ...TRUSTED,
    });
    try {
      await again.listen(port);
      await link.waitForPlacement((p) => p.version !== v0);
      while (link.metrics().statsAccepted < 1) await sleep(20);
      const status = (await (
        await request(`${tempUrl}/api/status?model=${MODEL_ID}`, { dispatcher: agent })
      ).body.json()) as { tokensPerSecond: number };
      expect(status.tokensPerSecond).toBeCloseTo(7 / 0.5, 6);
      // the relay connection went down and came back by itself
      await link.relay.waitConnected();
      const states = events.flatMap((e) => (e.type === "relay" ? [e.state] : []));
      expect(states).toContain("reconnecting");
      expect(states.at(-1)).toBe("connected");
      await link.close();
    } finally {
      await link.close();
      await again.close();
    }
  });

  it("keeps the last ban list when a refresh fails, and says so (event with a hint, counters)", async () => {
    const temp = createHub({
      secret: SECRET,
      models: [{ id: MODEL_ID, path: model }],
      tls: certs,
      ...TRUSTED,
    });
    const { url: tempUrl } = await temp.listen(0);
    const events: HubLinkEvent[] = [];
    const link = await connectHub(base({ url: tempUrl, id: "bb-bans", onEvent: (e) => events.push(e) }));
    try {
      // an admin bans a worker on the hub (the evidence a backbone would send)
      const banned = await request(`${tempUrl}/api/models/${MODEL_ID}/reports/quarantine`, {
        method: "POST",
        dispatcher: agent,
        headers: { "content-type": "application/json", authorization: `Bearer ${adminToken}` },
        body: JSON.stringify({
          worker: "liar-1",
          layer: info.layers[0],
          reason: "scaled outputs",
          requestDigest: "ab".repeat(32),
          expected: { norm: 1.5, cosine: 1 },
          got: { norm: 1.575, cosine: 0.999 },
          at: Date.now(),
        }),
      });
      expect(banned.statusCode).toBe(201);
      await banned.body.dump();
      expect(await link.quarantined()).toEqual(["liar-1"]);
      expect(link.metrics()).toMatchObject({ banRefreshes: 1, banRefreshErrors: 0 });
      // the hub goes away: the refresh keeps the ban, counts the failure and says what to do
      await temp.close();
      expect(await link.quarantined()).toEqual(["liar-1"]);
      const m = link.metrics();
      expect(m).toMatchObject({ banRefreshes: 1, banRefreshErrors: 1 });
      expect(m.lastBanRefreshError?.code).toMatch(/^MOESWARM_TRANSPORT_/);
      const failed = events.find((e) => e.type === "error" && e.source === "bans");
      expect(failed).toBeDefined();
      expect(failed?.type === "error" ? failed.hint : "").toMatch(
        /keeping the last one \(1 worker\(s\) banned\).*hub is reachable.*token/,
      );
    } finally {
      await link.close();
      await temp.close();
    }
  });

  it("rejects the first ban-list read when the hub cannot answer (nothing to keep yet)", async () => {
    const temp = createHub({
      secret: SECRET,
      models: [{ id: MODEL_ID, path: model }],
      tls: certs,
      ...TRUSTED,
    });
    const { url: tempUrl } = await temp.listen(0);
    const link = await connectHub(base({ url: tempUrl, id: "bb-bans-first" }));
    try {
      await temp.close();
      await expect(link.quarantined()).rejects.toMatchObject({
        code: expect.stringMatching(/^MOESWARM_TRANSPORT_/),
      });
      expect(link.metrics().banRefreshErrors).toBe(0);
    } finally {
      await link.close();
    }
  });

  it("aborting the signal closes the link", async () => {
    const controller = new AbortController();
    const link = await connectHub({ ...base({ id: "bb-abort" }), signal: controller.signal });
    controller.abort();
    await link.close();
    expect(link.relay.state).toBe("closed");
  });
});

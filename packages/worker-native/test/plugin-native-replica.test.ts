// The backbone plugin's native plane with replicas (issue #15, phase 3): a whole-layer table entry
// with an `alt`. A primary that fails sends the split to the alt natively (failover); a primary
// silent for the table's hedgeMs races the alt (hedge), and its late answer is skipped on the next
// split it serves; a split that fails leaves no link owing an answer open (the next split dials a
// new one). Real llama.cpp + libggml-moeswarm.so (llama-logits); every run's logits are
// compared byte for byte with plain llama.cpp's, the independent reference.

import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { ExpertCompute } from "../src/index.js";
import {
  firstByteDiff,
  type NativeTable,
  type PluginRun,
  pluginMissing,
  type Receipts,
  runLogits,
  type StandInBridge,
  type StandInWorker,
  setUpWholeSlice,
  startBridge,
  startWorker,
} from "./plugin-native-fixture.js";

const missing = pluginMissing();
if (missing) console.warn(`plugin-native-replica tests skipped: ${missing}`);

const N_PREDICT = 8;
const BACKBONE = "bb-replica";
const TICKET = "mswt1.test-claims.test-signature";

/** Per worker: the splits the receipts credit it with. */
function credited(receipts: Receipts[]): Record<string, number> {
  const out: Record<string, number> = {};
  for (const r of receipts) for (const c of r.counts) out[c.worker] = (out[c.worker] ?? 0) + c.splits;
  return out;
}

const servedSplits = (w: StandInWorker) => [...w.served.values()].reduce((a, s) => a + s.splits, 0);

describe.skipIf(Boolean(missing))("plugin: a whole layer with a replica (failover, hedge)", () => {
  const tmp = tempDir("mswn-rep-");
  let model: string;
  let layers: number[];
  let compute: ExpertCompute;
  let cert: { cert: string; key: string };
  let cert2: { cert: string; key: string };
  let plain: PluginRun;
  let runs = 0;
  let nExpert: number;

  beforeAll(async () => {
    const set = await setUpWholeSlice(tmp.dir, N_PREDICT);
    ({ model, layers, nExpert, compute, plain } = set);
    [cert, cert2] = set.certs;
    expect(plain.ok, plain.stderr).toBe(true);
  });
  afterAll(async () => {
    await compute?.close();
    tmp.remove();
  });

  /** Every layer: w1 primary, w2 its alt. */
  const table = (
    primary: StandInWorker,
    alt: StandInWorker,
    extra: Partial<NativeTable> = {},
  ): NativeTable => ({
    backbone: BACKBONE,
    deadlineMs: 5000,
    layers: layers.map((layer) => ({
      layer,
      worker: "w1",
      addr: primary.addr,
      fp: primary.fingerprint,
      ticket: TICKET,
      exp: Date.now() + 3_600_000,
      alt: { worker: "w2", addr: alt.addr, fp: alt.fingerprint, ticket: TICKET, exp: Date.now() + 3_600_000 },
    })),
    ...extra,
  });

  /**
   * Every layer split in two ranges: [0, nExpert/2) served by `first`, the rest by `second`, each
   * `[id, worker]` with an optional `[id, worker]` alt.
   */
  type Named = [string, StandInWorker];
  const rangedTable = (
    first: [Named, Named?],
    second: [Named, Named?],
    extra: Partial<NativeTable> = {},
  ): NativeTable => {
    const exp = Date.now() + 3_600_000;
    const target = ([worker, w]: Named) => ({ worker, addr: w.addr, fp: w.fingerprint, ticket: TICKET, exp });
    const entry = ([owner, alt]: [Named, Named?], experts: [number, number]) => ({
      ...target(owner),
      experts,
      ...(alt ? { alt: target(alt) } : {}),
    });
    const h = nExpert / 2;
    return {
      backbone: BACKBONE,
      deadlineMs: 5000,
      layers: layers.flatMap((layer) => [
        { layer, ...entry(first, [0, h]) },
        { layer, ...entry(second, [h, nExpert]) },
      ]),
      ...extra,
    };
  };

  async function decode(bridge: StandInBridge) {
    const run = await runLogits({
      model,
      dir: tmp.dir,
      name: `run${++runs}`,
      nPredict: N_PREDICT,
      bridge: bridge.address,
    });
    expect(run.ok, run.stderr).toBe(true);
    expect(run.tokens).toEqual(plain.tokens);
    expect(firstByteDiff(run.logits, plain.logits)).toBe(-1);
    return run;
  }

  it("a primary whose listener is gone: the alt answers natively, the same bytes; failovers reported, credited to the alt", async () => {
    const gone = await startWorker(cert, compute, "ok");
    await gone[Symbol.asyncDispose](); // its port now refuses connections
    await using alt = await startWorker(cert2, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "gone.sock"), compute);
    bridge.setTable(table(gone, alt));
    const run = await decode(bridge);
    const n = run.plugin!.native;
    // at most the very first split (before the table arrived) went to the bridge
    expect(bridge.dispatches.length).toBeLessThanOrEqual(1);
    expect(n.fallbacks).toBe(0);
    expect(n.splits).toBe(run.plugin!.splits - bridge.dispatches.length);
    // one failover per dial of the primary (then it backs off 1 s, and the alt is asked alone)
    expect(n.failovers).toBeGreaterThanOrEqual(1);
    expect(n.failures).toEqual({ MOESWARM_TRANSPORT_CONNECT: n.failovers });
    const failures = bridge.receipts.flatMap((r) => r.failures);
    expect(failures).toHaveLength(n.failovers);
    for (const f of failures)
      expect(f).toMatchObject({ worker: "w1", code: "MOESWARM_TRANSPORT_CONNECT", failover: true });
    expect(credited(bridge.receipts)).toEqual({ w2: n.splits });
    expect(servedSplits(alt)).toBe(n.splits);
    console.info(
      `failover (primary refusing): ${n.failovers} failovers, ${n.splits} native splits, round trip p50 ${n.roundTripP50Us} us`,
    );
  });

  it("a primary that answers with an error frame: failover for each of its failures; a refusal of our frame: no failover", async () => {
    await using primary = await startWorker(cert, compute, "error-frame");
    await using alt = await startWorker(cert2, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "err.sock"), compute);
    bridge.setTable(table(primary, alt));
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect(n.fallbacks).toBe(0);
    expect(n.failures).toEqual({ MOESWARM_WORKER_DRAINING: n.failovers });
    expect(primary.dispatches.length).toBe(n.failovers);
    expect(credited(bridge.receipts)).toEqual({ w2: n.splits });

    // MOESWARM_INVALID_ARGUMENT: the worker refuses what we sent; the alt would too: the bridge
    await using bad = await startWorker(cert, compute, "invalid");
    await using alt2 = await startWorker(cert2, compute, "ok");
    await using bridge2 = await startBridge(join(tmp.dir, "inv.sock"), compute);
    bridge2.setTable(table(bad, alt2));
    const run2 = await decode(bridge2);
    const n2 = run2.plugin!.native;
    expect(n2.failovers).toBe(0);
    expect(n2.fallbacks).toBeGreaterThanOrEqual(1);
    expect(n2.failures).toEqual({ MOESWARM_INVALID_ARGUMENT: n2.fallbacks });
    // while w1 backs off the alt is asked alone; but never right after w1's refusal
    expect(alt2.dispatches.length).toBe(n2.splits);
    for (const f of bridge2.receipts.flatMap((r) => r.failures)) expect(f.failover).toBeUndefined();
  });

  it("both gone: every split through the bridge, the same bytes; the primary's failure a failover, the alt's a fallback", async () => {
    const a = await startWorker(cert, compute, "ok");
    const b = await startWorker(cert2, compute, "ok");
    await a[Symbol.asyncDispose]();
    await b[Symbol.asyncDispose]();
    await using bridge = await startBridge(join(tmp.dir, "both.sock"), compute);
    bridge.setTable(table(a, b));
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect(n.splits).toBe(0);
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits);
    expect(n.fallbacks).toBeGreaterThanOrEqual(1);
    const failures = bridge.receipts.flatMap((r) => r.failures);
    // the first split: w1 (failover) then w2 (fallback); both back off, later splits skip them
    expect(failures.slice(0, 2)).toEqual([
      expect.objectContaining({ worker: "w1", failover: true }),
      expect.objectContaining({ worker: "w2", code: "MOESWARM_TRANSPORT_CONNECT" }),
    ]);
    expect(failures[1]!.failover).toBeUndefined();
    expect(credited(bridge.receipts)).toEqual({});
  });

  it("a primary and its alt both silent past the deadline: the split through the bridge, the same bytes; both links closed, redialed after the backoff", async () => {
    // each stays silent on its first dispatch (the split's, and the hedge's), then answers
    await using primary = await startWorker(cert, compute, "silent");
    await using alt = await startWorker(cert2, compute, "silent");
    primary.failOn = 1;
    alt.failOn = 1;
    // what the stand-ins had seen when the primary answered its first split after the failed one
    let seen: number[] = [];
    primary.onAnswer = (n) => {
      if (n === 1) seen = [primary.connections, primary.closed, alt.closed];
    };
    // 100 ms per bridge answer: the 1 s backoff ends well before the decode does. deadlineMs: room
    // for the first split's two dials; the hedge asks the alt 20 ms in
    await using bridge = await startBridge(join(tmp.dir, "silent.sock"), compute, { delayMs: 100 });
    bridge.setTable(table(primary, alt, { deadlineMs: 300, hedgeMs: 20 }));
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect(n.fallbacks).toBe(1);
    expect(bridge.receipts.flatMap((r) => r.failures)).toEqual([
      expect.objectContaining({ worker: "w1", code: "MOESWARM_TRANSPORT_TIMEOUT", failover: true }),
      expect.objectContaining({ worker: "w2", code: "MOESWARM_TRANSPORT_TIMEOUT" }),
    ]);
    // both were asked the failed split, each on its first link
    expect(primary.dispatches[0]!.layer).toBe(alt.dispatches[0]!.layer);
    // the plugin closed both links when the split failed: a link kept open would have been reused
    // after the backoff (one connection) and its late answer owed still
    expect(seen).toEqual([2, 1, 1]);
    expect(primary.connections).toBe(2);
    expect(n.splits).toBeGreaterThan(0);
    expect(n.splits + bridge.dispatches.length).toBe(run.plugin!.splits);
    const c = credited(bridge.receipts);
    expect((c.w1 ?? 0) + (c.w2 ?? 0)).toBe(n.splits);
  });

  it("hedge: a primary that stalls once races the alt after hedgeMs; the alt wins, the same bytes; the stale answer is skipped", async () => {
    await using primary = await startWorker(cert, compute, "ok");
    await using alt = await startWorker(cert2, compute, "ok");
    // the primary's first answer comes 600 ms late; later ones queue behind it on its connection
    primary.delayMs = 600;
    primary.delayOn = 1;
    await using bridge = await startBridge(join(tmp.dir, "hedge.sock"), compute);
    bridge.setTable(table(primary, alt, { hedgeMs: 40 }));
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect(n.fallbacks).toBe(0);
    expect(n.failures).toEqual({});
    expect(n.hedges).toBeGreaterThanOrEqual(1);
    expect(n.hedgeWins).toBeGreaterThanOrEqual(1);
    expect(n.hedgeWins).toBeLessThanOrEqual(n.hedges);
    // the loser is not backed off: the primary is asked again for the next splits, and the whole
    // run's splits are native (after the first, maybe, before the table came)
    expect(primary.dispatches.length).toBeGreaterThan(n.hedges);
    // one link each, all along: a late answer (a prompt's, larger than a 1-token result) is read
    // and skipped on the link, which stays up; and every split sent to the primary once
    expect([primary.connections, alt.connections]).toEqual([1, 1]);
    expect(primary.dispatches).toHaveLength(n.splits);
    expect(n.splits).toBe(run.plugin!.splits - bridge.dispatches.length);
    // each split credited once, to the worker whose answer was used; every answer the primary sent
    // but that was not used (the stale ones) was skipped, not read as a later split's (the bytes)
    const c = credited(bridge.receipts);
    expect((c.w1 ?? 0) + (c.w2 ?? 0)).toBe(n.splits);
    expect(c.w2).toBe(n.hedgeWins);
    expect(servedSplits(primary)).toBeGreaterThan(c.w1 ?? 0);
    const hedges = bridge.receipts.reduce((a, r) => a + (r.hedges ?? 0), 0);
    const wins = bridge.receipts.reduce((a, r) => a + (r.hedgeWins ?? 0), 0);
    expect([hedges, wins]).toEqual([n.hedges, n.hedgeWins]);
    console.info(
      `hedge (primary stalled 600 ms, hedgeMs 40): ${n.hedges} hedges, ${n.hedgeWins} won by the alt, ${n.splits} native splits, round trip p50 ${n.roundTripP50Us} us`,
    );
  });

  it("adaptive hedge (hedgeFactor, hedgeMinMs): a primary with a history that stalls races the alt; without one it is waited for", async () => {
    await using primary = await startWorker(cert, compute, "ok");
    await using alt = await startWorker(cert2, compute, "ok");
    // the 10th dispatch to the primary stalls: by then it has answered nine, its p50 is ~1 ms and
    // the hedge comes at max(30 ms, 2 x p50) = 30 ms
    primary.delayMs = 600;
    primary.delayOn = 10;
    await using bridge = await startBridge(join(tmp.dir, "adaptive.sock"), compute);
    bridge.setTable(table(primary, alt, { hedgeFactor: 2, hedgeMinMs: 30 }));
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect(n.fallbacks).toBe(0);
    expect(n.hedges).toBeGreaterThanOrEqual(1);
    expect(n.hedgeWins).toBeGreaterThanOrEqual(1);
    expect(alt.dispatches.length).toBe(n.hedges);
    // the first dispatch stalls: no history, no hedge (as dispatch's liveness), the split waits
    await using slow = await startWorker(cert, compute, "ok");
    await using alt2 = await startWorker(cert2, compute, "ok");
    slow.delayMs = 300;
    slow.delayOn = 1;
    await using bridge2 = await startBridge(join(tmp.dir, "adaptive2.sock"), compute);
    bridge2.setTable(table(slow, alt2, { hedgeFactor: 2, hedgeMinMs: 30 }));
    const run2 = await decode(bridge2);
    expect(run2.plugin!.native.hedges).toBe(0);
    expect(alt2.dispatches).toHaveLength(0);
  });

  it("a split layer whose first range's owner is gone: its part goes to that range's alt, the other owner's is not sent again", async () => {
    const h = nExpert / 2;
    const gone = await startWorker(cert, compute, "ok");
    await gone[Symbol.asyncDispose]();
    await using p1 = await startWorker(cert2, compute, "ok");
    await using a0 = await startWorker(cert2, compute, "ok");
    await using a1 = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "ranged.sock"), compute);
    bridge.setTable(
      rangedTable(
        [
          ["p0", gone],
          ["a0", a0],
        ],
        [
          ["p1", p1],
          ["a1", a1],
        ],
      ),
    );
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect(n.fallbacks).toBe(0);
    expect(n.splits).toBe(run.plugin!.splits - bridge.dispatches.length);
    expect(n.failovers).toBeGreaterThanOrEqual(1);
    expect(n.failures).toEqual({ MOESWARM_TRANSPORT_CONNECT: n.failovers });
    for (const f of bridge.receipts.flatMap((r) => r.failures))
      expect(f).toMatchObject({ worker: "p0", failover: true });
    // the second range's owner got one dispatch per native split (top-8 of 64: every split has ids
    // in both halves), never a second one for the first range's failover; its alt none
    expect(p1.dispatches).toHaveLength(n.splits);
    expect(a1.dispatches).toHaveLength(0);
    expect(a0.dispatches).toHaveLength(n.splits);
    for (const d of a0.dispatches) for (const id of d.ids) if (id !== -1) expect(id).toBeLessThan(h);
    expect(credited(bridge.receipts)).toEqual({ a0: n.splits, p1: n.splits });
    // each split layer's splits counted once
    const layerSplits = bridge.receipts.flatMap((r) => r.layers ?? []).reduce((a, l) => a + l.splits, 0);
    expect(layerSplits).toBe(n.splits);
  });

  it("a split layer whose owner answers an error frame mid-split: only its part is re-sent, to its alt", async () => {
    await using p0 = await startWorker(cert, compute, "error-frame");
    p0.failOn = 3;
    await using p1 = await startWorker(cert2, compute, "ok");
    await using a0 = await startWorker(cert2, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "ranged-err.sock"), compute);
    bridge.setTable(
      rangedTable(
        [
          ["p0", p0],
          ["a0", a0],
        ],
        [["p1", p1]],
      ),
    );
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect(n.fallbacks).toBe(0);
    expect([n.failovers, n.failures]).toEqual([1, { MOESWARM_WORKER_DRAINING: 1 }]);
    expect(n.splits).toBe(run.plugin!.splits - bridge.dispatches.length);
    // p1 once per split; the first range once per split plus the failed dispatch (p0's error),
    // re-sent to a0, which also serves p0's part while p0 backs off
    expect(p1.dispatches).toHaveLength(n.splits);
    expect(p0.dispatches.length + a0.dispatches.length).toBe(n.splits + 1);
    expect(a0.dispatches.length).toBeGreaterThanOrEqual(1);
    const c = credited(bridge.receipts);
    expect(c).toEqual({ p0: p0.dispatches.length - 1, a0: a0.dispatches.length, p1: n.splits });
  });

  it("a split layer whose owner fails while the other still computes: the split through the bridge, the same bytes; the other's link closed, redialed", async () => {
    await using p0 = await startWorker(cert, compute, "error-frame");
    await using p1 = await startWorker(cert2, compute, "ok");
    // the third split: p0 refuses it at once while p1 sits on it for 600 ms
    p0.failOn = 3;
    p1.delayMs = 600;
    p1.delayOn = 3;
    // 100 ms per bridge answer: p0's 1 s backoff ends well before the decode does
    await using bridge = await startBridge(join(tmp.dir, "ranged-close.sock"), compute, { delayMs: 100 });
    bridge.setTable(rangedTable([["p0", p0]], [["p1", p1]]));
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect([n.fallbacks, n.failures]).toEqual([1, { MOESWARM_WORKER_DRAINING: 1 }]);
    expect(bridge.receipts.flatMap((r) => r.failures)).toEqual([
      expect.objectContaining({ worker: "p0", code: "MOESWARM_WORKER_DRAINING" }),
    ]);
    // p1 did not fail and is not backed off, but its link, owing the failed split's answer, was
    // closed with it: a link kept open would have been used again (one connection)
    expect(p1.connections).toBe(2);
    expect(p0.connections).toBe(2);
    expect(n.splits).toBeGreaterThan(2);
    expect(p1.dispatches).toHaveLength(n.splits + 1);
    expect(credited(bridge.receipts)).toEqual({ p0: n.splits, p1: n.splits });
  });

  /** Per split-layer run: the hedge counters of the receipts, summed. */
  const receiptHedges = (bridge: StandInBridge) => [
    bridge.receipts.reduce((a, r) => a + (r.hedges ?? 0), 0),
    bridge.receipts.reduce((a, r) => a + (r.hedgeWins ?? 0), 0),
  ];

  /**
   * The split-hedge set-up: p0 (stalling `stall.ms` on its `stall.on`-th dispatch) with its alt a0
   * over the first range, p1 alone over the second, and the bridge with that table and `extra`.
   */
  async function stallingSplit(sock: string, stall: { ms: number; on: number }, extra: Partial<NativeTable>) {
    const p0 = await startWorker(cert, compute, "ok");
    const a0 = await startWorker(cert2, compute, "ok");
    const p1 = await startWorker(cert2, compute, "ok");
    p0.delayMs = stall.ms;
    p0.delayOn = stall.on;
    const bridge = await startBridge(join(tmp.dir, sock), compute);
    bridge.setTable(
      rangedTable(
        [
          ["p0", p0],
          ["a0", a0],
        ],
        [["p1", p1]],
        extra,
      ),
    );
    return {
      p0,
      a0,
      p1,
      bridge,
      async [Symbol.asyncDispose]() {
        for (const x of [bridge, p1, a0, p0]) await x[Symbol.asyncDispose]();
      },
    };
  }

  it("a split owner with a history that stalls is hedged to its alt (adaptive): only its part, the alt wins, the same bytes", async () => {
    const h = nExpert / 2;
    // p0's 10th dispatch stalls: by then it has answered nine split parts, its p50 is ~1 ms and its
    // hedge comes at max(30 ms, 2 x p50) = 30 ms, far before the 5 s deadline; its later answers
    // queue behind the stalled one on its connection
    await using swarm = await stallingSplit(
      "ranged-hedge.sock",
      { ms: 600, on: 10 },
      { hedgeFactor: 2, hedgeMinMs: 30 },
    );
    const { a0, p1, bridge } = swarm;
    const run = await decode(bridge);
    const n = run.plugin!.native;
    // nothing waited for the deadline (a timeout would be a failure) nor went to the bridge
    expect(n.fallbacks).toBe(0);
    expect(n.failures).toEqual({});
    expect(n.splits).toBe(run.plugin!.splits - bridge.dispatches.length);
    expect(n.hedges).toBeGreaterThanOrEqual(1);
    expect(n.hedgeWins).toBeGreaterThanOrEqual(1);
    expect(n.hedgeWins).toBeLessThanOrEqual(n.hedges);
    expect(receiptHedges(bridge)).toEqual([n.hedges, n.hedgeWins]);
    // the alt got p0's part of each hedged split and nothing else: the first range's ids only
    expect(a0.dispatches).toHaveLength(n.hedges);
    for (const d of a0.dispatches) {
      expect([d.mode, d.compact]).toEqual(["each", true]);
      for (const id of d.ids) if (id !== -1) expect(id).toBeLessThan(h);
    }
    // the other owner is not touched: one dispatch per split, never re-sent
    expect(p1.dispatches).toHaveLength(n.splits);
    // each part credited once, to the worker whose answer was used: the alt for the hedges it won
    const c = credited(bridge.receipts);
    expect(c).toEqual({ p0: n.splits - n.hedgeWins, a0: n.hedgeWins, p1: n.splits });
    console.info(
      `split hedge (owner stalled 600 ms, adaptive): ${n.hedges} hedges, ${n.hedgeWins} won by the alt, ${n.splits} native splits, round trip p50 ${n.roundTripP50Us} us`,
    );
  });

  it("a split owner stalled on its first dispatch (no history) is waited for, not hedged (adaptive)", async () => {
    // hedgeMinMs 200: a later hedge of a healthy owner would need a 200 ms hiccup
    await using swarm = await stallingSplit(
      "ranged-nohist.sock",
      { ms: 500, on: 1 },
      { hedgeFactor: 2, hedgeMinMs: 200 },
    );
    const { a0, bridge } = swarm;
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect([n.hedges, n.fallbacks, n.failures]).toEqual([0, 0, {}]);
    expect(a0.dispatches).toHaveLength(0);
    expect(credited(bridge.receipts)).toEqual({ p0: n.splits, p1: n.splits });
  });

  it("a split owner that lost a hedge (hedgeMs) keeps its link: its late answers, a prompt's larger one first, are skipped and later splits get their own", async () => {
    // the prompt's first split stalls: no history needed with hedgeMs
    await using swarm = await stallingSplit("ranged-stale.sock", { ms: 600, on: 1 }, { hedgeMs: 40 });
    const { p0, bridge } = swarm;
    const run = await decode(bridge);
    const n = run.plugin!.native;
    expect([n.fallbacks, n.failures]).toEqual([0, {}]);
    expect(n.splits).toBe(run.plugin!.splits - bridge.dispatches.length);
    expect(n.hedgeWins).toBeGreaterThanOrEqual(1);
    // the stalled answer (the prompt's: more rows than a decode step's) came late on a link already
    // carrying the next splits' dispatches: read whole and skipped by id, the link kept (one
    // connection), and p0 not backed off (asked for every split)
    expect(p0.dispatches[0]!.n).toBeGreaterThan(p0.dispatches.at(-1)!.n);
    expect(p0.connections).toBe(1);
    expect(p0.dispatches).toHaveLength(n.splits);
    // later splits through p0 got their own answers (the bytes say none took a stale one), and
    // answers p0 sent that were not used were skipped
    const c = credited(bridge.receipts);
    expect(c).toEqual({ p0: n.splits - n.hedgeWins, a0: n.hedgeWins, p1: n.splits });
    expect(c.p0).toBeGreaterThanOrEqual(1);
    expect(servedSplits(p0)).toBeGreaterThan(c.p0!);
    expect(receiptHedges(bridge)).toEqual([n.hedges, n.hedgeWins]);
  });

  it("a table whose alt is a primary of the same layer is refused whole: no dial, every split through the bridge", async () => {
    await using p0 = await startWorker(cert, compute, "ok");
    await using p1 = await startWorker(cert2, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "badalt.sock"), compute);
    // p1 is the alt of p0's range and the owner of the other range: one link, two exchanges
    bridge.setTable(
      rangedTable(
        [
          ["p0", p0],
          ["p1", p1],
        ],
        [["p1", p1]],
      ),
    );
    const run = await decode(bridge);
    expect(run.plugin!.native.splits).toBe(0);
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits);
    expect([p0.connections, p1.connections]).toEqual([0, 0]);
  });

  it("no hedgeMs: a slow primary is waited for (no race), the alt gets nothing", async () => {
    await using primary = await startWorker(cert, compute, "ok");
    await using alt = await startWorker(cert2, compute, "ok");
    primary.delayMs = 150;
    primary.delayOn = 2;
    await using bridge = await startBridge(join(tmp.dir, "nohedge.sock"), compute);
    bridge.setTable(table(primary, alt));
    const run = await decode(bridge);
    expect(run.plugin!.native.hedges).toBe(0);
    expect(alt.dispatches).toHaveLength(0);
    expect(credited(bridge.receipts)).toEqual({ w1: run.plugin!.native.splits });
  });
});

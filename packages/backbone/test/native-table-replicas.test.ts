// Phase 3 of the native plane: layers with replicas go native. The plan (replicaLayerPlan) picks one
// primary per range with an alt; the table (NativeTable) leaves out dropped and ticketless workers;
// the receipts' failovers and hedges reach the metrics. Fake timers and a fake plugin connection.
import { Placement, type WorkerRegistration } from "@moeswarm/dispatch";
import { decode, encode } from "@msgpack/msgpack";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { NativePlane, nativeHedge } from "../src/native-bridge.js";
import { decodeNativeFrame, encodeNativeTable, type NativeTableFrame } from "../src/native-plane.js";
import {
  type NativePlacementView,
  type NativeRoute,
  NativeTable,
  nativeLayerOwners,
  nativeWorkers,
  replicaLayerPlan,
} from "../src/native-table.js";
import type { PluginConnection } from "../src/plugin-socket.js";
import { RoutingStats } from "../src/routing-stats.js";

const FP = Array.from({ length: 32 }, (_, i) => (i * 5).toString(16).padStart(2, "0").toUpperCase()).join(
  ":",
);
const N_EXPERT = 8;
const ALL = Array.from({ length: N_EXPERT }, (_, e) => e);
const range = (lo: number, hi: number) => Array.from({ length: hi - lo }, (_, i) => lo + i);

function view(
  regs: Array<Omit<WorkerRegistration, "model">>,
  native: string[],
  layers: number[],
): NativePlacementView {
  return {
    placement: Placement.fromRegistrations(
      regs.map((r) => ({ ...r, model: "m" })),
      { model: "m" },
    ),
    layers,
    nExpert: N_EXPERT,
    native: new Map<string, NativeRoute>(native.map((id) => [id, { addrs: [`${id}:1`], fingerprint: FP }])),
  };
}

/** [layer, primary, alt, lo, hi] per entry: what the plan decided, compactly. */
function shape(groups: ReturnType<typeof replicaLayerPlan>) {
  return groups.flat().map((c) => [c.layer, c.worker, c.alt?.worker ?? null, ...(c.experts ?? [])]);
}

const all = () => true;

describe("replicaLayerPlan: which owner is primary, which the alt", () => {
  const LAYERS = [0, 1, 2, 3, 4, 5];

  it("two whole copies: primaries alternate by layer, each with the other as alt; deterministic", () => {
    const v = view(
      [
        { id: "B", layers: LAYERS, experts: ALL },
        { id: "A", layers: LAYERS, experts: ALL },
      ],
      ["A", "B"],
      LAYERS,
    );
    const plan = replicaLayerPlan(v, all);
    expect(shape(plan)).toEqual(LAYERS.map((l) => (l % 2 ? [l, "B", "A"] : [l, "A", "B"])));
    // whole layers: no range, and the alt carries where to reach it
    expect(plan[0]![0]).toEqual({
      layer: 0,
      worker: "A",
      addr: "A:1",
      fp: FP,
      alt: { worker: "B", addr: "B:1", fp: FP },
    });
    // a rebuild (another Placement object, registrations in another order) gives the same plan
    const again = view(
      [
        { id: "A", layers: LAYERS, experts: ALL },
        { id: "B", layers: LAYERS, experts: ALL },
      ],
      ["B", "A"],
      LAYERS,
    );
    expect(replicaLayerPlan(again, all)).toEqual(plan);
  });

  it("three copies: the primaries rotate over all three; every layer has an alt", () => {
    const v = view(
      ["A", "B", "C"].map((id) => ({ id, layers: LAYERS, experts: ALL })),
      ["A", "B", "C"],
      LAYERS,
    );
    const plan = shape(replicaLayerPlan(v, all));
    expect(plan.map((e) => e[1])).toEqual(["A", "B", "C", "A", "B", "C"]);
    for (const e of plan) expect(e[2]).not.toBeNull();
    for (const e of plan) expect(e[2]).not.toBe(e[1]);
  });

  it("one replica unusable (dropped, excluded, no ticket, no listener): the other is primary, no alt", () => {
    const regs = [
      { id: "A", layers: LAYERS, experts: ALL },
      { id: "B", layers: LAYERS, experts: ALL },
    ];
    const v = view(regs, ["A", "B"], LAYERS);
    expect(shape(replicaLayerPlan(v, (w) => w !== "A"))).toEqual(LAYERS.map((l) => [l, "B", null]));
    // without a listener it is not chosen either
    expect(shape(replicaLayerPlan(view(regs, ["B"], LAYERS), all))).toEqual(
      LAYERS.map((l) => [l, "B", null]),
    );
    // neither usable: no entry
    expect(replicaLayerPlan(v, () => false)).toEqual([]);
  });

  it("a gap (an expert nobody usable holds): no entry for that layer, even with replicas elsewhere", () => {
    const v = view(
      [
        { id: "A", layers: [0, 1], experts: range(0, 7) },
        { id: "B", layers: [0, 1], experts: range(0, 7) },
        { id: "C", layers: [1], experts: [7] },
      ],
      ["A", "B", "C"],
      [0, 1],
    );
    // layer 0: expert 7 held by nobody; layer 1: C covers it
    expect(shape(replicaLayerPlan(v, all))).toEqual([
      [1, "B", "A", 0, 7],
      [1, "C", null, 7, 8],
    ]);
    // C dropped: layer 1 has a gap too
    expect(replicaLayerPlan(v, (w) => w !== "C")).toEqual([]);
  });

  it("mixed ranges: two copies of a two-way split, primaries per range rotate, each range its own alt", () => {
    const v = view(
      [
        { id: "A", layers: [0, 1], experts: range(0, 4) },
        { id: "B", layers: [0, 1], experts: range(4, 8) },
        { id: "C", layers: [0, 1], experts: range(0, 4) },
        { id: "D", layers: [0, 1], experts: range(4, 8) },
      ],
      ["A", "B", "C", "D"],
      [0, 1],
    );
    expect(shape(replicaLayerPlan(v, all))).toEqual([
      [0, "A", "C", 0, 4],
      [0, "B", "D", 4, 8],
      [1, "C", "A", 0, 4],
      [1, "D", "B", 4, 8],
    ]);
    // B dropped: D serves 4..8 without an alt, 0..4 keeps its pair
    expect(shape(replicaLayerPlan(v, (w) => w !== "B"))).toEqual([
      [0, "A", "C", 0, 4],
      [0, "D", null, 4, 8],
      [1, "C", "A", 0, 4],
      [1, "D", null, 4, 8],
    ]);
  });

  it("a whole copy next to a split: the whole owner is primary (one dispatch), a split owner is no alt", () => {
    const v = view(
      [
        { id: "A", layers: [0, 1], experts: range(0, 4) },
        { id: "B", layers: [0, 1], experts: range(4, 8) },
        { id: "W", layers: [0, 1], experts: ALL },
      ],
      ["A", "B", "W"],
      [0, 1],
    );
    // W reaches farthest from expert 0; neither A nor B holds the whole layer: no alt
    expect(shape(replicaLayerPlan(v, all))).toEqual([
      [0, "W", null],
      [1, "W", null],
    ]);
    // W gone: the split, each range with W... absent, so no alt either
    expect(shape(replicaLayerPlan(v, (w) => w !== "W"))).toEqual([
      [0, "A", null, 0, 4],
      [0, "B", null, 4, 8],
      [1, "A", null, 0, 4],
      [1, "B", null, 4, 8],
    ]);
  });

  it("a range's alt must hold all of it and be no primary of the layer; adjacent runs of one worker merge", () => {
    const v = view(
      [
        // A 0..6 (two registrations: one run), B 6..8, R a partial replica of A's range
        { id: "A", layers: [0], experts: range(0, 3) },
        { id: "A", layers: [0], experts: range(3, 6) },
        { id: "B", layers: [0], experts: range(6, 8) },
        { id: "R", layers: [0], experts: range(2, 8) },
      ],
      ["A", "B", "R"],
      [0],
    );
    // from 0 only A; from 6: B and R both reach 8 (tie at layer 0: B); R holds 6..8 but not 0..6
    expect(shape(replicaLayerPlan(v, all))).toEqual([
      [0, "A", null, 0, 6],
      [0, "B", "R", 6, 8],
    ]);
  });

  it("layouts without replicas give what nativeLayerOwners gives (phase 1 and 2 unchanged)", () => {
    const v = view(
      [
        { id: "A", layers: [0, 1, 2, 3], experts: range(0, 4) },
        { id: "B", layers: [0, 1, 2], experts: range(4, 6) },
        { id: "C", layers: [0, 1, 2, 3], experts: range(6, 8) },
        { id: "W", layers: [4], experts: ALL },
        // layer 5: interleaved (an owner of two runs): off in both
        { id: "I", layers: [5], experts: [0, 1, 4, 5] },
        { id: "J", layers: [5], experts: [2, 3, 6, 7] },
      ],
      ["A", "B", "C", "W", "I", "J"],
      [0, 1, 2, 3, 4, 5],
    );
    for (const exclude of [[], ["B"], ["W"], ["C", "W"]]) {
      const set = new Set(exclude);
      expect(replicaLayerPlan(v, (w) => !set.has(w))).toEqual(nativeLayerOwners(v, set));
    }
    expect(shape(replicaLayerPlan(v, all)).map((e) => e[0])).toEqual([0, 0, 0, 1, 1, 1, 2, 2, 2, 4]);
  });

  it("nativeWorkers: every usable owner of a coverable layer (alts included), none of a gapped one", () => {
    const v = view(
      [
        { id: "A", layers: [0, 1], experts: ALL },
        { id: "B", layers: [0], experts: ALL },
        { id: "G", layers: [1], experts: [0] },
        { id: "H", layers: [2], experts: range(0, 7) },
      ],
      ["A", "B", "G", "H"],
      [0, 1, 2],
    );
    expect([...nativeWorkers(v, new Set())].sort()).toEqual(["A", "B", "G"]);
    expect([...nativeWorkers(v, new Set(["A"]))].sort()).toEqual(["B"]);
  });
});

function fakeConnection() {
  const tables: NativeTableFrame[] = [];
  const conn: PluginConnection = {
    reply: () => {
      throw new Error("the native plane never answers with core's frames");
    },
    sendPayload: (payload) => tables.push(decode(payload) as NativeTableFrame),
    onClose: () => {},
  };
  return { conn, tables };
}

describe("the table with replicas (fake timers)", () => {
  const T0 = Date.UTC(2026, 11, 2, 9, 0, 0);
  let stop: AbortController;
  let routing: RoutingStats;
  let failing: Set<string>;

  beforeEach(() => {
    vi.useFakeTimers({ now: T0 });
    stop = new AbortController();
    routing = new RoutingStats();
    failing = new Set();
  });
  afterEach(() => {
    stop.abort();
    vi.useRealTimers();
  });

  function plane(current: NativePlacementView, hedgeMs?: number) {
    return new NativePlane({
      backbone: "bb",
      deadlineMs: 400,
      routing,
      table: {
        backbone: "bb",
        deadlineMs: 400,
        hedgeMs,
        view: () => current,
        exclude: () => new Set(),
        ticket: async (worker) => {
          if (failing.has(worker)) throw new Error("no ticket");
          return { ticket: `mswt1.${worker}`, exp: Date.now() + 600_000 };
        },
        signal: stop.signal,
        backoff: { initialMs: 1000 },
      },
    });
  }

  const twoCopies = () =>
    view(
      [
        { id: "A", layers: [0, 1], experts: ALL },
        { id: "B", layers: [0, 1], experts: ALL },
      ],
      ["A", "B"],
      [0, 1],
    );
  const rows = (t: NativeTableFrame) => t.layers.map((e) => [e.layer, e.worker, e.alt?.worker ?? null]);

  it("two copies: alternating primaries with tickets for both; a primary's failure makes its alt primary", async () => {
    const p = plane(twoCopies(), 50);
    const c = fakeConnection();
    p.onPayload(encode({ v: 1, t: "native-hello", pid: 1 }), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    const t = c.tables.at(-1)!;
    expect(t.hedgeMs).toBe(50);
    expect(rows(t)).toEqual([
      [0, "A", "B"],
      [1, "B", "A"],
    ]);
    expect(t.layers[0]!.alt).toEqual({
      worker: "B",
      addr: "B:1",
      fp: FP,
      ticket: "mswt1.B",
      exp: T0 + 600_000,
    });
    // the plugin failed over from A to B once (B answered) and hedged once: A out for 1 s, B stays
    const receipts = {
      v: 1,
      t: "native-receipts",
      seq: 1,
      counts: [{ worker: "B", layer: 0, splits: 2, tokens: 2, expertTokens: 16 }],
      failures: [{ worker: "A", code: "MOESWARM_TRANSPORT_CONNECT", msg: "refused", failover: true }],
      hedges: 1,
      hedgeWins: 1,
    };
    p.onPayload(encode(receipts), c.conn);
    expect(rows(c.tables.at(-1)!)).toEqual([
      [0, "B", null],
      [1, "B", null],
    ]);
    expect(p.metrics()).toMatchObject({
      splits: 2,
      tokens: 2,
      expertTokens: 16,
      fallbacks: 0,
      failovers: 1,
      hedges: 1,
      hedgeWins: 1,
      failures: { MOESWARM_TRANSPORT_CONNECT: 1 },
      workers: { B: { splits: 2, expertTokens: 16 } },
      table: { workers: ["B"], alts: [], hedgeMs: 50 },
    });
    // the splits are credited once, to the worker that answered (the failed primary: nothing)
    const report = routing.takeReport(N_EXPERT);
    expect(report.receipts).toEqual({ B: { expertTokens: 16 } });
    expect(report.tokens).toBe(2);
    // after the backoff A is back: the same alternation as before (no flapping)
    await vi.advanceTimersByTimeAsync(1000);
    expect(rows(c.tables.at(-1)!)).toEqual([
      [0, "A", "B"],
      [1, "B", "A"],
    ]);
    // both failed (the second fell back to the bridge): the layer leaves the table, one fallback
    p.onPayload(
      encode({
        ...receipts,
        seq: 2,
        counts: [],
        hedges: 0,
        hedgeWins: 0,
        failures: [
          { worker: "A", code: "MOESWARM_TRANSPORT_CLOSED", msg: "", failover: true },
          { worker: "B", code: "MOESWARM_TRANSPORT_TIMEOUT", msg: "" },
        ],
      }),
      c.conn,
    );
    expect(c.tables.at(-1)!.layers).toEqual([]);
    expect(p.metrics()).toMatchObject({ fallbacks: 1, failovers: 2 });
  });

  it("a replica the hub mints no ticket for is not chosen; the other copy is primary without alt", async () => {
    failing.add("A");
    const p = plane(twoCopies());
    const c = fakeConnection();
    p.onPayload(encode({ v: 1, t: "native-hello", pid: 1 }), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    const t = c.tables.at(-1)!;
    expect(t.hedgeMs).toBeUndefined();
    expect(rows(t)).toEqual([
      [0, "B", null],
      [1, "B", null],
    ]);
    // the hub mints again after the retry backoff: A back as primary of layer 0
    failing.clear();
    await vi.advanceTimersByTimeAsync(1000);
    expect(rows(c.tables.at(-1)!)).toEqual([
      [0, "A", "B"],
      [1, "B", "A"],
    ]);
  });

  it("the table's hedge: the bridge's hedgeMs in whole ms before the deadline, or dispatch's adaptive rule when unset", () => {
    const liveness = { hedgeFactor: 2, floorMs: 250 };
    expect(nativeHedge(0, 5000, liveness)).toEqual({});
    expect(nativeHedge(12.2, 5000, liveness)).toEqual({ hedgeMs: 13 });
    expect(nativeHedge(5000, 5000, liveness)).toEqual({});
    // unset: adaptive, as dispatch hedges with liveness (2x p50, at least floorMs / 4)
    expect(nativeHedge(undefined, 5000, liveness)).toEqual({ hedgeFactor: 2, hedgeMinMs: 63 });
    expect(nativeHedge(undefined, 5000)).toEqual({});
    const bytes = encodeNativeTable({ seq: 1, backbone: "bb", deadlineMs: 100, hedgeMs: 20, layers: [] });
    expect(decode(bytes)).toMatchObject({ hedgeMs: 20, deadlineMs: 100 });
    const adaptive = encodeNativeTable({
      seq: 1,
      backbone: "bb",
      deadlineMs: 5000,
      hedgeFactor: 2,
      hedgeMinMs: 63,
      layers: [],
    });
    expect(decode(adaptive)).toMatchObject({ hedgeFactor: 2, hedgeMinMs: 63 });
    expect(decode(adaptive)).not.toHaveProperty("hedgeMs");
  });

  it("a table refuses an adaptive hedge without both fields, out of range, or with hedgeMs", () => {
    const base = {
      backbone: "bb",
      deadlineMs: 5000,
      view: () => undefined,
      exclude: () => new Set<string>(),
      ticket: async () => ({ ticket: "mswt1.x", exp: Date.now() + 60_000 }),
      onTable: () => {},
      signal: new AbortController().signal,
    };
    for (const bad of [
      { hedgeFactor: 2 },
      { hedgeMinMs: 63 },
      { hedgeFactor: 0.5, hedgeMinMs: 63 },
      { hedgeFactor: 2, hedgeMinMs: 0 },
      { hedgeFactor: 2, hedgeMinMs: 63, hedgeMs: 40 },
    ]) {
      expect(() => new NativeTable({ ...base, ...bad })).toThrow(/hedgeFactor/);
    }
    expect(new NativeTable({ ...base, hedgeFactor: 2, hedgeMinMs: 63 }).current()).toMatchObject({
      hedgeFactor: 2,
      hedgeMinMs: 63,
    });
  });

  it("receipts: failover must be a boolean, hedges u32; absent fields are zero", () => {
    const base = { v: 1, t: "native-receipts", seq: 1, counts: [] };
    expect(
      decodeNativeFrame(encode({ ...base, failures: [{ worker: "A", code: "MOESWARM_X", failover: true }] })),
    ).toMatchObject({ failures: [{ worker: "A", failover: true }] });
    expect(() =>
      decodeNativeFrame(encode({ ...base, failures: [{ worker: "A", code: "MOESWARM_X", failover: 1 }] })),
    ).toThrow(/failover/);
    expect(() => decodeNativeFrame(encode({ ...base, failures: [], hedges: -1 }))).toThrow(/hedges/);
    expect(decodeNativeFrame(encode({ ...base, failures: [] }))).not.toHaveProperty("hedges");
    // routing: experts and counts of one length, u16 ids, u32 counts
    const routing = (r: object) => decodeNativeFrame(encode({ ...base, failures: [], routing: [r] }));
    expect(routing({ layer: 0, experts: [1, 7], counts: [3, 1] })).toMatchObject({
      routing: [{ layer: 0, experts: [1, 7], counts: [3, 1] }],
    });
    expect(() => routing({ layer: 0, experts: [1], counts: [] })).toThrow(/different lengths/);
    expect(() => routing({ layer: 0, experts: [70_000], counts: [1] })).toThrow(/experts\[0\]/);
    expect(() => routing({ layer: 0, experts: [1], counts: [-1] })).toThrow(/counts\[0\]/);
  });
});

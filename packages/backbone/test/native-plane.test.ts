// The native plane's bridge side, without a plugin or a worker: the table built from placements,
// tickets renewed before they expire, receipts credited as the bridge's own routing, failing
// workers dropped and re-added, malformed frames counted and survived. Fake timers and a fake
// plugin connection; the socket-level handshake runs against a real bridge at the end.
import { connect } from "node:net";
import { join } from "node:path";
import { decodeFrame, encodeLengthPrefixed, FrameReader } from "@moeswarm/core";
import { Placement, type WorkerRegistration } from "@moeswarm/dispatch";
import { decode, encode } from "@msgpack/msgpack";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { parse, readConfig } from "../src/cli/options.js";
import { serveBackboneBridge } from "../src/index.js";
import { NativePlane, nativeDeadlineMs, nativeOffReason } from "../src/native-bridge.js";
import { decodeNativeFrame, type NativeTableFrame } from "../src/native-plane.js";
import {
  type NativePlacementView,
  type NativeRoute,
  nativeLayerOwners,
  wholeLayerOwners,
} from "../src/native-table.js";
import type { PluginConnection } from "../src/plugin-socket.js";
import { RoutingStats } from "../src/routing-stats.js";
import { tempDir, toyFrame, toyWorker } from "./helpers.js";

const FP = Array.from({ length: 32 }, (_, i) => (i * 7).toString(16).padStart(2, "0").toUpperCase()).join(
  ":",
);
const N_EXPERT = 8;
const ALL = Array.from({ length: N_EXPERT }, (_, e) => e);

function view(
  regs: Array<Omit<WorkerRegistration, "model">>,
  native: Record<string, string[]> = {},
  layers = [0, 1, 2],
): NativePlacementView {
  return {
    placement: Placement.fromRegistrations(
      regs.map((r) => ({ ...r, model: "m" })),
      { model: "m" },
    ),
    layers,
    nExpert: N_EXPERT,
    native: new Map<string, NativeRoute>(
      Object.entries(native).map(([id, addrs]) => [id, { addrs, fingerprint: FP }]),
    ),
  };
}

function fakeConnection() {
  const tables: NativeTableFrame[] = [];
  let closed: (() => void) | undefined;
  const conn: PluginConnection = {
    reply: () => {
      throw new Error("the native plane never answers with core's frames");
    },
    sendPayload: (payload) => tables.push(decode(payload) as NativeTableFrame),
    onClose: (listener) => {
      closed = listener;
    },
  };
  return { conn, tables, close: () => closed?.() };
}

const hello = () => encode({ v: 1, t: "native-hello", pid: 42 });
const receipts = (seq: number, counts: unknown[], failures: unknown[] = []) =>
  encode({ v: 1, t: "native-receipts", seq, counts, failures });

describe("which layers go native", () => {
  it("a layer whose every expert one worker holds, with a native listener: one entry", () => {
    const v = view([{ id: "A", layers: [0, 1, 2], experts: ALL }], {
      A: ["127.0.0.1:9001", "10.0.0.2:9001"],
    });
    expect(wholeLayerOwners(v, new Set())).toEqual(
      [0, 1, 2].map((layer) => ({
        layer,
        worker: "A",
        addr: "127.0.0.1:9001",
        fp: FP,
      })),
    );
  });

  it("two owners of a layer (replicas, or a split), a gap, no listener, an excluded worker: none", () => {
    const v = view(
      [
        { id: "A", layers: [0, 1, 2, 3, 4], experts: ALL },
        // a replica of layer 1 whole, and of one expert of layer 2
        { id: "B", layers: [1], experts: ALL },
        { id: "C", layers: [2], experts: [5] },
        // layer 5 split over two workers, layer 6 with a gap
        { id: "D", layers: [5], experts: [0, 1, 2, 3] },
        { id: "E", layers: [5, 6], experts: [4, 5, 6, 7] },
        // layer 7 whole on F, which has no native listener
        { id: "F", layers: [7], experts: ALL },
      ],
      { A: ["127.0.0.1:9001"], B: ["127.0.0.1:9002"], C: ["h:1"], D: ["h:2"], E: ["h:3"] },
      [0, 1, 2, 3, 4, 5, 6, 7],
    );
    const layers = (exclude: string[]) => wholeLayerOwners(v, new Set(exclude)).map((c) => c.layer);
    expect(layers([])).toEqual([0, 3, 4]);
    // quarantined or its circuit open: nothing native for it
    expect(layers(["A"])).toEqual([]);
  });

  it("a layer split over native workers, each one range, nobody else any: one entry per owner with its range", () => {
    const v = view(
      [
        { id: "A", layers: [0, 1, 2, 3, 4, 5, 6], experts: [0, 1, 2, 3] },
        { id: "B", layers: [0, 1, 2, 3, 4, 5], experts: [4, 5] },
        { id: "C", layers: [0, 1, 2, 3, 4, 5, 6], experts: [6, 7] },
        // layer 1: a replica of expert 5; layer 2: B without a listener; layer 3: D (B's) two runs
        { id: "R", layers: [1], experts: [5] },
        { id: "N", layers: [2], experts: [] },
        { id: "W", layers: [7], experts: ALL },
      ],
      { A: ["127.0.0.1:9001"], B: ["127.0.0.1:9002"], C: ["[::1]:9003"], R: ["h:1"], W: ["h:4"] },
      [0, 1, 5, 6, 7],
    );
    const groups = nativeLayerOwners(v, new Set());
    const entry = (layer: number, worker: string, addr: string, experts?: [number, number]) => ({
      layer,
      worker,
      addr,
      fp: FP,
      ...(experts ? { experts } : {}),
    });
    // layer 6: a gap (B does not hold 4, 5 there): off; layer 7 whole on W: no range
    expect(groups).toEqual([
      [
        entry(0, "A", "127.0.0.1:9001", [0, 4]),
        entry(0, "B", "127.0.0.1:9002", [4, 6]),
        entry(0, "C", "[::1]:9003", [6, 8]),
      ],
      [
        entry(5, "A", "127.0.0.1:9001", [0, 4]),
        entry(5, "B", "127.0.0.1:9002", [4, 6]),
        entry(5, "C", "[::1]:9003", [6, 8]),
      ],
      [entry(7, "W", "h:4")],
    ]);
    // one owner without a listener, or excluded: the whole layer off
    const noB = { ...v, native: new Map([...v.native].filter(([id]) => id !== "B")) };
    expect(nativeLayerOwners(noB, new Set()).map((g) => g[0]!.layer)).toEqual([7]);
    expect(nativeLayerOwners(v, new Set(["C"])).map((g) => g[0]!.layer)).toEqual([7]);
    // an owner of two runs (interleaved experts): off (the plugin takes one range per worker)
    const interleaved = view(
      [
        { id: "A", layers: [0], experts: [0, 1, 4, 5] },
        { id: "B", layers: [0], experts: [2, 3, 6, 7] },
      ],
      { A: ["h:1"], B: ["h:2"] },
      [0],
    );
    expect(nativeLayerOwners(interleaved, new Set())).toEqual([]);
    // wholeLayerOwners (phase 1) still lists only whole-layer owners
    expect(wholeLayerOwners(v, new Set()).map((c) => c.layer)).toEqual([7]);
  });

  it("the plane is off without a hub, under trust verify, with spot checks, or when turned off", () => {
    const on = { native: undefined, hub: true, trust: "own" as const, spotCheck: false };
    expect(nativeOffReason(on)).toBeUndefined();
    expect(nativeOffReason({ ...on, native: { deadlineMs: 50 } })).toBeUndefined();
    expect(nativeOffReason({ ...on, trust: "verify" })).toMatch(/verify/);
    expect(nativeOffReason({ ...on, spotCheck: true })).toMatch(/spot/);
    expect(nativeOffReason({ ...on, hub: false })).toMatch(/hub/);
    expect(nativeOffReason({ ...on, native: false })).toMatch(/off/);
  });

  it("the plugin's deadline: the option, else the hedge, else 5 s; never above the plugin's timeout", () => {
    expect(nativeDeadlineMs(undefined, undefined)).toBe(5000);
    expect(nativeDeadlineMs(true, 80)).toBe(320); // 4 hedge delays: the plugin hedges at 80
    expect(nativeDeadlineMs({ pluginTimeoutMs: 200 }, 80)).toBe(200);
    expect(nativeDeadlineMs(true, 0)).toBe(5000);
    expect(nativeDeadlineMs({ deadlineMs: 300 }, 80)).toBe(300);
    expect(nativeDeadlineMs({ pluginTimeoutMs: 2000 }, undefined)).toBe(2000);
    expect(nativeDeadlineMs({ deadlineMs: 9000, pluginTimeoutMs: 2000 }, undefined)).toBe(2000);
  });
});

describe("native options", () => {
  const io = { stdout: process.stdout, stderr: process.stderr };
  const base = ["--tcp", "127.0.0.1:0", "--hub", "https://hub.example", "--token", "t", "--model-id", "m"];

  it("moeswarm-dispatcher --no-native turns the plane off; without it the bridge's default (on) is left", () => {
    expect(readConfig(parse([...base, "--no-native"]).values, io).extra.native).toBe(false);
    expect(readConfig(parse(base).values, io).extra).not.toHaveProperty("native");
  });

  it("serveBackboneBridge refuses a malformed native option before anything starts", async () => {
    const placement = Placement.fromRegistrations([{ id: "w", model: "unit", layers: [0], experts: [0] }]);
    const transport = {
      request: async () => ({ mode: "each" as const, n: 0, k: 0, embd: 0, y: new Float32Array() }),
    };
    for (const native of [
      "yes",
      { deadlineMs: 0 },
      { pluginTimeoutMs: 1.5 },
      { backoff: { initialMs: -1 } },
    ]) {
      await expect(
        serveBackboneBridge({ socket: { port: 0 }, placement, transport, native: native as never }),
      ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    }
  });
});

describe("the plane on a plugin connection (fake timers)", () => {
  const T0 = Date.UTC(2026, 11, 2, 6, 0, 0);
  const TTL = 300_000;
  let tickets: string[];
  let ticketCalls: number;
  let failTickets: boolean;
  let current: NativePlacementView | undefined;
  let excluded: Set<string>;
  let routing: RoutingStats;
  let stop: AbortController;

  function plane(): NativePlane {
    return new NativePlane({
      backbone: "bb",
      deadlineMs: 250,
      routing,
      table: {
        backbone: "bb",
        deadlineMs: 250,
        view: () => current,
        exclude: () => excluded,
        ticket: async (worker) => {
          ticketCalls++;
          if (failTickets) throw new Error("hub down");
          const ticket = `mswt1.${worker}.${ticketCalls}`;
          tickets.push(ticket);
          return { ticket, exp: Date.now() + TTL };
        },
        signal: stop.signal,
      },
    });
  }

  beforeEach(() => {
    vi.useFakeTimers({ now: T0 });
    tickets = [];
    ticketCalls = 0;
    failTickets = false;
    current = view([{ id: "A", layers: [0, 1], experts: ALL }], { A: ["127.0.0.1:9001"] }, [0, 1, 2]);
    excluded = new Set();
    routing = new RoutingStats();
    stop = new AbortController();
  });
  afterEach(() => {
    stop.abort();
    vi.useRealTimers();
  });

  it("a hello gets the table at once, then the one with tickets; placement changes push again", async () => {
    const p = plane();
    const c = fakeConnection();
    p.onPayload(hello(), c.conn);
    // the first table goes out before any ticket is there: empty, seq 0
    expect(c.tables).toEqual([
      { v: 1, t: "native-table", seq: 0, backbone: "bb", deadlineMs: 250, layers: [] },
    ]);
    await vi.advanceTimersByTimeAsync(0);
    expect(ticketCalls).toBe(1);
    expect(c.tables).toHaveLength(2);
    expect(c.tables[1]).toEqual({
      v: 1,
      t: "native-table",
      seq: 1,
      backbone: "bb",
      deadlineMs: 250,
      layers: [0, 1].map((layer) => ({
        layer,
        worker: "A",
        addr: "127.0.0.1:9001",
        fp: FP,
        ticket: tickets[0],
        exp: T0 + TTL,
      })),
    });
    // nothing changed: nothing pushed
    p.refresh();
    expect(c.tables).toHaveLength(2);
    // a replica of layer 1 appears (phase 3): once its ticket is there, layer 1 goes to B (the
    // rotation: odd layers to the second copy by id) with A as its alt
    current = view(
      [
        { id: "A", layers: [0, 1], experts: ALL },
        { id: "B", layers: [1], experts: ALL },
      ],
      { A: ["127.0.0.1:9001"], B: ["127.0.0.1:9002"] },
    );
    p.refresh();
    await vi.advanceTimersByTimeAsync(0);
    expect(c.tables.at(-1)!.seq).toBe(2);
    expect(c.tables.at(-1)!.layers.map((e) => [e.layer, e.worker, e.alt?.worker])).toEqual([
      [0, "A", undefined],
      [1, "B", "A"],
    ]);
    // A quarantined (the next refresh, e.g. at the next receipts): layer 0 leaves, layer 1 stays on
    // B without an alt
    excluded = new Set(["A"]);
    p.refresh();
    expect(c.tables.at(-1)!.layers.map((e) => [e.layer, e.worker, e.alt?.worker])).toEqual([
      [1, "B", undefined],
    ]);
    // a closed connection gets nothing more
    c.close();
    excluded = new Set();
    p.refresh();
    await vi.advanceTimersByTimeAsync(0);
    expect(c.tables.at(-1)!.layers.map((e) => e.layer)).toEqual([1]);
    expect(p.metrics()).toMatchObject({
      enabled: true,
      connections: 0,
      table: { layers: [0, 1], workers: ["A", "B"], alts: ["A"] },
    });
  });

  it("tickets are renewed before they expire, and the new table goes out before exp", async () => {
    const p = plane();
    const c = fakeConnection();
    p.onPayload(hello(), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    expect(c.tables.at(-1)!.layers[0]!.ticket).toBe(tickets[0]);
    // 80% of the ticket's life: renewed
    await vi.advanceTimersByTimeAsync(TTL * 0.8 - 1);
    expect(ticketCalls).toBe(1);
    await vi.advanceTimersByTimeAsync(2);
    expect(ticketCalls).toBe(2);
    const renewed = c.tables.at(-1)!;
    expect(renewed.seq).toBe(2);
    expect(renewed.layers.map((e) => e.ticket)).toEqual([tickets[1], tickets[1]]);
    expect(renewed.layers[0]!.exp).toBe(T0 + TTL * 0.8 + TTL);
    expect(Date.now()).toBeLessThan(T0 + TTL);
  });

  it("a ticket the hub cannot mint keeps the layer out, retried with backoff; an expiring one is withdrawn", async () => {
    failTickets = true;
    const p = plane();
    const c = fakeConnection();
    p.onPayload(hello(), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    expect(ticketCalls).toBe(1);
    expect(c.tables).toHaveLength(1);
    await vi.advanceTimersByTimeAsync(999);
    expect(ticketCalls).toBe(1);
    await vi.advanceTimersByTimeAsync(1);
    expect(ticketCalls).toBe(2);
    // 2 s after the second failure
    await vi.advanceTimersByTimeAsync(1999);
    expect(ticketCalls).toBe(2);
    failTickets = false;
    await vi.advanceTimersByTimeAsync(1);
    expect(ticketCalls).toBe(3);
    expect(c.tables.at(-1)!.layers).toHaveLength(2);
    expect(p.metrics()).toMatchObject({ ticketErrors: 2, ticketsFetched: 1 });
    // renewals fail from now on: the entry leaves 5 s before its ticket expires
    failTickets = true;
    const exp = c.tables.at(-1)!.layers[0]!.exp;
    await vi.advanceTimersByTimeAsync(exp - 5000 - Date.now() - 1);
    expect(c.tables.at(-1)!.layers).toHaveLength(2);
    await vi.advanceTimersByTimeAsync(1);
    expect(c.tables.at(-1)!.layers).toEqual([]);
  });

  it("a ticket function or a placement that throws is counted, never thrown into the socket's handler", async () => {
    const p = new NativePlane({
      backbone: "bb",
      deadlineMs: 250,
      routing,
      table: {
        backbone: "bb",
        deadlineMs: 250,
        view: () => current,
        exclude: () => excluded,
        ticket: () => {
          throw new Error("at once");
        },
        signal: stop.signal,
      },
    });
    const c = fakeConnection();
    expect(() => p.onPayload(hello(), c.conn)).not.toThrow();
    await vi.advanceTimersByTimeAsync(0);
    expect(p.metrics()).toMatchObject({ ticketErrors: 1, table: { layers: [] } });
    current = {
      ...current!,
      placement: {
        owners: () => {
          throw new Error("broken");
        },
      } as never,
    };
    expect(() => p.onPayload(receipts(1, []), c.conn)).not.toThrow();
    expect(p.metrics().malformedCodes).toMatchObject({ internal: 1 });
  });

  it("receipts are the bridge's routing: tokens through the layer, expert-tokens to the worker", async () => {
    const p = plane();
    const c = fakeConnection();
    p.onPayload(hello(), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    p.onPayload(
      receipts(1, [
        { worker: "A", layer: 0, splits: 3, tokens: 5, expertTokens: 40 },
        { worker: "A", layer: 1, splits: 3, tokens: 5, expertTokens: 38 },
      ]),
      c.conn,
    );
    // a repeated seq on the connection is not counted twice
    p.onPayload(receipts(1, [{ worker: "A", layer: 0, splits: 3, tokens: 5, expertTokens: 40 }]), c.conn);
    const report = routing.takeReport(N_EXPERT);
    expect(report.receipts).toEqual({ A: { expertTokens: 78 } });
    expect(report.tokens).toBe(5);
    expect(p.metrics()).toMatchObject({
      splits: 6,
      tokens: 10,
      expertTokens: 78,
      receipts: 1,
      duplicates: 1,
      workers: { A: { splits: 6, expertTokens: 78 } },
    });
  });

  it("failures drop the worker for 1 s doubling, then it is back; fallbacks counted by code", async () => {
    const p = plane();
    const c = fakeConnection();
    p.onPayload(hello(), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    const layersNow = () => c.tables.at(-1)!.layers.map((e) => e.layer);
    expect(layersNow()).toEqual([0, 1]);
    const fail = (seq: number) =>
      p.onPayload(
        receipts(
          seq,
          [],
          [
            { worker: "A", code: "MOESWARM_TRANSPORT_CONNECT", msg: "refused" },
            { worker: "A", code: "MOESWARM_TRANSPORT_CONNECT", msg: "refused" },
            { worker: "A", code: "MOESWARM_NOT_A_CODE_WE_KNOW", msg: "?" },
          ].filter((_, i) => seq === 1 || i === 0),
        ),
        c.conn,
      );
    fail(1);
    expect(layersNow()).toEqual([]);
    expect(p.metrics()).toMatchObject({
      fallbacks: 3,
      failures: { MOESWARM_TRANSPORT_CONNECT: 2, other: 1 },
      dropped: ["A"],
      drops: 1,
    });
    await vi.advanceTimersByTimeAsync(999);
    expect(layersNow()).toEqual([]);
    await vi.advanceTimersByTimeAsync(1);
    expect(layersNow()).toEqual([0, 1]);
    // failing again after the backoff: 2 s this time
    fail(2);
    expect(layersNow()).toEqual([]);
    await vi.advanceTimersByTimeAsync(1999);
    expect(layersNow()).toEqual([]);
    await vi.advanceTimersByTimeAsync(1);
    expect(layersNow()).toEqual([0, 1]);
    // answered splits reset it: the next failure is 1 s again
    p.onPayload(receipts(3, [{ worker: "A", layer: 0, splits: 1, tokens: 1, expertTokens: 8 }]), c.conn);
    fail(4);
    await vi.advanceTimersByTimeAsync(1000);
    expect(layersNow()).toEqual([0, 1]);
    expect(p.metrics().drops).toBe(3);
  });

  it("a split layer is on the table with every owner's ticket, and off while any owner is dropped", async () => {
    current = view(
      [
        { id: "A", layers: [0], experts: [0, 1, 2, 3] },
        { id: "B", layers: [0], experts: [4, 5, 6, 7] },
        { id: "C", layers: [1], experts: ALL },
      ],
      { A: ["127.0.0.1:9001"], B: ["127.0.0.1:9002"], C: ["127.0.0.1:9003"] },
      [0, 1],
    );
    const p = plane();
    const c = fakeConnection();
    p.onPayload(hello(), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    expect(ticketCalls).toBe(3);
    const last = () => c.tables.at(-1)!;
    expect(last().layers.map(({ layer, worker, experts }) => ({ layer, worker, experts }))).toEqual([
      { layer: 0, worker: "A", experts: [0, 4] },
      { layer: 0, worker: "B", experts: [4, 8] },
      { layer: 1, worker: "C", experts: undefined },
    ]);
    for (const e of last().layers) expect(e.ticket).toMatch(new RegExp(`^mswt1\\.${e.worker}\\.`));
    expect(p.metrics().table).toMatchObject({ layers: [0, 1], workers: ["A", "B", "C"] });
    // B fails: layer 0 leaves whole (A's ids alone would not cover it), layer 1 stays
    p.onPayload(receipts(1, [], [{ worker: "B", code: "MOESWARM_TRANSPORT_TIMEOUT", msg: "late" }]), c.conn);
    expect(last().layers.map((e) => e.layer)).toEqual([1]);
    await vi.advanceTimersByTimeAsync(1000);
    expect(last().layers.map((e) => `${e.layer}:${e.worker}`)).toEqual(["0:A", "0:B", "1:C"]);
    // receipts of a split layer credit each owner with its own expert-tokens; the layer's tokens
    // and splits come once per split from `layers` (3 splits of 1 token: A in 2, B in 3)
    p.onPayload(
      encode({
        v: 1,
        t: "native-receipts",
        seq: 2,
        counts: [
          { worker: "A", layer: 0, splits: 2, tokens: 2, expertTokens: 5 },
          { worker: "B", layer: 0, splits: 3, tokens: 3, expertTokens: 3 },
          { worker: "C", layer: 1, splits: 3, tokens: 3, expertTokens: 24 },
        ],
        layers: [{ layer: 0, splits: 3, tokens: 3 }],
        failures: [],
        // the router's choices in those splits (an id the model lacks is left out of the report)
        routing: [
          { layer: 0, experts: [1, 5], counts: [5, 3] },
          { layer: 1, experts: [2, N_EXPERT + 5], counts: [24, 9] },
        ],
      }),
      c.conn,
    );
    expect(p.metrics()).toMatchObject({
      splits: 6,
      tokens: 6,
      expertTokens: 32,
      workers: { A: { splits: 2, expertTokens: 5 }, B: { splits: 3, expertTokens: 3 } },
    });
    const report = routing.takeReport(N_EXPERT);
    expect(report.tokens).toBe(3);
    expect([report.counts["0"]![1], report.counts["0"]![5], report.counts["1"]![2]]).toEqual([5, 3, 24]);
    expect(
      Object.values(report.counts)
        .flat()
        .reduce((a, b) => a + b, 0),
    ).toBe(32);
    expect(report.receipts).toMatchObject({
      A: { expertTokens: 5 },
      B: { expertTokens: 3 },
      C: { expertTokens: 24 },
    });
    // a malformed `layers` drops the receipts whole
    const before = p.metrics().malformed;
    p.onPayload(
      encode({
        v: 1,
        t: "native-receipts",
        seq: 3,
        counts: [],
        layers: [{ layer: 0, splits: 2, tokens: 1 }],
      }),
      c.conn,
    );
    expect(p.metrics().malformed).toBe(before + 1);
  });

  it("malformed frames are counted and dropped; the plane reads on", async () => {
    const p = plane();
    const c = fakeConnection();
    p.onPayload(hello(), c.conn);
    await vi.advanceTimersByTimeAsync(0);
    const bad = [
      new Uint8Array([0xc1]),
      encode([1, 2, 3]),
      encode({ v: 2, t: "native-receipts", seq: 1, counts: [] }),
      encode({ v: 1, t: "native-table", seq: 1 }),
      receipts(1, [{ worker: "A", layer: 0, splits: -1, tokens: 1, expertTokens: 1 }]),
      receipts(1, [{ worker: "A", layer: 0, splits: 1, tokens: 1 }]),
      receipts(1, [{ worker: "", layer: 0, splits: 1, tokens: 1, expertTokens: 1 }]),
      receipts(1, [{ worker: "A", layer: 0, splits: 9, tokens: 1, expertTokens: 1 }]),
      receipts(1, [], [{ worker: "A", code: "not a code", msg: "" }]),
      encode({ v: 1, t: "native-receipts", seq: "1", counts: [] }),
      encode({ v: 1, t: "native-hello" }),
    ];
    for (const b of bad) p.onPayload(b, c.conn);
    const m = p.metrics();
    expect(m.malformed).toBe(bad.length);
    expect(m.malformedCodes).toMatchObject({
      MOESWARM_PROTOCOL_MALFORMED: 2,
      MOESWARM_PROTOCOL_VERSION: 1,
      MOESWARM_PROTOCOL_UNKNOWN_TYPE: 1,
      MOESWARM_PROTOCOL_MISSING_FIELD: 2,
      MOESWARM_PROTOCOL_BAD_FIELD: 5,
    });
    // nothing was counted or dropped, and good receipts still work
    expect(m).toMatchObject({ splits: 0, receipts: 0, dropped: [] });
    p.onPayload(receipts(1, [{ worker: "A", layer: 0, splits: 1, tokens: 1, expertTokens: 8 }]), c.conn);
    expect(p.metrics()).toMatchObject({ splits: 1, expertTokens: 8 });
  });

  it("decodes what it checks: unknown keys are ignored, the msg is cut to 16000 characters", () => {
    const f = decodeNativeFrame(
      encode({
        v: 1,
        t: "native-receipts",
        seq: 7,
        extra: { future: true },
        counts: [{ worker: "A", layer: 3, splits: 1, tokens: 2, expertTokens: 16, more: 1 }],
        failures: [{ worker: "A", code: "MOESWARM_TRANSPORT_TIMEOUT", msg: "x".repeat(20_000) }],
      }),
    );
    expect(f).toMatchObject({
      t: "native-receipts",
      seq: 7,
      counts: [{ worker: "A", layer: 3, expertTokens: 16 }],
    });
    expect((f as { failures: Array<{ msg: string }> }).failures[0]!.msg).toHaveLength(16_000);
  });
});

describe("the plugin socket of a real bridge", () => {
  it("a native-hello gets an (empty, plane off) table; malformed native frames are survived; dispatches are answered", async () => {
    const tmp = tempDir("mswb-native-");
    const calls = { n: 0 };
    const placement = Placement.fromRegistrations([
      { id: "w", model: "unit", layers: [0], experts: [0, 1, 2] },
    ]);
    const worker = toyWorker(calls);
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "b.sock"),
      placement,
      transport: { trusted: true, request: async (_owner, req, opts) => worker(req, opts) },
    });
    expect(bridge.metrics().native).toMatchObject({ enabled: false, off: expect.stringMatching(/hub/) });
    const socket = connect(bridge.address.slice("unix:".length));
    const reader = new FrameReader({ maxFrameBytes: 1 << 20 });
    const frames: Uint8Array[] = [];
    const waiters: Array<() => void> = [];
    socket.on("data", (d) => {
      frames.push(...reader.push(d));
      for (const w of waiters.splice(0)) w();
    });
    const next = async () => {
      while (frames.length === 0) await new Promise<void>((r) => waiters.push(r));
      return frames.shift()!;
    };
    await new Promise<void>((r) => socket.once("connect", () => r()));
    socket.write(encodeLengthPrefixed(hello()));
    const table = decode(await next()) as NativeTableFrame;
    expect(table).toMatchObject({ t: "native-table", seq: 0, layers: [] });
    socket.write(encodeLengthPrefixed(encode({ v: 1, t: "native-receipts", seq: "x" })));
    socket.write(
      encodeLengthPrefixed(receipts(1, [{ worker: "w", layer: 0, splits: 1, tokens: 1, expertTokens: 2 }])),
    );
    socket.write(encodeLengthPrefixed(toyFrame(7)));
    const answer = decodeFrame(await next(), { copy: true });
    expect(answer).toMatchObject({ t: "result", id: 7, n: 3 });
    expect(calls.n).toBe(1);
    const m = bridge.metrics();
    expect(m.native).toMatchObject({ malformed: 1, receipts: 1, expertTokens: 2 });
    // no error frame went back for the native frames, and the bridge counts no failure
    expect(m.failed).toBe(0);
    expect(frames).toHaveLength(0);
    socket.destroy();
    tmp.remove();
  });
});

// The backbone plugin's native data plane (issue #15, spec C): llama.cpp + libggml-moeswarm.so
// sending whole-layer splits straight to a worker over TLS when the bridge's native-table says so,
// and through the bridge on any failure. Every run's logits are compared byte for byte with plain
// llama.cpp (no plugin), whose own CPU kernels are the independent reference.
import { X509Certificate } from "node:crypto";
import { join } from "node:path";
import {
  findExpertTensors,
  readGguf,
  sliceExperts,
  synthesizeMoeModel,
  syntheticPreset,
} from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  type ExpertCompute,
  loadExpertCompute,
  type NativeServer,
  nativeSliceOf,
  serveNative,
} from "../src/index.js";
import {
  firstByteDiff,
  type NativeTable,
  type PluginRun,
  pluginMissing,
  runLogits,
  type StandInBridge,
  type StandInWorker,
  selfSigned,
  setUpWholeSlice,
  startBridge,
  startWorker,
  type WorkerMode,
} from "./plugin-native-fixture.js";

const missing = pluginMissing();
if (missing) console.warn(`plugin-native tests skipped: ${missing}`);

const N_PREDICT = 8;
const BACKBONE = "bb-native";
const TICKET = "mswt1.test-claims.test-signature";

describe.skipIf(Boolean(missing))("plugin: native splits to a worker, the bridge on any doubt", () => {
  const tmp = tempDir("mswn-nat-");
  let model: string;
  let layers: number[];
  let compute: ExpertCompute;
  let cert: { cert: string; key: string };
  let otherCert: { cert: string; key: string };
  let plain: PluginRun;
  let nExpert: number;
  let runs = 0;

  beforeAll(async () => {
    const set = await setUpWholeSlice(tmp.dir, N_PREDICT);
    ({ model, layers, nExpert, compute, plain } = set);
    [cert, otherCert] = set.certs;
    expect(plain.ok, plain.stderr).toBe(true);
  });
  afterAll(async () => {
    await compute?.close();
    tmp.remove();
  });

  const table = (w: StandInWorker, extra: Partial<NativeTable> = {}, fp = w.fingerprint): NativeTable => ({
    backbone: BACKBONE,
    deadlineMs: 5000,
    layers: layers.map((layer) => ({
      layer,
      worker: "w1",
      addr: w.addr,
      fp,
      ticket: TICKET,
      exp: Date.now() + 3_600_000,
    })),
    ...extra,
  });

  async function decode(bridge: StandInBridge, env?: Record<string, string>) {
    const run = await runLogits({
      model,
      dir: tmp.dir,
      name: `run${++runs}`,
      nPredict: N_PREDICT,
      bridge: bridge.address,
      ...(env ? { env } : {}),
    });
    expect(run.ok, run.stderr).toBe(true);
    expect(run.tokens).toEqual(plain.tokens);
    expect(firstByteDiff(run.logits, plain.logits)).toBe(-1);
    return run;
  }

  it("a table entry for every layer: the same bytes, the worker computes every split after the first, receipts match", async () => {
    await using worker = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "ok.sock"), compute);
    bridge.setTable(table(worker));
    const run = await decode(bridge);
    const stats = run.plugin!;
    expect(stats.splits).toBe((N_PREDICT + 1) * layers.length);
    expect(stats.native.splits + bridge.dispatches.length).toBe(stats.splits);
    // the table is pushed in answer to native-hello, sent when the backend connects (context creation):
    // at most the very first split can have started before it arrived
    expect(bridge.dispatches.length).toBeLessThanOrEqual(1);
    if (bridge.dispatches.length === 1) expect(bridge.dispatches[0]!.layer).toBe(layers[0]);
    expect(stats.native.fallbacks).toBe(0);
    expect(stats.native.roundTripP50Us).toBeGreaterThan(0);
    expect(bridge.hellos).toHaveLength(1);
    expect(worker.connections).toBe(1);
    expect(worker.hellos).toEqual([{ id: BACKBONE, token: TICKET }]);

    // receipts: what the worker answered, per (worker, layer), summed over every receipt
    const got = new Map<number, { splits: number; tokens: number; expertTokens: number }>();
    for (const r of bridge.receipts) {
      expect(r.failures).toEqual([]);
      for (const c of r.counts) {
        expect(c.worker).toBe("w1");
        const s = got.get(c.layer) ?? { splits: 0, tokens: 0, expertTokens: 0 };
        got.set(c.layer, {
          splits: s.splits + c.splits,
          tokens: s.tokens + c.tokens,
          expertTokens: s.expertTokens + c.expertTokens,
        });
      }
    }
    expect(got).toEqual(worker.served);
    expect([...worker.served.values()].reduce((a, s) => a + s.splits, 0)).toBe(stats.native.splits);
    // routing: the receipts' per-expert counts are the ids the worker was sent (each filled slot)
    const key = (layer: number, expert: number) => `${layer}:${expert}`;
    const sent = new Map<string, number>();
    for (const d of worker.dispatches)
      for (const id of d.ids)
        if (id !== -1) sent.set(key(d.layer, id), (sent.get(key(d.layer, id)) ?? 0) + 1);
    const routed = new Map<string, number>();
    for (const r of bridge.receipts.flatMap((x) => x.routing ?? []))
      for (const [i, e] of r.experts.entries()) {
        routed.set(key(r.layer, e), (routed.get(key(r.layer, e)) ?? 0) + r.counts[i]!);
      }
    expect(routed.size).toBeGreaterThan(0);
    expect(routed).toEqual(sent);
    // seq rises from 1; no split layers
    expect(bridge.receipts.map((r) => r.seq)).toEqual(bridge.receipts.map((_, i) => i + 1));
    for (const r of bridge.receipts) expect(r.layers).toBeUndefined();
  });

  const FAILURES: { mode: WorkerMode | "pin"; code: string }[] = [
    { mode: "refuse-hello", code: "MOESWARM_AUTH_TICKET_INVALID" },
    { mode: "error-frame", code: "MOESWARM_WORKER_DRAINING" },
    { mode: "nan", code: "MOESWARM_DISPATCH_BAD_RESULT" },
    { mode: "silent", code: "MOESWARM_TRANSPORT_TIMEOUT" },
    { mode: "pin", code: "MOESWARM_TRANSPORT_PIN_MISMATCH" },
  ];
  for (const f of FAILURES) {
    it(`a worker that fails (${f.mode}): every split completes through the bridge, ${f.code} reported, redials backed off`, async () => {
      await using worker = await startWorker(cert, compute, f.mode === "pin" ? "ok" : f.mode);
      await using bridge = await startBridge(join(tmp.dir, `${f.mode}.sock`), compute);
      // pin: the table names another certificate than the one the worker presents
      const fp = f.mode === "pin" ? new X509Certificate(otherCert.cert).fingerprint256 : worker.fingerprint;
      bridge.setTable(table(worker, { deadlineMs: 300 }, fp));
      const t0 = performance.now();
      const run = await decode(bridge);
      const elapsedS = (performance.now() - t0) / 1000;
      const stats = run.plugin!;
      expect(stats.native.splits).toBe(0);
      expect(bridge.dispatches).toHaveLength(stats.splits);
      expect(stats.native.fallbacks).toBeGreaterThanOrEqual(1);
      expect(stats.native.failures).toEqual({ [f.code]: stats.native.fallbacks });
      // one dial per failure, and no more than a 1 s doubling backoff allows in the run's time
      expect(worker.connections).toBe(stats.native.fallbacks);
      expect(worker.connections).toBeLessThanOrEqual(Math.floor(Math.log2(elapsedS + 1)) + 1);
      const failures = bridge.receipts.flatMap((r) => r.failures);
      expect(failures).toHaveLength(stats.native.fallbacks);
      for (const x of failures) expect(x).toMatchObject({ worker: "w1", code: f.code });
      expect(bridge.receipts.flatMap((r) => r.counts)).toEqual([]);
    });
  }

  it("a worker that keeps refusing: dialed again after 1 s, then after 2 s (the backoff doubles)", async () => {
    await using worker = await startWorker(cert, compute, "refuse-hello");
    // 100 ms per bridge answer: the decode's splits take at least 3.5 s
    await using bridge = await startBridge(join(tmp.dir, "slow.sock"), compute, { delayMs: 100 });
    bridge.setTable(table(worker));
    const t0 = performance.now();
    const run = await decode(bridge);
    const elapsedS = (performance.now() - t0) / 1000;
    expect(elapsedS).toBeGreaterThan(3.5);
    // dials at about 0, 1 and 3 s (and 7, 15... for a longer run); a backoff that did not double
    // would dial at 0, 1, 2, 3
    expect(worker.connections).toBeGreaterThanOrEqual(2);
    expect(worker.connections).toBeLessThanOrEqual(Math.floor(Math.log2(elapsedS + 1)) + 1);
    expect(run.plugin!.native.failures).toEqual({ MOESWARM_AUTH_TICKET_INVALID: worker.connections });
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits);
  });

  it("a bridge older than the native plane (native-hello refused as an unknown type): every split through it", async () => {
    await using worker = await startWorker(cert, compute, "ok");
    // its refusal comes 50 ms after the hello, while a split waits (its answers take 20 ms each)
    await using bridge = await startBridge(join(tmp.dir, "legacy.sock"), compute, {
      legacy: true,
      delayMs: 20,
    });
    const run = await decode(bridge);
    expect(bridge.hellos).toHaveLength(1);
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits);
    expect(run.plugin!.failures).toBe(0);
    expect(worker.connections).toBe(0);
  });

  it("an expired ticket: no dial (the bridge renews tickets and pushes a new table), every split through the bridge", async () => {
    await using worker = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "exp.sock"), compute);
    const t = table(worker);
    bridge.setTable({ ...t, layers: t.layers.map((e) => ({ ...e, exp: Date.now() - 1000 })) });
    const run = await decode(bridge);
    expect(worker.connections).toBe(0);
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits);
    expect(run.plugin!.native).toMatchObject({ splits: 0, fallbacks: 0 });
  });

  it("MOESWARM_NATIVE=0: no native-hello, every split through the bridge", async () => {
    await using worker = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "off.sock"), compute);
    bridge.setTable(table(worker));
    const run = await decode(bridge, { MOESWARM_NATIVE: "0" });
    expect(bridge.hellos).toEqual([]);
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits);
    expect(run.plugin!.native.splits).toBe(0);
    expect(worker.connections).toBe(0);
    expect(bridge.receipts).toEqual([]);
  });

  // phase 2: a layer's experts over several workers, one entry per worker with its `experts` range
  const rangedTable = (
    owners: { w: StandInWorker; id: string; experts: [number, number] }[],
    deadlineMs = 5000,
  ) => {
    const exp = Date.now() + 3_600_000;
    return {
      backbone: BACKBONE,
      deadlineMs,
      layers: layers.flatMap((layer) =>
        owners.map((o) => ({
          layer,
          worker: o.id,
          addr: o.w.addr,
          fp: o.w.fingerprint,
          ticket: TICKET,
          exp,
          experts: o.experts,
        })),
      ),
    };
  };

  /** Every dispatch a stand-in got was mode each, compact, with a filled slot and only ids of its range. */
  function expectOwnIds(w: StandInWorker, [lo, hi]: [number, number]) {
    for (const d of w.dispatches) {
      expect(d).toMatchObject({ mode: "each", compact: true });
      expect(d.ids.some((id) => id !== -1)).toBe(true);
      for (const id of d.ids)
        if (id !== -1) expect(id >= lo && id < hi, `id ${id} sent to [${lo}, ${hi})`).toBe(true);
    }
  }

  /** The receipts' counts of one worker, summed per layer. */
  function receiptsOf(bridge: StandInBridge, worker: string) {
    const got = new Map<number, { splits: number; tokens: number; expertTokens: number }>();
    for (const c of bridge.receipts.flatMap((r) => r.counts)) {
      if (c.worker !== worker) continue;
      const s = got.get(c.layer) ?? { splits: 0, tokens: 0, expertTokens: 0 };
      got.set(c.layer, {
        splits: s.splits + c.splits,
        tokens: s.tokens + c.tokens,
        expertTokens: s.expertTokens + c.expertTokens,
      });
    }
    return got;
  }

  it("two workers with half the experts each: the same bytes, mode-each dispatches of their own ids, receipts per worker", async () => {
    const h = nExpert / 2;
    await using w1 = await startWorker(cert, compute, "ok");
    await using w2 = await startWorker(otherCert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "halves.sock"), compute);
    bridge.setTable(
      rangedTable([
        { w: w1, id: "w1", experts: [0, h] },
        { w: w2, id: "w2", experts: [h, nExpert] },
      ]),
    );
    const run = await decode(bridge);
    const stats = run.plugin!;
    expect(bridge.dispatches.length).toBeLessThanOrEqual(1);
    expect(stats.native.splits + bridge.dispatches.length).toBe(stats.splits);
    expect(stats.native.fallbacks).toBe(0);
    expect(stats.native.roundTripP50Us).toBeGreaterThan(0);
    expect([w1.connections, w2.connections]).toEqual([1, 1]);
    expectOwnIds(w1, [0, h]);
    expectOwnIds(w2, [h, nExpert]);
    // top-8 of 64: every native split has ids in both halves, so each worker took part in each
    expect(w1.dispatches.length + w2.dispatches.length).toBeGreaterThan(stats.native.splits);
    expect(bridge.receipts.flatMap((r) => r.failures)).toEqual([]);
    expect(receiptsOf(bridge, "w1")).toEqual(w1.served);
    expect(receiptsOf(bridge, "w2")).toEqual(w2.served);
    // the split layers' own count: each native split once, with all its tokens (>= each owner's)
    const perLayer = new Map<number, { splits: number; tokens: number }>();
    for (const l of bridge.receipts.flatMap((r) => r.layers ?? [])) {
      const x = perLayer.get(l.layer) ?? { splits: 0, tokens: 0 };
      perLayer.set(l.layer, { splits: x.splits + l.splits, tokens: x.tokens + l.tokens });
    }
    expect([...perLayer.values()].reduce((a, l) => a + l.splits, 0)).toBe(stats.native.splits);
    for (const [layer, l] of perLayer) {
      expect(l.tokens).toBeGreaterThanOrEqual(w1.served.get(layer)?.tokens ?? 0);
      expect(l.tokens).toBeGreaterThanOrEqual(w2.served.get(layer)?.tokens ?? 0);
    }
    // every token's k filled slots (llama.cpp fills all k) went to the two of them, each slot once
    const k = w1.dispatches[0]!.ids.length / w1.dispatches[0]!.n;
    const slotsSent = [...w1.served.values(), ...w2.served.values()].reduce((a, s) => a + s.expertTokens, 0);
    expect(k).toBe(8);
    expect(slotsSent % k).toBe(0);
    expect(slotsSent).toBeGreaterThanOrEqual(k * stats.native.splits);
    console.info(
      `native split over 2 workers: round trip p50 ${stats.native.roundTripP50Us} us, overhead p50 ${stats.native.overheadP50Us} us`,
    );
  });

  const SPLIT_FAILURES: { mode: WorkerMode; code: string }[] = [
    { mode: "nan", code: "MOESWARM_DISPATCH_BAD_RESULT" },
    { mode: "error-frame", code: "MOESWARM_WORKER_DRAINING" },
    { mode: "silent", code: "MOESWARM_TRANSPORT_TIMEOUT" },
  ];
  for (const f of SPLIT_FAILURES) {
    it(`one of two workers fails once (${f.mode}): that split through the bridge, ${f.code} reported, native splits go on right`, async () => {
      const h = nExpert / 2;
      await using w1 = await startWorker(cert, compute, "ok");
      await using w2 = await startWorker(otherCert, compute, f.mode);
      w2.failOn = 3;
      // 100 ms per bridge answer: the 1 s backoff ends well before the decode does
      await using bridge = await startBridge(join(tmp.dir, `split-${f.mode}.sock`), compute, {
        delayMs: 100,
      });
      bridge.setTable(
        rangedTable(
          [
            { w: w1, id: "w1", experts: [0, h] },
            { w: w2, id: "w2", experts: [h, nExpert] },
          ],
          300,
        ),
      );
      const run = await decode(bridge);
      const stats = run.plugin!;
      expect(stats.native.fallbacks).toBe(1);
      expect(stats.native.failures).toEqual({ [f.code]: 1 });
      expect(bridge.receipts.flatMap((r) => r.failures)).toEqual([
        expect.objectContaining({ worker: "w2", code: f.code }),
      ]);
      expect(stats.native.splits + bridge.dispatches.length).toBe(stats.splits);
      // native splits again after the backoff: w2 dialed twice; w1's link, mid-exchange when w2
      // failed or already answered, was reopened or kept, and every later answer was its own (the bytes)
      expect(w2.connections).toBe(2);
      expect(w1.connections).toBeLessThanOrEqual(2);
      expect(stats.native.splits).toBeGreaterThan(2);
      expect(w2.dispatches.length).toBeGreaterThan(3);
      expectOwnIds(w1, [0, h]);
      expectOwnIds(w2, [h, nExpert]);
      // receipts count native splits only: w1's answer to the failed split (if it came) is not one
      const splitsOf = (m: Map<number, { splits: number }>) =>
        [...m.values()].reduce((a, s) => a + s.splits, 0);
      expect(splitsOf(receiptsOf(bridge, "w1"))).toBe(stats.native.splits);
      expect(splitsOf(w1.served) - stats.native.splits).toBeGreaterThanOrEqual(0);
      expect(splitsOf(w1.served) - stats.native.splits).toBeLessThanOrEqual(1);
    });
  }

  it("two real native listeners (the addon's, llama-cpu) with half the experts each: the same bytes, served counts match", async () => {
    const h = nExpert / 2;
    const halves: [number, number][] = [
      [0, h],
      [h, nExpert],
    ];
    const computes: ExpertCompute[] = [];
    const servers: NativeServer[] = [];
    try {
      for (const [i, [lo, hi]] of halves.entries()) {
        const path = join(tmp.dir, `half${i}.gguf`);
        const slice = await sliceExperts(model, {
          layers,
          experts: [...Array(hi - lo).keys()].map((e) => e + lo),
        });
        await slice.write(path);
        await slice.close();
        const c = await loadExpertCompute(path, { backend: "llama-cpu", threads: 1 });
        computes.push(c);
        const tls = i === 0 ? cert : otherCert;
        const s = await serveNative({
          host: "127.0.0.1",
          ...tls,
          id: `w${i + 1}`,
          compute: "llama-cpu",
          admit: (backbone, ticket) => {
            if (backbone !== BACKBONE || ticket !== TICKET) throw new Error("not this ticket");
          },
        });
        servers.push(s);
        const slice0 = nativeSliceOf(c);
        expect(slice0).toBeDefined();
        expect(
          s.setRoutes(layers.map((layer) => ({ model: "native-test", layer, slice: slice0! }))),
        ).toHaveLength(layers.length);
      }
      await using bridge = await startBridge(join(tmp.dir, "real.sock"), compute);
      const exp = Date.now() + 3_600_000;
      bridge.setTable({
        backbone: BACKBONE,
        deadlineMs: 5000,
        layers: layers.flatMap((layer) =>
          servers.map((s, i) => ({
            layer,
            worker: `w${i + 1}`,
            addr: `127.0.0.1:${s.port}`,
            fp: s.fingerprint,
            ticket: TICKET,
            exp,
            experts: halves[i]!,
          })),
        ),
      });
      const run = await decode(bridge);
      const stats = run.plugin!;
      expect(stats.native.fallbacks).toBe(0);
      expect(bridge.dispatches.length).toBeLessThanOrEqual(1);
      expect(stats.native.splits + bridge.dispatches.length).toBe(stats.splits);
      for (const [i, s] of servers.entries()) {
        const served = s.takeServed();
        const counts = bridge.receipts.flatMap((r) => r.counts).filter((c) => c.worker === `w${i + 1}`);
        const sum = (k: "splits" | "expertTokens") => counts.reduce((a, c) => a + c[k], 0);
        expect(served).toEqual([
          {
            backbone: BACKBONE,
            model: "native-test",
            requests: sum("splits"),
            expertTokens: sum("expertTokens"),
          },
        ]);
      }
      console.info(
        `native split over 2 real listeners: round trip p50 ${stats.native.roundTripP50Us} us, overhead p50 ${stats.native.overheadP50Us} us`,
      );
    } finally {
      for (const s of servers) s.close();
      for (const c of computes) await c.close();
    }
  });

  it("a table whose ranges overlap is rejected whole: no dial, every split through the bridge", async () => {
    const h = nExpert / 2;
    await using w1 = await startWorker(cert, compute, "ok");
    await using w2 = await startWorker(otherCert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "overlap.sock"), compute);
    bridge.setTable(
      rangedTable([
        { w: w1, id: "w1", experts: [0, h + 1] },
        { w: w2, id: "w2", experts: [h, nExpert] },
      ]),
    );
    const run = await decode(bridge);
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits);
    expect(run.plugin!.native).toMatchObject({ splits: 0, fallbacks: 0 });
    expect([w1.connections, w2.connections]).toEqual([0, 0]);
  });

  it("a split with an id no entry covers goes through the bridge (not a failure); covered ones go native", async () => {
    // w1 alone, the lower three quarters: a split of top-8 of 64 has an id above now and then
    const q = (nExpert * 3) / 4;
    await using w1 = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "uncovered.sock"), compute);
    bridge.setTable(rangedTable([{ w: w1, id: "w1", experts: [0, q] }]));
    const run = await decode(bridge);
    const stats = run.plugin!;
    expect(bridge.dispatches.length).toBeGreaterThan(1);
    expect(stats.native.splits + bridge.dispatches.length).toBe(stats.splits);
    expect(stats.native.fallbacks).toBe(0);
    expect(bridge.receipts.flatMap((r) => r.failures)).toEqual([]);
    expectOwnIds(w1, [0, q]);
    // w1 got whole splits only: every one of its dispatches was a native split
    expect(w1.dispatches).toHaveLength(stats.native.splits);
  });

  it("a table replaced by an empty one: native splits stop there", async () => {
    const AFTER = 10;
    await using worker = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "empty.sock"), compute);
    bridge.setTable(table(worker));
    // before the worker's AFTER-th answer is written, so the empty table is in the plugin's socket
    // before that split returns and the next split's drain finds it
    worker.onAnswer = (n) => {
      if (n === AFTER) bridge.setTable({ backbone: BACKBONE, deadlineMs: 5000, layers: [] });
    };
    const run = await decode(bridge);
    expect(run.plugin!.native.splits).toBe(AFTER);
    expect(bridge.dispatches).toHaveLength(run.plugin!.splits - AFTER);
    const counted = bridge.receipts.flatMap((r) => r.counts).reduce((a, c) => a + c.splits, 0);
    expect(counted).toBe(AFTER);
  });
});

// llama4 (weight_before_ffn): the plugin sends k weighted rows per token with weight 1 and adds the
// k answers in slot order itself (moeswarm_sum_rows); the native path writes them the same way
describe.skipIf(Boolean(missing))("plugin: native splits of llama4's weighted-input layers", () => {
  const tmp = tempDir("mswn-nat4-");
  let model: string;
  let layers: number[];
  let nExpert: number;
  let compute: ExpertCompute;
  let cert: { cert: string; key: string };
  let plain: PluginRun;

  beforeAll(async () => {
    // top-2 (Llama 4 ships top-1): two weighted rows per token, added back by the plugin
    model = join(tmp.dir, "llama4-top2.gguf");
    await synthesizeMoeModel({ ...syntheticPreset("tiny", "llama4"), nExpertUsed: 2 }, model);
    const layout = findExpertTensors(await readGguf(model));
    layers = layout.layers.map((l) => l.layer);
    nExpert = layout.layers[0]!.nExpert;
    const slicePath = join(tmp.dir, "all.gguf");
    const slice = await sliceExperts(model, { layers, experts: [...Array(nExpert).keys()] });
    await slice.write(slicePath);
    await slice.close();
    compute = await loadExpertCompute(slicePath, { backend: "llama-cpu", threads: 1 });
    cert = await selfSigned();
    plain = await runLogits({ model, dir: tmp.dir, name: "plain", nPredict: N_PREDICT });
    expect(plain.ok, plain.stderr).toBe(true);
  });
  afterAll(async () => {
    await compute?.close();
    tmp.remove();
  });

  const entry = (layer: number, w: StandInWorker, worker: string, experts?: [number, number]) => ({
    layer,
    worker,
    addr: w.addr,
    fp: w.fingerprint,
    ticket: TICKET,
    exp: Date.now() + 3_600_000,
    ...(experts ? { experts } : {}),
  });

  async function run(bridge: StandInBridge, name: string) {
    const r = await runLogits({ model, dir: tmp.dir, name, nPredict: N_PREDICT, bridge: bridge.address });
    expect(r.ok, r.stderr).toBe(true);
    expect(r.tokens).toEqual(plain.tokens);
    expect(firstByteDiff(r.logits, plain.logits)).toBe(-1);
    expect(r.plugin!.splits).toBe((N_PREDICT + 1) * layers.length);
    expect(bridge.dispatches.length).toBeLessThanOrEqual(1);
    expect(r.plugin!.native.splits + bridge.dispatches.length).toBe(r.plugin!.splits);
    return r;
  }

  it("top-2: the same bytes as plain llama.cpp, every split after the first native", async () => {
    await using worker = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "l4.sock"), compute);
    bridge.setTable({
      backbone: BACKBONE,
      deadlineMs: 5000,
      layers: layers.map((l) => entry(l, worker, "w1")),
    });
    await run(bridge, "native");
  });

  it("top-2 over two workers with half the experts each: one row per slot, the same bytes", async () => {
    const h = nExpert / 2;
    await using w1 = await startWorker(cert, compute, "ok");
    await using w2 = await startWorker(await selfSigned(), compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "l4-halves.sock"), compute);
    bridge.setTable({
      backbone: BACKBONE,
      deadlineMs: 5000,
      layers: layers.flatMap((l) => [entry(l, w1, "w1", [0, h]), entry(l, w2, "w2", [h, nExpert])]),
    });
    const r = await run(bridge, "halves");
    expect(r.plugin!.native.fallbacks).toBe(0);
    // weighted input: one slot per row (k 1), each row sent to the owner of its slot only
    for (const [w, lo, hi] of [
      [w1, 0, h],
      [w2, h, nExpert],
    ] as const) {
      for (const d of w.dispatches) {
        expect(d).toMatchObject({ mode: "each", compact: true });
        expect(d.ids).toHaveLength(d.n);
        for (const id of d.ids) expect(id >= lo && id < hi).toBe(true);
      }
    }
    expect(w1.dispatches.length + w2.dispatches.length).toBeGreaterThanOrEqual(r.plugin!.native.splits);
  });
});

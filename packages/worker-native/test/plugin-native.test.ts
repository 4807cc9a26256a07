// The backbone plugin's native data plane (issue #15, spec C): llama.cpp + libggml-moeswarm.so
// sending whole-layer splits straight to a worker over TLS when the bridge's native-table says so,
// and through the bridge on any failure. Every run's logits are compared byte for byte with plain
// llama.cpp (no plugin), whose own CPU kernels are the independent reference.
import { X509Certificate } from "node:crypto";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  ensureSyntheticModel,
  findExpertTensors,
  readGguf,
  sliceExperts,
  synthesizeMoeModel,
  syntheticPreset,
} from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type ExpertCompute, loadExpertCompute } from "../src/index.js";
import {
  type NativeTable,
  type PluginRun,
  pluginMissing,
  runLogits,
  type StandInBridge,
  type StandInWorker,
  selfSigned,
  startBridge,
  startWorker,
  type WorkerMode,
} from "./plugin-native-fixture.js";

const missing = pluginMissing();
if (missing) console.warn(`plugin-native tests skipped: ${missing}`);

const N_PREDICT = 8;
const BACKBONE = "bb-native";
const TICKET = "mswt1.test-claims.test-signature";
// the backbone tests' model cache: the same synthetic model, made once per machine
const MODEL_CACHE = process.env.MOESWARM_CACHE_DIR ?? join(tmpdir(), "moeswarm-backbone-test-models");

function firstByteDiff(a: Uint8Array, b: Uint8Array): number {
  const n = Math.min(a.byteLength, b.byteLength);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.byteLength === b.byteLength ? -1 : n;
}

describe.skipIf(Boolean(missing))("plugin: native splits to a worker, the bridge on any doubt", () => {
  const tmp = tempDir("mswn-nat-");
  let model: string;
  let layers: number[];
  let compute: ExpertCompute;
  let cert: { cert: string; key: string };
  let otherCert: { cert: string; key: string };
  let plain: PluginRun;
  let runs = 0;

  beforeAll(async () => {
    model = (await ensureSyntheticModel("small", { cacheDir: MODEL_CACHE })).path;
    const layout = findExpertTensors(await readGguf(model));
    layers = layout.layers.map((l) => l.layer);
    const experts = [...Array(layout.layers[0]!.nExpert).keys()];
    const slicePath = join(tmp.dir, "all.gguf");
    const slice = await sliceExperts(model, { layers, experts });
    await slice.write(slicePath);
    await slice.close();
    // llama-cpu: the CPU backend llama.cpp itself computes with, so every answer has plain llama.cpp's bits
    compute = await loadExpertCompute(slicePath, { backend: "llama-cpu", threads: 1 });
    [cert, otherCert] = await Promise.all([selfSigned(), selfSigned()]);
    plain = await runLogits({ model, dir: tmp.dir, name: "plain", nPredict: N_PREDICT });
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
    // seq rises from 1
    expect(bridge.receipts.map((r) => r.seq)).toEqual(bridge.receipts.map((_, i) => i + 1));
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
  afterAll(() => tmp.remove());

  it("top-2: the same bytes as plain llama.cpp, every split after the first native", async () => {
    // top-2 (Llama 4 ships top-1): two weighted rows per token, added back by the plugin
    const model = join(tmp.dir, "llama4-top2.gguf");
    await synthesizeMoeModel({ ...syntheticPreset("tiny", "llama4"), nExpertUsed: 2 }, model);
    const layout = findExpertTensors(await readGguf(model));
    const layers = layout.layers.map((l) => l.layer);
    const slicePath = join(tmp.dir, "all.gguf");
    const slice = await sliceExperts(model, {
      layers,
      experts: [...Array(layout.layers[0]!.nExpert).keys()],
    });
    await slice.write(slicePath);
    await slice.close();
    await using compute = await loadExpertCompute(slicePath, { backend: "llama-cpu", threads: 1 });
    const cert = await selfSigned();
    const plain = await runLogits({ model, dir: tmp.dir, name: "plain", nPredict: N_PREDICT });
    expect(plain.ok, plain.stderr).toBe(true);
    await using worker = await startWorker(cert, compute, "ok");
    await using bridge = await startBridge(join(tmp.dir, "l4.sock"), compute);
    const exp = Date.now() + 3_600_000;
    bridge.setTable({
      backbone: BACKBONE,
      deadlineMs: 5000,
      layers: layers.map((layer) => ({
        layer,
        worker: "w1",
        addr: worker.addr,
        fp: worker.fingerprint,
        ticket: TICKET,
        exp,
      })),
    });
    const run = await runLogits({
      model,
      dir: tmp.dir,
      name: "native",
      nPredict: N_PREDICT,
      bridge: bridge.address,
    });
    expect(run.ok, run.stderr).toBe(true);
    expect(run.tokens).toEqual(plain.tokens);
    expect(firstByteDiff(run.logits, plain.logits)).toBe(-1);
    expect(run.plugin!.splits).toBe((N_PREDICT + 1) * layers.length);
    expect(bridge.dispatches.length).toBeLessThanOrEqual(1);
    expect(run.plugin!.native.splits + bridge.dispatches.length).toBe(run.plugin!.splits);
  });
});

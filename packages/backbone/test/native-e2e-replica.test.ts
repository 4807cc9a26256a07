// The native data plane with replicas (issue #15, phase 3), end to end with real processes: a hub
// (TLS on loopback, two replicas wanted), two real `moeswarm-worker --listen-native` each holding
// every expert, the bridge under trust "own", and llama.cpp with the plugin (llama-logits). Every
// layer goes native, the primaries split between both workers, each layer with the other as its
// alt; the logits are bit-identical to plain llama.cpp and the hub credits each worker what it
// answered. Then one worker is killed mid-decode: the plugin fails over to the other natively,
// every token equals the local run, no split goes to the bridge for lack of a worker.
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { createHub, type Hub, mintToken } from "@moeswarm/hub";
import { findExpertTensors, readGguf } from "@moeswarm/shard";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { type BackboneBridge, runLogitsHarness, serveBackboneBridge } from "../src/index.js";
import {
  firstByteDiff,
  loopbackCerts,
  modelInfo,
  nativeMissing,
  syntheticModel,
  tempDir,
} from "./helpers.js";

const missing = nativeMissing() ?? opensslMissing();

function opensslMissing(): string | undefined {
  try {
    if (/libssl\.so\.3\b/.test(execFileSync("ldconfig", ["-p"], { encoding: "utf8" }))) return undefined;
  } catch {
    return undefined;
  }
  const why = "no libssl.so.3 on this machine (the native plane needs OpenSSL 3: apt-get install libssl3)";
  console.warn(`skipping the native replicas end-to-end test: ${why}`);
  return why;
}
const SECRET = "backbone-native-replica-test-secret-01";
const MODEL_ID = "native-rep";
const WORKERS = ["w0", "w1"] as const;

function workerBin(): string {
  const require = createRequire(import.meta.url);
  const pkgPath = require.resolve("@moeswarm/worker/package.json");
  const pkg = require(pkgPath) as { bin: Record<string, string> };
  return join(dirname(pkgPath), pkg.bin["moeswarm-worker"]!);
}

describe.skipIf(Boolean(missing))(
  "native data plane with two whole copies (hub, two workers, plugin)",
  () => {
    const tmp = tempDir("mswb-nrep-");
    let hub: Hub;
    let url: string;
    let ca: string;
    let modelPath: string;
    let layers: number[];
    let nExpert: number;
    let k: number;
    const workers = new Map<string, ChildProcess>();
    let workerLog = "";
    const workerGone = new AbortController();

    beforeAll(async () => {
      modelPath = await syntheticModel("small");
      const info = await modelInfo(modelPath);
      layers = info.layers;
      k = info.nExpertUsed;
      const moe = findExpertTensors(await readGguf(modelPath));
      nExpert = moe.layers[0]!.nExpert;
      const expertBytes = moe.layers.reduce((s, l) => s + Number(l.bytesPerExpert) * l.nExpert, 0);
      const certs = await loopbackCerts();
      ca = certs.ca;
      const caFile = join(tmp.dir, "ca.pem");
      writeFileSync(caFile, ca);
      hub = createHub({
        secret: SECRET,
        models: [{ id: MODEL_ID, path: modelPath }],
        tls: { cert: certs.cert, key: certs.key },
        manifestDir: join(tmp.dir, "manifests"),
        replicas: 2,
      });
      url = (await hub.listen(0, "127.0.0.1")).url;
      for (const id of WORKERS) {
        const cacheDir = join(tmp.dir, id);
        mkdirSync(cacheDir, { recursive: true });
        // room for every expert: each worker claims the model whole (the hub wants two copies)
        const child = spawn(
          process.execPath,
          [
            workerBin(),
            ...["--hub", url, "--token", mintToken({ role: "worker", id, ttlS: 3600 }, SECRET)],
            ...["--id", id, "--model", MODEL_ID, "--capacity", String(Math.ceil(expertBytes * 1.15))],
            ...["--cache-dir", cacheDir, "--ca", caFile, "--backend", "llama-cpu", "--threads", "1"],
            ...["--poll", "0.5", "--listen-native", "127.0.0.1:0", "--direct-report", "1", "--json"],
          ],
          { stdio: ["ignore", "pipe", "pipe"] },
        );
        const log = (d: Buffer) => {
          workerLog = `${workerLog}[${id}] ${d.toString()}`.slice(-12_000);
        };
        child.stdout!.on("data", log);
        child.stderr!.on("data", log);
        child.once("exit", (code, sig) => {
          if (workers.get(id) === child) workerGone.abort(new Error(`worker ${id} exited (${code ?? sig})`));
        });
        workers.set(id, child);
      }
    }, 120_000);

    afterAll(async () => {
      for (const w of workers.values()) w.kill("SIGKILL");
      await hub?.close();
      tmp.remove();
    });

    it("layers native on both copies, bit-identical, each credited once; one killed mid-decode fails over natively", async () => {
      await using bridge: BackboneBridge = await serveBackboneBridge({
        socket: join(tmp.dir, "bridge.sock"),
        hub: {
          url,
          token: mintToken({ role: "backbone", id: "bb-rep", ttlS: 3600 }, SECRET),
          model: MODEL_ID,
          ca,
          statsIntervalMs: 0,
          pollWaitS: 10,
        },
        trust: "own",
      });
      const link = bridge.hub!;
      const bothEverywhere = () => {
        const p = link.current();
        if (p.missing.length > 0 || !WORKERS.every((w) => p.native.has(w))) return false;
        for (const layer of layers) {
          for (let e = 0; e < nExpert; e++) {
            const owners = p.placement.owners(layer, e);
            if (!WORKERS.every((w) => owners.includes(w))) return false;
          }
        }
        return true;
      };
      await vi
        .waitFor(() => expect(bothEverywhere()).toBe(true), { timeout: 90_000, interval: 250 })
        .catch((error: unknown) => {
          throw new Error(`the two workers did not each claim the whole model\n${workerLog}`, {
            cause: error,
          });
        });
      expect(workerGone.signal.aborted).toBe(false);
      // every layer on the table, primaries on both workers, each the other's alt
      await vi.waitFor(
        () => {
          const t = bridge.metrics().native!.table;
          expect(t.layers, workerLog).toEqual(layers);
          expect([...t.workers].sort()).toEqual([...WORKERS]);
          expect([...t.alts].sort()).toEqual([...WORKERS]);
        },
        { timeout: 15_000 },
      );

      const common = { modelPath, prompt: "Two copies of every expert", threads: 1, noMmap: true };
      const decode = async (name: string, nPredict: number, during?: () => Promise<void>) => {
        const plainPath = join(tmp.dir, `${name}-plain.bin`);
        const swarmPath = join(tmp.dir, `${name}-swarm.bin`);
        const plain = await runLogitsHarness({ ...common, nPredict, logitsPath: plainPath });
        expect(plain.ok, plain.stderr).toBe(true);
        const running = runLogitsHarness({
          ...common,
          nPredict,
          logitsPath: swarmPath,
          plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
        });
        await during?.();
        const swarm = await running;
        expect(swarm.ok, swarm.stderr).toBe(true);
        expect(swarm.tokens).toEqual(plain.tokens);
        expect(firstByteDiff(readFileSync(swarmPath), readFileSync(plainPath))).toBe(-1);
        return swarm;
      };

      // 1. every split native, answered by both workers (their layers), credited once each
      const before = bridge.metrics();
      const r1 = await decode("both", 16);
      const s1 = r1.plugin!;
      const viaBridge = s1.splits - s1.native!.splits;
      expect(viaBridge).toBeLessThanOrEqual(1);
      expect(s1.native!.fallbacks).toBe(0);
      expect(bridge.metrics().requests - before.requests).toBe(viaBridge);
      await vi.waitFor(() => expect(bridge.metrics().native!.splits).toBe(s1.native!.splits), {
        timeout: 5000,
      });
      const n1 = bridge.metrics().native!;
      const per = n1.workers;
      for (const w of WORKERS) expect(per[w]?.splits, w).toBeGreaterThan(0);
      // each split credited once, to one worker, with every one of its filled ids (k per token row)
      expect(per.w0!.splits + per.w1!.splits).toBe(s1.native!.splits);
      expect(per.w0!.expertTokens + per.w1!.expertTokens).toBe(n1.expertTokens);
      expect(n1.expertTokens).toBe(n1.tokens * k);
      // the hub: what each answered natively, plus what the bridge routed itself (a first split
      // that came before the table), never more
      const routed = (bridge.metrics().tokens - before.tokens) * k;
      await link.reportStats();
      await vi.waitFor(
        () => {
          const credit = (w: string) => hub.workers().find((x) => x.id === w)?.credits?.expertTokens ?? 0;
          for (const w of WORKERS) expect(credit(w), workerLog).toBeGreaterThanOrEqual(per[w]!.expertTokens);
          expect(credit("w0") + credit("w1")).toBe(n1.expertTokens + routed);
        },
        { timeout: 15_000, interval: 250 },
      );

      // 2. w0 dies while the plugin decodes through both: its layers fail over to w1 natively
      const m1 = bridge.metrics();
      const r2 = await decode("killed", 48, async () => {
        const seen = bridge.metrics().native!.receipts;
        await vi.waitFor(() => expect(bridge.metrics().native!.receipts).toBeGreaterThan(seen), {
          timeout: 20_000,
          interval: 5,
        });
        const w0 = workers.get("w0")!;
        workers.delete("w0");
        w0.kill("SIGKILL");
      });
      const n2 = r2.plugin!.native!;
      expect(n2.failovers, r2.stderr).toBeGreaterThan(0);
      expect(n2.fallbacks).toBe(0);
      expect(r2.plugin!.splits - n2.splits).toBeLessThanOrEqual(1);
      // the bridge computed nothing for lack of a worker, and failed nothing
      const m2 = bridge.metrics();
      expect(m2.failed).toBe(0);
      expect(m2.requests - m1.requests).toBeLessThanOrEqual(1);
      // the failover receipts reached the bridge (w0 dropped for a backoff), and once the hub's
      // placement loses w0 too, w1 is primary of every layer with no alt
      await vi.waitFor(() => expect(bridge.metrics().native!.failovers).toBeGreaterThan(0), {
        timeout: 5000,
      });
      expect(bridge.metrics().native!.drops).toBeGreaterThan(0);
      await vi.waitFor(
        () => {
          const t = bridge.metrics().native!.table;
          expect(t.layers).toEqual(layers);
          expect(t.workers).toEqual(["w1"]);
          expect(t.alts).toEqual([]);
        },
        { timeout: 30_000, interval: 100 },
      );
    }, 240_000);
  },
);

// The native data plane end to end, with real processes: a hub (TLS on loopback), a real
// `moeswarm-worker --listen-native` that claims the whole model, the bridge under trust "own", and
// llama.cpp with the plugin (llama-logits). Every remote layer then goes plugin -> worker over the
// native link: the greedy tokens and the logits are bit-identical to plain llama.cpp, the plugin's
// stats count native splits for every split, the bridge routed none, and the hub credits the
// worker from the receipts. Then the worker is killed in the middle of a decode: the decode still
// completes with the same tokens (the bridge path, then the local fallback), no wrong value.
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { createHub, type Hub, mintToken } from "@moeswarm/hub";
import { findExpertTensors, readGguf } from "@moeswarm/shard";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import {
  type BackboneBridge,
  createLocalFallback,
  type LocalFallback,
  runLogitsHarness,
  serveBackboneBridge,
} from "../src/index.js";
import {
  firstByteDiff,
  loopbackCerts,
  modelInfo,
  nativeMissing,
  syntheticModel,
  tempDir,
} from "./helpers.js";

const missing = nativeMissing() ?? opensslMissing();

/** The plugin's and the worker's TLS load libssl.so.3 at run time: without it there is no native plane. */
function opensslMissing(): string | undefined {
  try {
    if (/libssl\.so\.3\b/.test(execFileSync("ldconfig", ["-p"], { encoding: "utf8" }))) return undefined;
  } catch {
    // no ldconfig: try anyway (the worker and the plugin say what they miss)
    return undefined;
  }
  const why = "no libssl.so.3 on this machine (the native plane needs OpenSSL 3: apt-get install libssl3)";
  console.warn(`skipping the native data plane end-to-end test: ${why}`);
  return why;
}
const SECRET = "backbone-native-e2e-test-secret-0001";
const MODEL_ID = "native-e2e";

function workerBin(): string {
  const require = createRequire(import.meta.url);
  const pkgPath = require.resolve("@moeswarm/worker/package.json");
  const pkg = require(pkgPath) as { bin: Record<string, string> };
  return join(dirname(pkgPath), pkg.bin["moeswarm-worker"]!);
}

describe.skipIf(Boolean(missing))(
  "native data plane end to end (hub, worker --listen-native, plugin)",
  () => {
    const tmp = tempDir("mswb-ne2e-");
    let hub: Hub;
    let url: string;
    let ca: string;
    let modelPath: string;
    let layers: number[];
    let k: number;
    let worker: ChildProcess | undefined;
    let workerLog = "";
    /** Aborted when the worker process exits: waiting for it then fails at once, with its log. */
    const workerGone = new AbortController();
    let fallback: LocalFallback;

    beforeAll(async () => {
      modelPath = await syntheticModel("small");
      const info = await modelInfo(modelPath);
      layers = info.layers;
      k = info.nExpertUsed;
      const moe = findExpertTensors(await readGguf(modelPath));
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
        replicas: 1,
      });
      url = (await hub.listen(0, "127.0.0.1")).url;
      const cacheDir = join(tmp.dir, "w0");
      mkdirSync(cacheDir, { recursive: true });
      // one worker with room for every expert: it claims the model whole, each layer its own
      worker = spawn(
        process.execPath,
        [
          workerBin(),
          ...["--hub", url, "--token", mintToken({ role: "worker", id: "w0", ttlS: 3600 }, SECRET)],
          ...["--id", "w0", "--model", MODEL_ID, "--capacity", String(Math.ceil(expertBytes * 1.15))],
          ...["--cache-dir", cacheDir, "--ca", caFile, "--backend", "llama-cpu", "--threads", "1"],
          ...["--poll", "0.5", "--listen-native", "127.0.0.1:0", "--direct-report", "1", "--json"],
        ],
        { stdio: ["ignore", "pipe", "pipe"] },
      );
      const log = (d: Buffer) => {
        workerLog = (workerLog + d.toString()).slice(-8000);
      };
      worker.stdout!.on("data", log);
      worker.stderr!.on("data", log);
      worker.once("exit", (code, sig) => workerGone.abort(new Error(`the worker exited (${code ?? sig})`)));
      fallback = await createLocalFallback(modelPath, { threads: 1 });
    }, 120_000);

    afterAll(async () => {
      worker?.kill("SIGKILL");
      await fallback?.close();
      await hub?.close();
      tmp.remove();
    });

    it("every remote layer native, bit-identical, credited; the worker killed mid-decode loses nothing", async () => {
      await using bridge: BackboneBridge = await serveBackboneBridge({
        socket: join(tmp.dir, "bridge.sock"),
        hub: {
          url,
          token: mintToken({ role: "backbone", id: "bb-native", ttlS: 3600 }, SECRET),
          model: MODEL_ID,
          ca,
          statsIntervalMs: 0,
          pollWaitS: 10,
        },
        fallback: fallback.compute,
        trust: "own",
      });
      const link = bridge.hub!;
      await link
        .waitForPlacement((p) => p.missing.length === 0 && p.native.has("w0"), {
          signal: AbortSignal.any([AbortSignal.timeout(90_000), workerGone.signal]),
        })
        .catch((error: unknown) => {
          const p = link.current();
          throw new Error(
            `no whole native worker: missing ${JSON.stringify(p.missing)}, native ${JSON.stringify([...p.native])}\n${workerLog}`,
            { cause: error },
          );
        });
      await vi.waitFor(() => expect(bridge.metrics().native!.table.layers, workerLog).toEqual(layers), {
        timeout: 15_000,
      });

      const common = { modelPath, prompt: "Straight to the worker", threads: 1, noMmap: true };
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

      // 1. every split native: the plugin counts them, the bridge routed none
      const before = bridge.metrics();
      const r1 = await decode("native", 16);
      const stats = r1.plugin!;
      expect(stats.native, r1.stderr).toBeDefined();
      expect(stats.native!.splits).toBeGreaterThan(0);
      // every split native, but the first may come before the plugin has read its table
      const viaBridge = stats.splits - stats.native!.splits;
      expect(viaBridge).toBeGreaterThanOrEqual(0);
      expect(viaBridge).toBeLessThanOrEqual(1);
      expect(stats.native!.fallbacks).toBe(0);
      expect(stats.native!.overheadP50Us).toBeGreaterThan(0);
      const m1 = bridge.metrics();
      expect(m1.requests - before.requests).toBe(viaBridge);
      expect(m1.dispatch.requests - before.dispatch.requests).toBe(viaBridge);
      // the receipts: every native split counted at the bridge (the last batch at the plugin's exit)
      await vi.waitFor(() => expect(bridge.metrics().native!.splits).toBe(stats.native!.splits), {
        timeout: 5000,
      });
      const credited = bridge.metrics().native!.workers.w0!.expertTokens;
      expect(credited).toBeGreaterThan(0);
      // a first split that came before the table went through the bridge (relay), credited too
      const routed = (bridge.metrics().tokens - before.tokens) * k;
      // the hub credits the minimum of the backbone's receipts and the worker's own served report
      // (which it sends every second here): both halves count the same filled ids
      await link.reportStats();
      await vi.waitFor(
        () =>
          expect(hub.workers().find((w) => w.id === "w0")?.credits?.expertTokens, workerLog).toBe(
            credited + routed,
          ),
        { timeout: 15_000, interval: 250 },
      );

      // 2. the worker dies while the plugin decodes through it
      const r2 = await decode("killed", 48, async () => {
        const seen = bridge.metrics().native!.receipts;
        await vi.waitFor(() => expect(bridge.metrics().native!.receipts).toBeGreaterThan(seen), {
          timeout: 20_000,
          interval: 5,
        });
        worker!.kill("SIGKILL");
      });
      const n2 = r2.plugin!.native!;
      expect(n2.fallbacks).toBeGreaterThan(0);
      const m2 = bridge.metrics();
      // the bridge answered the rest: the local fallback (the only worker is gone)
      expect(m2.requests).toBeGreaterThan(m1.requests);
      expect(m2.failed).toBe(0);
      // the plugin's failure receipts reached the bridge, which dropped w0 from the table
      await vi.waitFor(() => expect(bridge.metrics().native!.fallbacks).toBeGreaterThan(0), {
        timeout: 5000,
      });
      expect(bridge.metrics().native!.drops).toBeGreaterThan(0);
    }, 240_000);
  },
);

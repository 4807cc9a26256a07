// The native data plane end to end, with real processes: a hub (TLS on loopback), a real
// `moeswarm-worker --listen-native` that claims the whole model, the bridge under trust "own", and
// llama.cpp with the plugin (llama-logits). Every remote layer then goes plugin -> worker over the
// native link: the greedy tokens and the logits are bit-identical to plain llama.cpp, the plugin's
// stats count native splits for every split, the bridge routed none, and the hub credits the
// worker from the receipts. Then the worker is killed in the middle of a decode: the decode still
// completes with the same tokens (the bridge path, then the local fallback), no wrong value.
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import {
  type BackboneBridge,
  createLocalFallback,
  type LocalFallback,
  serveBackboneBridge,
} from "../src/index.js";
import { nativeMissing, tempDir } from "./helpers.js";
import {
  decoderAgainstPlain,
  type NativeSwarm,
  opensslMissing,
  startNativeSwarm,
} from "./native-e2e-fixture.js";

const missing = nativeMissing() ?? opensslMissing("the native data plane end-to-end test");
const SECRET = "backbone-native-e2e-test-secret-0001";
const MODEL_ID = "native-e2e";

describe.skipIf(Boolean(missing))(
  "native data plane end to end (hub, worker --listen-native, plugin)",
  () => {
    const tmp = tempDir("mswb-ne2e-");
    let swarm: NativeSwarm;
    let fallback: LocalFallback;

    beforeAll(async () => {
      // one worker with room for every expert: it claims the model whole, each layer its own
      swarm = await startNativeSwarm(tmp.dir, {
        secret: SECRET,
        modelId: MODEL_ID,
        ids: ["w0"],
        replicas: 1,
      });
      fallback = await createLocalFallback(swarm.modelPath, { threads: 1 });
    }, 120_000);

    afterAll(async () => {
      await swarm?.close();
      await fallback?.close();
      tmp.remove();
    });

    it("every remote layer native, bit-identical, credited; the worker killed mid-decode loses nothing", async () => {
      const { hub, layers, k } = swarm;
      await using bridge: BackboneBridge = await serveBackboneBridge({
        socket: join(tmp.dir, "bridge.sock"),
        hub: swarm.bridgeHub("bb-native"),
        fallback: fallback.compute,
        trust: "own",
      });
      const link = bridge.hub!;
      await link
        .waitForPlacement((p) => p.missing.length === 0 && p.native.has("w0"), {
          signal: AbortSignal.any([AbortSignal.timeout(90_000), swarm.gone]),
        })
        .catch((error: unknown) => {
          const p = link.current();
          throw new Error(
            `no whole native worker: missing ${JSON.stringify(p.missing)}, native ${JSON.stringify([...p.native])}\n${swarm.log()}`,
            { cause: error },
          );
        });
      await vi.waitFor(() => expect(bridge.metrics().native!.table.layers, swarm.log()).toEqual(layers), {
        timeout: 15_000,
      });

      const decode = decoderAgainstPlain(tmp.dir, bridge, swarm.modelPath, "Straight to the worker");

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
          expect(hub.workers().find((w) => w.id === "w0")?.credits?.expertTokens, swarm.log()).toBe(
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
        const w0 = swarm.workers.get("w0")!;
        swarm.workers.delete("w0");
        w0.kill("SIGKILL");
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

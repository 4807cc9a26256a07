// The native data plane with replicas (issue #15, phase 3), end to end with real processes: a hub
// (TLS on loopback, two replicas wanted), two real `moeswarm-worker --listen-native` each holding
// every expert, the bridge under trust "own", and llama.cpp with the plugin (llama-logits). Every
// layer goes native, the primaries split between both workers, each layer with the other as its
// alt; the logits are bit-identical to plain llama.cpp and the hub credits each worker what it
// answered. Then one worker is killed mid-decode: the plugin fails over to the other natively,
// every token equals the local run, no split goes to the bridge for lack of a worker.
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { type BackboneBridge, serveBackboneBridge } from "../src/index.js";
import { nativeMissing, tempDir } from "./helpers.js";
import {
  decoderAgainstPlain,
  type NativeSwarm,
  opensslMissing,
  startNativeSwarm,
} from "./native-e2e-fixture.js";

const missing = nativeMissing() ?? opensslMissing("the native replicas end-to-end test");
const SECRET = "backbone-native-replica-test-secret-01";
const MODEL_ID = "native-rep";
const WORKERS = ["w0", "w1"] as const;

describe.skipIf(Boolean(missing))(
  "native data plane with two whole copies (hub, two workers, plugin)",
  () => {
    const tmp = tempDir("mswb-nrep-");
    let swarm: NativeSwarm;

    beforeAll(async () => {
      // room for every expert: each worker claims the model whole (the hub wants two copies)
      swarm = await startNativeSwarm(tmp.dir, {
        secret: SECRET,
        modelId: MODEL_ID,
        ids: WORKERS,
        replicas: 2,
      });
    }, 120_000);

    afterAll(async () => {
      await swarm?.close();
      tmp.remove();
    });

    it("layers native on both copies, bit-identical, each credited once; one killed mid-decode fails over natively", async () => {
      const { hub, layers, nExpert, k, workers } = swarm;
      await using bridge: BackboneBridge = await serveBackboneBridge({
        socket: join(tmp.dir, "bridge.sock"),
        hub: swarm.bridgeHub("bb-rep"),
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
          throw new Error(`the two workers did not each claim the whole model\n${swarm.log()}`, {
            cause: error,
          });
        });
      expect(swarm.gone.aborted).toBe(false);
      // every layer on the table, primaries on both workers, each the other's alt
      await vi.waitFor(
        () => {
          const t = bridge.metrics().native!.table;
          expect(t.layers, swarm.log()).toEqual(layers);
          expect([...t.workers].sort()).toEqual([...WORKERS]);
          expect([...t.alts].sort()).toEqual([...WORKERS]);
        },
        { timeout: 15_000 },
      );

      const decode = decoderAgainstPlain(tmp.dir, bridge, swarm.modelPath, "Two copies of every expert");

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
          for (const w of WORKERS)
            expect(credit(w), swarm.log()).toBeGreaterThanOrEqual(per[w]!.expertTokens);
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

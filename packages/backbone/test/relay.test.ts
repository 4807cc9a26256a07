// The same equivalence with the workers behind the hub's relay (WebSocket, msgpack frames, f32 on
// the wire): plugin -> bridge -> RelayTransport -> relay -> worker connections -> llama-cpu.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { Placement } from "@moeswarm/dispatch";
import { mintToken } from "@moeswarm/hub";
import { connectRelay, RelayTransport } from "@moeswarm/relay-client";
import type { WorkerProcessCompute } from "@moeswarm/worker-native";
import { describe, expect, it } from "vitest";
import { runLogitsHarness, serveBackboneBridge } from "../src/index.js";
import { firstByteDiff, nativeMissing, split } from "./helpers.js";
import { useRelaySwarm } from "./relay-swarm-fixture.js";

const missing = nativeMissing();
const SECRET = "backbone-relay-test-secret-0123456789";
const MODEL_ID = "relayed";

describe.skipIf(Boolean(missing))("llama.cpp + plugin + workers behind the hub's relay", () => {
  const fx = useRelaySwarm({ prefix: "mswb-relay-", secret: SECRET, model: MODEL_ID, preset: "small" });

  it("two relayed workers: identical tokens and bit-identical logits", async () => {
    const placement = new Placement({ model: MODEL_ID });
    for (const [i, experts] of split(fx.info.nExpert, 2).entries()) {
      const id = `relay-w${i}`;
      await fx.swarm.join(id, experts);
      placement.register({ id, model: MODEL_ID, layers: fx.info.layers, experts });
    }
    const backbone = fx.swarm.track(
      "bb",
      await connectRelay(fx.relayUrl, {
        role: "backbone",
        id: "bb",
        token: mintToken({ role: "backbone", id: "bb", ttlS: 3600 }, SECRET),
        reconnect: false,
      }),
    );
    await using bridge = await serveBackboneBridge({
      socket: join(fx.tmp.dir, "relay.sock"),
      placement,
      transport: new RelayTransport(backbone),
      // one owner per expert: the workers are this test's own (trust "verify" is tested below)
      trust: "own",
    });
    const common = { modelPath: fx.modelPath, prompt: "Over the relay", nPredict: 64, threads: 1 };
    const plain = await runLogitsHarness({ ...common, logitsPath: join(fx.tmp.dir, "plain.bin") });
    const relayed = await runLogitsHarness({
      ...common,
      logitsPath: join(fx.tmp.dir, "relayed.bin"),
      plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
    });
    expect(relayed.ok, relayed.stderr).toBe(true);
    expect(relayed.tokens).toEqual(plain.tokens);
    expect(
      firstByteDiff(
        readFileSync(join(fx.tmp.dir, "relayed.bin")),
        readFileSync(join(fx.tmp.dir, "plain.bin")),
      ),
    ).toBe(-1);
    const m = bridge.metrics();
    expect(m.failed).toBe(0);
    expect(Object.keys(m.dispatch.owners).sort()).toEqual(["relay-w0", "relay-w1"]);
  });

  it("trust verify (the default): a lying relayed worker beside honest replicas: identical tokens, the liar quarantined", async () => {
    const [lo, hi] = split(fx.info.nExpert, 2) as [number[], number[]];
    const placement = new Placement({ model: MODEL_ID });
    const computes: WorkerProcessCompute[] = [];
    for (const [i, experts] of [lo, hi].entries()) computes.push(await fx.swarm.spawn(`rv-${i}`, experts));
    // lo: two honest owners; hi: two honest owners and a liar (x1.05), three relay identities each
    const join_ = async (id: string, experts: number[], compute: WorkerProcessCompute, scale = 1) => {
      const c = await connectRelay(fx.relayUrl, {
        role: "worker",
        id,
        token: mintToken({ role: "worker", id, ttlS: 3600 }, SECRET),
        reconnect: false,
        onDispatch: async (d) => {
          const y = await compute.run(
            {
              layer: d.layer,
              x: d.activations(),
              ids: d.ids,
              k: d.k,
              ...(d.w ? { w: d.w } : {}),
              mode: d.mode,
            },
            { signal: d.signal },
          );
          if (scale !== 1) for (let i = 0; i < y.length; i++) y[i] = Math.fround(y[i]! * scale);
          return { y };
        },
      });
      fx.swarm.track(id, c);
      c.register({ model: MODEL_ID, layers: fx.info.layers, experts, backend: "llama-cpu" });
      placement.register({ id, model: MODEL_ID, layers: fx.info.layers, experts });
    };
    await join_("rv-lo-a", lo, computes[0]!);
    await join_("rv-lo-b", lo, computes[0]!);
    await join_("rv-liar", hi, computes[1]!, 1.05);
    await join_("rv-hi-a", hi, computes[1]!);
    await join_("rv-hi-b", hi, computes[1]!);
    const backbone = fx.swarm.track(
      "bb-verify",
      await connectRelay(fx.relayUrl, {
        role: "backbone",
        id: "bb-verify",
        token: mintToken({ role: "backbone", id: "bb-verify", ttlS: 3600 }, SECRET),
        reconnect: false,
      }),
    );
    const quarantined: string[] = [];
    await using bridge = await serveBackboneBridge({
      socket: join(fx.tmp.dir, "verify.sock"),
      placement,
      transport: new RelayTransport(backbone),
      onQuarantine: (e) => quarantined.push(e.worker),
    });
    const common = { modelPath: fx.modelPath, prompt: "Strangers on the relay", nPredict: 32, threads: 1 };
    const plain = await runLogitsHarness({ ...common, logitsPath: join(fx.tmp.dir, "v-plain.bin") });
    const t0 = performance.now();
    const relayed = await runLogitsHarness({
      ...common,
      logitsPath: join(fx.tmp.dir, "v-relayed.bin"),
      plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
    });
    const ms = performance.now() - t0;
    expect(relayed.ok, relayed.stderr).toBe(true);
    expect(relayed.tokens).toEqual(plain.tokens);
    expect(
      firstByteDiff(
        readFileSync(join(fx.tmp.dir, "v-relayed.bin")),
        readFileSync(join(fx.tmp.dir, "v-plain.bin")),
      ),
    ).toBe(-1);
    expect(quarantined).toEqual(["rv-liar"]);
    const m = bridge.metrics();
    expect(m.failed).toBe(0);
    const v = m.verification!;
    expect(v).toMatchObject({ quarantines: 1, quarantined: ["rv-liar"], failed: 0 });
    expect(v.disagreements).toBeGreaterThanOrEqual(1);
    // the cost against trust "own" on the same honest workers (one of each pair asked)
    const honestOnly = Placement.fromRegistrations(
      ["rv-lo-a", "rv-hi-a"].map((id, i) => ({
        id,
        model: MODEL_ID,
        layers: fx.info.layers,
        experts: i ? hi : lo,
      })),
    );
    await using own = await serveBackboneBridge({
      socket: join(fx.tmp.dir, "own.sock"),
      placement: honestOnly,
      transport: new RelayTransport(backbone),
      trust: "own",
    });
    const t1 = performance.now();
    const ownRun = await runLogitsHarness({
      ...common,
      logitsPath: join(fx.tmp.dir, "v-own.bin"),
      plugin: { bridge: own.address, layers: "all", model: MODEL_ID },
    });
    const ownMs = performance.now() - t1;
    expect(ownRun.tokens).toEqual(plain.tokens);
    const ownBytes = own.metrics().dispatch.bytesOut + own.metrics().dispatch.bytesIn;
    console.log(
      `[trust] relay, trust own on the honest workers: decode ${ownMs.toFixed(0)} ms, ${ownBytes} bytes ` +
        `(verify: ${ms.toFixed(0)} ms, ${m.dispatch.bytesOut + m.dispatch.bytesIn} bytes)`,
    );
    console.log(
      `[trust] relay, default settings, one liar of 5 workers: tokens identical (${relayed.tokens.length}), ` +
        `logits bit-identical, liar quarantined; ${v.partsVerified} parts verified, ${v.disagreements} disagreements, ` +
        `${v.thirdOpinions} third opinions; cost ${v.extraBytes} extra bytes of ${m.dispatch.bytesOut + m.dispatch.bytesIn}, ` +
        `${v.extraComputeMs.toFixed(0)} extra worker ms; decode ${ms.toFixed(0)} ms`,
    );
  });
});

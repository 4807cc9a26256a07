// The same equivalence with the workers behind the hub's relay (WebSocket, msgpack frames, f32 on
// the wire): plugin -> bridge -> RelayTransport -> relay -> worker connections -> llama-cpu.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { Placement } from "@moeswarm/dispatch";
import { createHub, type Hub, mintToken } from "@moeswarm/hub";
import { connectRelay, type RelayConnection, RelayTransport } from "@moeswarm/relay-client";
import { sliceExperts } from "@moeswarm/shard";
import { spawnLlamaExpertWorker, type WorkerProcessCompute } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runLogitsHarness, serveBackboneBridge } from "../src/index.js";
import {
  connectComputeToRelay,
  firstByteDiff,
  type ModelInfo,
  modelInfo,
  nativeMissing,
  split,
  syntheticModel,
  tempDir,
} from "./helpers.js";

const missing = nativeMissing();
const SECRET = "backbone-relay-test-secret-0123456789";
const MODEL_ID = "relayed";

describe.skipIf(Boolean(missing))("llama.cpp + plugin + workers behind the hub's relay", () => {
  const tmp = tempDir("mswb-relay-");
  let model: string;
  let info: ModelInfo;
  let hub: Hub;
  let relayUrl: string;
  const workers: WorkerProcessCompute[] = [];
  const connections: RelayConnection[] = [];

  beforeAll(async () => {
    model = await syntheticModel("small", "qwen3moe");
    info = await modelInfo(model);
    hub = createHub({
      secret: SECRET,
      models: [{ id: MODEL_ID, path: model }],
      // fake workers register without claiming, one copy per expert, stats not routed through the
      // relay: the hub's trust defaults are tested in @moeswarm/hub
      requireLeases: false,
      replicas: 1,
      trustReports: true,
    });
    relayUrl = `${(await hub.listen(0)).url.replace(/^http/, "ws")}/relay`;
  });
  afterAll(async () => {
    await Promise.all(connections.map((c) => c.close().catch(() => {})));
    await Promise.all(workers.map((w) => w.close().catch(() => {})));
    await hub?.close();
    tmp.remove();
  });

  it("two relayed workers: identical tokens and bit-identical logits", async () => {
    const placement = new Placement({ model: MODEL_ID });
    for (const [i, experts] of split(info.nExpert, 2).entries()) {
      const id = `relay-w${i}`;
      const path = join(tmp.dir, `${id}.gguf`);
      await using slice = await sliceExperts(model, { layers: info.layers, experts });
      await slice.write(path);
      const worker = await spawnLlamaExpertWorker(path, { threads: 1 });
      workers.push(worker);
      connections.push(await connectComputeToRelay(relayUrl, { id, secret: SECRET, compute: worker }));
      connections.at(-1)!.register({ model: MODEL_ID, layers: info.layers, experts, backend: "llama-cpu" });
      placement.register({ id, model: MODEL_ID, layers: info.layers, experts });
    }
    const backbone = await connectRelay(relayUrl, {
      role: "backbone",
      id: "bb",
      token: mintToken({ role: "backbone", id: "bb", ttlS: 3600 }, SECRET),
      reconnect: false,
    });
    connections.push(backbone);
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "relay.sock"),
      placement,
      transport: new RelayTransport(backbone),
    });
    const common = { modelPath: model, prompt: "Over the relay", nPredict: 64, threads: 1 };
    const plain = await runLogitsHarness({ ...common, logitsPath: join(tmp.dir, "plain.bin") });
    const relayed = await runLogitsHarness({
      ...common,
      logitsPath: join(tmp.dir, "relayed.bin"),
      plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
    });
    expect(relayed.ok, relayed.stderr).toBe(true);
    expect(relayed.tokens).toEqual(plain.tokens);
    expect(
      firstByteDiff(readFileSync(join(tmp.dir, "relayed.bin")), readFileSync(join(tmp.dir, "plain.bin"))),
    ).toBe(-1);
    const m = bridge.metrics();
    expect(m.failed).toBe(0);
    expect(Object.keys(m.dispatch.owners).sort()).toEqual(["relay-w0", "relay-w1"]);
  });
});

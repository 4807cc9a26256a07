// createSwarmLlama in its hub form (node-llama-cpp in this process; its own file, so that this is
// the process's first getLlama): only the hub's URL, a backbone token and the model id. The local
// fallback over the model file is created by default and must stay unused while workers cover it.
import { type Hub, mintToken } from "@moeswarm/hub";
import type { RelayConnection } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createSwarmLlama, runLogitsHarness } from "../src/index.js";
import {
  type ModelInfo,
  nativeMissing,
  relaySwarmWorkers,
  type Swarm,
  split,
  startSplitSwarm,
  syntheticModelInfo,
  tempDir,
  testHub,
} from "./helpers.js";

const missing = nativeMissing();
const MODEL_ID = "nlc-hub";
const SECRET = "backbone-swarm-llama-hub-secret-0123";
const N_PREDICT = 24;

describe.skipIf(Boolean(missing))("createSwarmLlama({hub})", () => {
  const tmp = tempDir("mswb-nlch-");
  let model: string;
  let info: ModelInfo;
  let swarm: Swarm;
  let hub: Hub;
  let url: string;
  const relays: RelayConnection[] = [];
  let plain: { prompt: number[]; tokens: number[] };

  beforeAll(async () => {
    ({ path: model, info } = await syntheticModelInfo("small"));
    const halves = split(info.nExpert, 2);
    swarm = await startSplitSwarm(model, info, 2, tmp.dir, MODEL_ID);
    hub = testHub(SECRET, MODEL_ID, model);
    const listener = await hub.listen(0);
    url = listener.url;
    // the worker processes behind the hub's relay
    const opts = { secret: SECRET, swarm, model: MODEL_ID, layers: info.layers, parts: halves };
    relays.push(...(await relaySwarmWorkers(listener.relayUrl, opts)));
    plain = await runLogitsHarness({
      modelPath: model,
      prompt: "A hub and a llama",
      nPredict: N_PREDICT,
      threads: 1,
    });
  });
  afterAll(async () => {
    await Promise.all(relays.map((c) => c.close().catch(() => {})));
    await swarm?.close();
    await hub?.close();
    tmp.remove();
  });

  it("decodes plain llama.cpp's tokens; the workers get the credit", async () => {
    await using swarmLlama = await createSwarmLlama({
      modelPath: model,
      remoteLayers: "all",
      hub: {
        url,
        // bound: the hub refuses unbound backbone tokens (the link reports as the token's id)
        token: mintToken({ role: "backbone", id: "bb-swarm", ttlS: 600 }, SECRET),
        model: MODEL_ID,
        statsIntervalMs: 0,
      },
      // one owner per expert, credited as such: the test's own workers
      trust: "own",
    });
    await swarmLlama.bridge.hub!.waitForPlacement((p) => p.missing.length === 0);
    const context = await swarmLlama.model.createContext({ contextSize: 512, batchSize: 512, threads: 1 });
    const tokens: number[] = [];
    for await (const token of context.getSequence().evaluate(plain.prompt as never[], { temperature: 0 })) {
      tokens.push(token as number);
      if (tokens.length === N_PREDICT) break;
    }
    await context.dispose();
    expect(tokens).toEqual(plain.tokens);
    const m = swarmLlama.metrics();
    expect(m.failed).toBe(0);
    expect(m.fallbacks).toBe(0);
    expect(Object.keys(m.dispatch.owners).sort()).toEqual(["w0", "w1"]);
    const outcome = await swarmLlama.bridge.hub!.reportStats();
    expect(outcome?.credited.sort()).toEqual(["w0", "w1"]);
  });
});

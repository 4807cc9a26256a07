// node-llama-cpp in this process (vitest runs each file in its own process) with the plugin and
// the bridge on this event loop: node-llama-cpp decodes on its own threads, so the bridge can
// answer the plugin while a decode waits; the tokens are plain llama.cpp's.
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createSwarmLlama, runLogitsHarness } from "../src/index.js";
import {
  type ModelInfo,
  nativeMissing,
  type Swarm,
  startSplitSwarm,
  syntheticModelInfo,
  tempDir,
} from "./helpers.js";

const missing = nativeMissing();
const MODEL_ID = "node-llama-cpp";
const N_PREDICT = 64;

describe.skipIf(Boolean(missing))("createSwarmLlama: node-llama-cpp with the plugin, in one process", () => {
  const tmp = tempDir("mswb-nlc-");
  let model: string;
  let info: ModelInfo;
  let swarm: Swarm;
  let plain: { prompt: number[]; tokens: number[] };

  beforeAll(async () => {
    ({ path: model, info } = await syntheticModelInfo("small"));
    swarm = await startSplitSwarm(model, info, 2, tmp.dir, MODEL_ID);
    plain = await runLogitsHarness({
      modelPath: model,
      prompt: "Bees and experts",
      nPredict: N_PREDICT,
      threads: 1,
    });
  });
  afterAll(async () => {
    await swarm?.close();
    tmp.remove();
  });

  it("decodes greedily to plain llama.cpp's tokens, every MoE layer answered by the swarm", async () => {
    const errors: string[] = [];
    await using swarmLlama = await createSwarmLlama({
      modelPath: model,
      remoteLayers: "all",
      placement: swarm.placement,
      transport: swarm.transport,
      socket: join(tmp.dir, "nlc.sock"),
      fallback: false,
      logger: (level, message) => {
        if (level === "error" || level === "fatal") errors.push(message);
      },
    });
    expect(swarmLlama.bridge.address).toBe(`unix:${join(tmp.dir, "nlc.sock")}`);
    // two contexts decoding at once: each has its own plugin backend and bridge connection
    const contexts = await Promise.all(
      [0, 1].map(() => swarmLlama.model.createContext({ contextSize: 512, batchSize: 512, threads: 1 })),
    );
    const decoded = await Promise.all(
      contexts.map(async (context) => {
        const tokens: number[] = [];
        // the harness's own prompt tokens: no difference in tokenisation can hide behind this
        const prompt = plain.prompt as never[];
        const options = { temperature: 0, yieldEogToken: true };
        for await (const token of context.getSequence().evaluate(prompt, options)) {
          tokens.push(token as number);
          if (tokens.length === N_PREDICT) break;
        }
        return tokens;
      }),
    );
    expect(errors).toEqual([]);
    expect(decoded[0]).toEqual(plain.tokens);
    expect(decoded[1]).toEqual(plain.tokens);
    const m = swarmLlama.metrics();
    // one per context; with the plugin's native plane, also the backend llama.cpp creates at load
    // (it connects at once, to have the bridge's table before its first split)
    expect(m.connectionsTotal).toBeGreaterThanOrEqual(2);
    expect(m.connectionsTotal).toBeLessThanOrEqual(3);
    // every decode ran each MoE layer through the bridge, once per ubatch
    expect(m.requests).toBeGreaterThanOrEqual(2 * N_PREDICT * info.layers.length);
    expect(m.requests % info.layers.length).toBe(0);
    expect(m.layers.map((l) => l.layer)).toEqual(info.layers);
    expect(m.failed).toBe(0);
    expect(m.fallbacks).toBe(0);
    const routed = [...swarmLlama.bridge.routingCounts()];
    expect(routed.reduce((s, r) => s + r.count, 0)).toBe(
      m.layers.reduce((s, l) => s + l.tokens, 0) * info.nExpertUsed,
    );
    for (const context of contexts) await context.dispose();
  });

  it("a second createSwarmLlama in the same process, after the first closed, claims and decodes the same", async () => {
    // node-llama-cpp sends llama.cpp's load log only to its first Llama's logger: the claim is
    // proven by the plugin's MOESWARM_CLAIM_FILE instead
    await using again = await createSwarmLlama({
      modelPath: model,
      remoteLayers: "all",
      placement: swarm.placement,
      transport: swarm.transport,
      socket: join(tmp.dir, "nlc2.sock"),
      fallback: false,
      // passed on to the bridge: every answer drawn, none checkable (no fallback, no replica)
      spotCheck: { fraction: 1 },
      hedgeMs: 60_000,
    });
    const context = await again.model.createContext({ contextSize: 512, batchSize: 512, threads: 1 });
    const tokens: number[] = [];
    for await (const token of context.getSequence().evaluate(plain.prompt as never[], { temperature: 0 })) {
      tokens.push(token as number);
      if (tokens.length === 8) break;
    }
    await context.dispose();
    expect(tokens).toEqual(plain.tokens.slice(0, 8));
    expect(again.metrics().requests).toBeGreaterThanOrEqual(8 * info.layers.length);
    expect(process.env.MOESWARM_CLAIM_FILE).toBeDefined();
    expect(again.bridge.spotCheck?.snapshot()).toMatchObject({ quarantined: [] });
    expect(again.metrics().spotCheck?.sampled).toBeGreaterThan(0);
  });
});

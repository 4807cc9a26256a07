// Plain llama.cpp (node-llama-cpp's libllama, through the llama-logits harness in a child process)
// against the same llama.cpp with libggml-moeswarm.so sending every MoE layer to llama-cpu worker
// processes through the bridge: the same greedy tokens and the same logits, byte for byte.
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import type { SyntheticArch, SyntheticPreset } from "@moeswarm/shard";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  createLocalFallback,
  type LogitsHarnessOptions,
  moeswarmOverride,
  pluginPath,
  runLogitsHarness,
} from "../src/index.js";
import { equivalenceRun, EQUIVALENCE_PROMPT as PROMPT } from "./equivalence-run.js";
import {
  decodeLogits,
  firstByteDiff,
  type ModelInfo,
  nativeMissing,
  split,
  startSplitSwarm,
  startSwarm,
  swarmBridge,
  syntheticModelInfo,
  tempDir,
} from "./helpers.js";

const missing = nativeMissing();
const MODEL_ID = "equivalence";
const N_PREDICT = 64;

interface Case {
  preset: SyntheticPreset;
  arch: SyntheticArch;
  workers: number;
}

const CASES: Case[] = [
  { preset: "small", arch: "qwen3moe", workers: 2 },
  { preset: "small", arch: "qwen3moe", workers: 3 },
  { preset: "small", arch: "qwen2moe", workers: 2 },
  { preset: "small", arch: "mixtral", workers: 2 },
];

describe.skipIf(Boolean(missing))("plain llama.cpp vs llama.cpp + plugin + swarm", () => {
  const tmp = tempDir("mswb-eq-");
  afterAll(() => tmp.remove());

  for (const c of CASES) {
    describe(`${c.preset} ${c.arch}, ${c.workers} workers, every MoE layer remote`, () => {
      // gate, up and down of every MoE layer handed over (and dropped)
      const eq = equivalenceRun({
        case: { ...c, nPredict: N_PREDICT, expertTensors: 3 },
        tag: `${c.arch}-${c.preset}-${c.workers}`,
        dir: tmp.dir,
        modelId: MODEL_ID,
      });

      it("MOESWARM_LAYERS=all (the node-llama-cpp path): identical tokens, bit-identical logits, one split per layer and ubatch", async () => {
        await eq.expectSwarmEquivalent();
      });

      it("-ot (the llama-server path): the same bytes", async () => {
        const { run, logits } = await eq.decode("ot", {
          overrides: [moeswarmOverride("all")],
          plugin: { bridge: eq.bridge.address, model: MODEL_ID },
        });
        expect(run.ok, run.stderr).toBe(true);
        expect(run.tokens).toEqual(eq.plain.tokens);
        expect(firstByteDiff(logits, eq.plainLogits)).toBe(-1);
        expect(run.plugin!.splits).toBe((N_PREDICT + 1) * eq.info.layers.length);
      });
    });
  }
});

describe.skipIf(Boolean(missing))(
  "layer selection, and failures: workers that die, a bridge that is gone",
  () => {
    const tmp = tempDir("mswb-fail-");
    let model: string;
    let info: ModelInfo;
    let plainTokens: number[];
    let plainLogits: Buffer;
    const decode = (name: string, extra?: Partial<LogitsHarnessOptions>) =>
      decodeLogits({ model, prompt: PROMPT, nPredict: N_PREDICT, dir: tmp.dir }, name, extra);

    beforeAll(async () => {
      ({ path: model, info } = await syntheticModelInfo("small"));
      const plain = await decode("plain");
      plainTokens = plain.run.tokens;
      plainLogits = plain.logits;
    });
    afterAll(() => tmp.remove());

    it("loaded without a configuration, the plugin claims nothing; a config file picks some layers", async () => {
      const { run: idle, logits: idleLogits } = await decode("idle", {
        env: { GGML_BACKEND_PATH: pluginPath() },
      });
      expect(idle.ok, idle.stderr).toBe(true);
      expect(idle.plugin).toMatchObject({ splits: 0, weightsDroppedTensors: 0 });
      expect(firstByteDiff(idleLogits, plainLogits)).toBe(-1);

      await using swarm = await startSwarm(
        model,
        [{ id: "all", experts: [...Array(info.nExpert).keys()] }],
        tmp.dir,
        "cfg",
      );
      await using bridge = await swarmBridge(swarm, join(tmp.dir, "cfg.sock"));
      const config = join(tmp.dir, "moeswarm.json");
      writeFileSync(
        config,
        JSON.stringify({ layers: [1, 3], bridge: bridge.address, model: "cfg", timeoutMs: 30_000 }),
      );
      const { run: some, logits } = await decode("some", {
        env: { GGML_BACKEND_PATH: pluginPath(), MOESWARM_CONFIG: config },
      });
      expect(some.ok, some.stderr).toBe(true);
      expect(Object.keys(some.plugin!.layers)).toEqual(["1", "3"]);
      expect(some.plugin!.splits).toBe(2 * (N_PREDICT + 1));
      expect(some.plugin!.weightsDroppedTensors).toBe(2 * 3);
      expect(firstByteDiff(logits, plainLogits)).toBe(-1);
    });

    it("over TCP (MOESWARM_BRIDGE=tcp:host:port): the same bytes", async () => {
      await using swarm = await startSplitSwarm(model, info, 2, tmp.dir, MODEL_ID, "t");
      await using bridge = await swarmBridge(swarm, { host: "127.0.0.1", port: 0 });
      expect(bridge.address).toMatch(/^tcp:127\.0\.0\.1:\d+$/);
      const { run, logits } = await decode("tcp", {
        plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
      });
      expect(run.ok, run.stderr).toBe(true);
      expect(firstByteDiff(logits, plainLogits)).toBe(-1);
      expect(bridge.metrics().requests).toBe(run.plugin!.splits);
    });

    it("a worker killed mid-decode: its replica takes over, the tokens and logits stay identical", async () => {
      const [a, b] = split(info.nExpert, 2);
      await using swarm = await startSwarm(
        model,
        [
          { id: "a", experts: a! },
          { id: "b", experts: b! },
          { id: "a-replica", experts: a! },
        ],
        tmp.dir,
        MODEL_ID,
      );
      await using fallback = await createLocalFallback(model);
      let seen = 0;
      await using bridge = await swarmBridge(swarm, join(tmp.dir, "replica.sock"), {
        onStats: () => {
          // a third of the way into the decode
          if (++seen === Math.floor(((N_PREDICT + 1) * info.layers.length) / 3)) {
            process.kill(swarm.workers.get("a")!.pid!, "SIGKILL");
            process.kill(swarm.workers.get("b")!.pid!, "SIGKILL");
          }
        },
        // b has no replica: the local fallback computes its experts from the model file
        fallback: fallback.compute,
      });
      const { run, logits } = await decode("replica", {
        plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
      });
      expect(run.ok, run.stderr).toBe(true);
      expect(run.tokens).toEqual(plainTokens);
      expect(firstByteDiff(logits, plainLogits)).toBe(-1);
      const m = bridge.metrics();
      expect(m.failed).toBe(0);
      expect(m.failovers).toBeGreaterThan(0);
      expect(m.fallbacks).toBeGreaterThan(0);
      expect(m.dispatch.owners["a-replica"]!.requests).toBeGreaterThan(0);
    });

    it("no bridge listening: llama_decode fails cleanly with a clear message, no hang", async () => {
      const run = await runLogitsHarness({
        modelPath: model,
        prompt: PROMPT,
        nPredict: 4,
        threads: 1,
        plugin: { bridge: `unix:${join(tmp.dir, "nobody.sock")}`, layers: "all", model: MODEL_ID },
        timeoutMs: 60_000,
      });
      expect(run.ok).toBe(false);
      expect(run.exitCode).toBe(1);
      expect(run.tokens).toEqual([]);
      expect(run.stderr).toMatch(/cannot connect to the bridge/);
      expect(run.stderr).toMatch(/llama_decode failed/);
    });

    it("a bridge that dies mid-decode, and a dispatch that fails: the decode fails, never a wrong token", async () => {
      const [a] = split(info.nExpert, 1);
      // restart off: the worker killed below must stay gone (no replica, no fallback)
      await using swarm = await startSwarm(model, [{ id: "only", experts: a! }], tmp.dir, MODEL_ID, {
        restart: false,
      });
      let seen = 0;
      const bridge = await swarmBridge(swarm, join(tmp.dir, "dies.sock"), {
        onStats: () => {
          if (++seen === 10) void bridge.close();
        },
      });
      const run = await runLogitsHarness({
        modelPath: model,
        prompt: PROMPT,
        nPredict: N_PREDICT,
        threads: 1,
        plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
        timeoutMs: 60_000,
      });
      expect(run.ok).toBe(false);
      expect(run.tokens.length).toBeLessThan(N_PREDICT);
      expect(run.tokens).toEqual(plainTokens.slice(0, run.tokens.length));
      expect(run.stderr).toMatch(/llama_decode failed/);

      // a worker that is gone with no replica and no fallback: an error frame, the decode fails
      process.kill(swarm.workers.get("only")!.pid!, "SIGKILL");
      await using bridge2 = await swarmBridge(swarm, join(tmp.dir, "fails.sock"));
      const failed = await runLogitsHarness({
        modelPath: model,
        prompt: PROMPT,
        nPredict: 4,
        threads: 1,
        plugin: { bridge: bridge2.address, layers: "all", model: MODEL_ID },
      });
      expect(failed.ok).toBe(false);
      expect(failed.stderr).toMatch(/MOESWARM_DISPATCH_FAILED|MOESWARM_TRANSPORT_CLOSED/);
      expect(bridge2.metrics().failed).toBeGreaterThan(0);
    });
  },
);

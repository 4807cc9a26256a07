// The model families beyond the three toy ones, through plain llama.cpp and through llama.cpp +
// libggml-moeswarm.so + llama-cpu workers (every MoE layer remote): the same greedy tokens and the
// same logits, byte for byte, with exactly one plugin split per MoE layer and ubatch. qwen35moe's
// shared expert and its sigmoid gate stay in the backbone (qwen35moe.cpp build_layer_ffn adds them
// after build_moe_ffn), so they are not part of the split: the split is the routed part only.
// gpt-oss's router bias and softmax over the selected experts run in the backbone too; its expert
// biases travel in the slices and its swiglu_oai runs on the workers. glm4moe's sigmoid router,
// its selection bias (exp_probs_b) and weight scale run in the backbone, its shared expert too; its
// leading dense layer has no experts and no split. deepseek2 (as DeepSeek-V3 and Kimi K2 ship):
// grouped top-k on sigmoid scores plus the selection bias, also in the backbone. llama4 is not
// here: its workers refuse the weight-before-FFN routing (MOESWARM_NATIVE_LOAD at slice load).
//
// MOESWARM_SHAPE_TRUE=1 also runs the shape-true qwen35moe preset (Qwen3.5-122B-A10B's layers,
// ~6 GB, synthesised once into the model cache) and prints the decode figures.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import {
  ensureSyntheticModel,
  ggmlTypeName,
  readGguf,
  type SyntheticArch,
  type SyntheticPreset,
} from "@moeswarm/shard";
import { ggmlQuantize } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type BackboneBridge, runLogitsHarness, serveBackboneBridge } from "../src/index.js";
import {
  firstByteDiff,
  MODEL_CACHE,
  type ModelInfo,
  modelInfo,
  nativeMissing,
  type Swarm,
  split,
  startSplitSwarm,
  syntheticModel,
  tempDir,
} from "./helpers.js";

const missing = nativeMissing();
const MODEL_ID = "families";
const PROMPT = "The swarm computes every expert";

interface Case {
  preset: SyntheticPreset;
  arch: SyntheticArch;
  workers: number;
  nPredict: number;
  /** Expert tensors llama.cpp hands the plugin per layer: gate/up/down (gpt-oss: and their biases). */
  expertTensors: number;
  /** The layers with routed experts (glm4moe's leading dense layer has none). */
  moeLayers: number[];
}

const CASES: Case[] = [
  { preset: "tiny", arch: "qwen35moe", workers: 2, nPredict: 32, expertTensors: 3, moeLayers: [0, 1, 2, 3] },
  { preset: "tiny", arch: "qwen35moe", workers: 3, nPredict: 32, expertTensors: 3, moeLayers: [0, 1, 2, 3] },
  { preset: "tiny", arch: "gpt-oss", workers: 2, nPredict: 32, expertTensors: 6, moeLayers: [0, 1] },
  { preset: "tiny", arch: "glm4moe", workers: 2, nPredict: 32, expertTensors: 3, moeLayers: [1, 2] },
  { preset: "tiny", arch: "deepseek2", workers: 3, nPredict: 32, expertTensors: 3, moeLayers: [1, 2] },
];
const SHAPE_TRUE = process.env.MOESWARM_SHAPE_TRUE === "1";
if (SHAPE_TRUE)
  CASES.push({
    preset: "shape",
    arch: "qwen35moe",
    workers: 2,
    nPredict: 16,
    expertTensors: 3,
    moeLayers: [0, 1, 2, 3],
  });
else console.warn("skipping the shape-true qwen35moe equivalence: set MOESWARM_SHAPE_TRUE=1 (~6 GB model)");

describe.skipIf(Boolean(missing))("model families: plain llama.cpp vs llama.cpp + plugin + swarm", () => {
  const tmp = tempDir("mswb-fam-");
  afterAll(() => tmp.remove());

  for (const c of CASES) {
    describe(`${c.preset} ${c.arch}, ${c.workers} workers, every MoE layer remote`, () => {
      let model: string;
      let info: ModelInfo;
      let swarm: Swarm;
      let bridge: BackboneBridge;
      let plainLogits: Buffer;
      let plainTokens: number[];
      let plainDecodeMs: number;
      let sliceBytesPerExpert: number;
      const tag = `${c.arch}-${c.preset}-${c.workers}`;

      beforeAll(async () => {
        const t0 = performance.now();
        // the shape-true model's weights are direct blocks; ggml's own quantiser for the rest
        // (token_embd, output): the same bytes as the shard quantisers, many times faster
        model =
          c.preset === "shape"
            ? (
                await ensureSyntheticModel(c.preset, {
                  cacheDir: MODEL_CACHE,
                  arch: c.arch,
                  quantize: (type, values, ne0) => ggmlQuantize(ggmlTypeName(type), values, ne0),
                })
              ).path
            : await syntheticModel(c.preset, c.arch);
        console.log(`${tag}: model ready in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
        info = await modelInfo(model);
        // a 3 GB slice per worker loads in minutes on a loaded machine
        const spawn = c.preset === "shape" ? { startTimeoutMs: 1_800_000 } : {};
        swarm = await startSplitSwarm(model, info, c.workers, tmp.dir, MODEL_ID, "w", spawn);
        const w0 = await readGguf(join(tmp.dir, "w0.gguf"));
        const w0Experts = split(info.nExpert, c.workers)[0]!.length;
        sliceBytesPerExpert = Number(w0.tensors.reduce((s, t) => s + t.nbytes, 0n)) / w0Experts;
        bridge = await serveBackboneBridge({
          socket: join(tmp.dir, `${tag}.sock`),
          placement: swarm.placement,
          transport: swarm.transport,
        });
        const plain = await runLogitsHarness({
          modelPath: model,
          prompt: PROMPT,
          nPredict: c.nPredict,
          threads: 1,
          // a shape-true token costs real layers' compute, loading 6 GB minutes on a loaded machine
          timeoutMs: c.preset === "shape" ? 1_800_000 : undefined,
          logitsPath: join(tmp.dir, `${tag}-plain.bin`),
        });
        expect(plain.ok, plain.stderr).toBe(true);
        expect(plain.plugin).toBeNull();
        plainLogits = readFileSync(join(tmp.dir, `${tag}-plain.bin`));
        plainTokens = plain.tokens;
        plainDecodeMs = plain.decodeMs;
      }, 3_600_000);
      afterAll(async () => {
        await bridge?.close();
        await swarm?.close();
      });

      it("identical tokens, bit-identical logits, one split per MoE layer and ubatch", async () => {
        const before = bridge.metrics().requests;
        const run = await runLogitsHarness({
          modelPath: model,
          prompt: PROMPT,
          nPredict: c.nPredict,
          threads: 1,
          // a shape-true token costs real layers' compute, loading 6 GB minutes on a loaded machine
          timeoutMs: c.preset === "shape" ? 1_800_000 : undefined,
          logitsPath: join(tmp.dir, `${tag}-swarm.bin`),
          plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
        });
        expect(run.ok, run.stderr).toBe(true);
        expect(run.tokens).toHaveLength(c.nPredict);
        expect(run.tokens).toEqual(plainTokens);
        const logits = readFileSync(join(tmp.dir, `${tag}-swarm.bin`));
        expect(logits.byteLength).toBe((c.nPredict + 1) * run.nVocab * 4);
        expect(firstByteDiff(logits, plainLogits)).toBe(-1);

        const ubatches = c.nPredict + 1;
        const plugin = run.plugin!;
        expect(plugin.failures).toBe(0);
        // every layer of the family is MoE, the Gated DeltaNet ones as well as the attention ones
        expect(info.layers).toEqual(c.moeLayers);
        expect(plugin.splits).toBe(ubatches * info.layers.length);
        for (const layer of info.layers) expect(plugin.layers[String(layer)]!.count).toBe(ubatches);
        expect(plugin.weightsDroppedTensors).toBe(info.layers.length * c.expertTensors);
        expect(bridge.metrics().requests - before).toBe(plugin.splits);
        expect(bridge.metrics().fallbacks).toBe(0);
        const tokS = (ms: number) => ((c.nPredict - 1) / (ms / 1000)).toFixed(2);
        console.log(
          `${tag}: ${info.layers.length} MoE layers, ${plugin.splits / ubatches} split(s) per ubatch, ` +
            `slice ${sliceBytesPerExpert} bytes per expert (all layers); ` +
            `decode plain ${tokS(plainDecodeMs)} tok/s, swarm ${tokS(run.decodeMs)} tok/s; ` +
            `per layer ${JSON.stringify(plugin.layers[String(info.layers[0])])}`,
        );
      }, 3_600_000);
    });
  }
});

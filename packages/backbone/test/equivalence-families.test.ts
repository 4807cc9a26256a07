// The model families beyond the three toy ones, through plain llama.cpp and through llama.cpp +
// libggml-moeswarm.so + llama-cpu workers (every MoE layer remote): the same greedy tokens and the
// same logits, byte for byte, with exactly one plugin split per MoE layer and ubatch. qwen35moe's
// shared expert and its sigmoid gate stay in the backbone (qwen35moe.cpp build_layer_ffn adds them
// after build_moe_ffn), so they are not part of the split: the split is the routed part only.
// gpt-oss's router bias and softmax over the selected experts run in the backbone too; its expert
// biases travel in the slices and its swiglu_oai runs on the workers. glm4moe's sigmoid router,
// its selection bias (exp_probs_b) and weight scale run in the backbone, its shared expert too; its
// leading dense layer has no experts and no split. deepseek2 (as DeepSeek-V3 and Kimi K2 ship):
// grouped top-k on sigmoid scores plus the selection bias, also in the backbone. llama4: top-1 on
// the raw router logits, and the sigmoid weight multiplies the expert *input* (build_moe_ffn's
// weight_before_ffn, ffn_moe_weighted) in the backbone, before the split; the split takes those
// weighted rows and sums the expert outputs unweighted. Its shared expert and the dense layers
// between the MoE ones (interleave_moe_layer_step 2) stay in the backbone.
//
// MOESWARM_SHAPE_TRUE=1 also runs the shape-true qwen35moe preset (Qwen3.5-122B-A10B's layers,
// ~6 GB, synthesised once into the model cache) and prints the decode figures.
import { join } from "node:path";
import {
  ensureSyntheticModel,
  ggmlTypeName,
  readGguf,
  type SyntheticArch,
  type SyntheticMoeOptions,
  type SyntheticPreset,
  synthesizeMoeModel,
  syntheticPreset,
} from "@moeswarm/shard";
import { ggmlQuantize } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { BackboneBridge, LogitsHarnessOptions } from "../src/index.js";
import {
  decodeLogits,
  expectEquivalent,
  MODEL_CACHE,
  type ModelInfo,
  modelInfo,
  nativeMissing,
  type Swarm,
  split,
  startSplitSwarm,
  swarmBridge,
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
  /** Options over the preset's, the model written into the test's directory (not the cache). */
  overrides?: Partial<SyntheticMoeOptions>;
}

const CASES: Case[] = [
  { preset: "tiny", arch: "qwen35moe", workers: 2, nPredict: 32, expertTensors: 3, moeLayers: [0, 1, 2, 3] },
  { preset: "tiny", arch: "qwen35moe", workers: 3, nPredict: 32, expertTensors: 3, moeLayers: [0, 1, 2, 3] },
  { preset: "tiny", arch: "gpt-oss", workers: 2, nPredict: 32, expertTensors: 6, moeLayers: [0, 1] },
  { preset: "tiny", arch: "glm4moe", workers: 2, nPredict: 32, expertTensors: 3, moeLayers: [1, 2] },
  { preset: "tiny", arch: "deepseek2", workers: 3, nPredict: 32, expertTensors: 3, moeLayers: [1, 2] },
  { preset: "tiny", arch: "llama4", workers: 2, nPredict: 32, expertTensors: 3, moeLayers: [1, 3] },
  // Llama 4 ships top-1; top-2 makes llama.cpp weight two rows per token before the split, which
  // the plugin sends as one row per slot and adds back in slot order
  {
    preset: "tiny",
    arch: "llama4",
    workers: 3,
    nPredict: 32,
    expertTensors: 3,
    moeLayers: [1, 3],
    overrides: { nExpertUsed: 2 },
  },
  { preset: "tiny", arch: "minimax-m2", workers: 2, nPredict: 32, expertTensors: 3, moeLayers: [0, 1] },
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
    const custom = c.overrides ? ` ${JSON.stringify(c.overrides)}` : "";
    describe(`${c.preset} ${c.arch}${custom}, ${c.workers} workers, every MoE layer remote`, () => {
      let model: string;
      let info: ModelInfo;
      let swarm: Swarm;
      let bridge: BackboneBridge;
      let plainLogits: Buffer;
      let plainTokens: number[];
      let plainDecodeMs: number;
      let sliceBytesPerExpert: number;
      const tag = `${c.arch}-${c.preset}-${c.workers}${c.overrides ? "-custom" : ""}`;
      // a shape-true token costs real layers' compute, and loading 6 GB takes minutes on a loaded machine
      const shapeTimeout = c.preset === "shape" ? { timeoutMs: 1_800_000 } : {};
      const decode = (name: string, extra?: Partial<LogitsHarnessOptions>) =>
        decodeLogits({ model, prompt: PROMPT, nPredict: c.nPredict, dir: tmp.dir }, `${tag}-${name}`, extra);

      beforeAll(async () => {
        const t0 = performance.now();
        const custom = join(tmp.dir, `${c.arch}-custom.gguf`);
        if (c.overrides)
          await synthesizeMoeModel({ ...syntheticPreset(c.preset, c.arch), ...c.overrides }, custom);
        // the shape-true model's routed experts are direct blocks; ggml's own quantiser for the rest
        // of it and for minimax-m2's K-quants: the same bytes as shard's quantisers, many times faster
        model = c.overrides
          ? custom
          : c.preset === "shape" || c.arch === "minimax-m2"
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
        bridge = await swarmBridge(swarm, join(tmp.dir, `${tag}.sock`));
        const { run: plain, logits } = await decode("plain", shapeTimeout);
        expect(plain.ok, plain.stderr).toBe(true);
        expect(plain.plugin).toBeNull();
        plainLogits = logits;
        plainTokens = plain.tokens;
        plainDecodeMs = plain.decodeMs;
      }, 3_600_000);
      afterAll(async () => {
        await bridge?.close();
        await swarm?.close();
      });

      it("identical tokens, bit-identical logits, one split per MoE layer and ubatch", async () => {
        const before = bridge.metrics().requests;
        const { run, logits } = await decode("swarm", {
          ...shapeTimeout,
          plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
        });
        // every layer of the family is MoE, the Gated DeltaNet ones as well as the attention ones
        expect(info.layers).toEqual(c.moeLayers);
        expectEquivalent({
          run,
          logits,
          plainTokens,
          plainLogits,
          nPredict: c.nPredict,
          layers: info.layers,
          expertTensors: c.expertTensors,
          bridge,
          requestsBefore: before,
        });
        const ubatches = c.nPredict + 1;
        const plugin = run.plugin!;
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

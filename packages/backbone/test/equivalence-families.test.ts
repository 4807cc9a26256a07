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
import { readGguf, type SyntheticMoeOptions, synthesizeMoeModel, syntheticPreset } from "@moeswarm/shard";
import { afterAll, describe, expect, it } from "vitest";
import { equivalenceRun, type ModelCase } from "./equivalence-run.js";
import { nativeMissing, split, tempDir } from "./helpers.js";

const missing = nativeMissing();
const MODEL_ID = "families";

interface Case extends ModelCase {
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

  /** The case's preset with its overrides, written into the test's directory (not the cache). */
  const customModel = async (c: Case) => {
    const path = join(tmp.dir, `${c.arch}-custom.gguf`);
    await synthesizeMoeModel({ ...syntheticPreset(c.preset, c.arch), ...c.overrides }, path);
    return path;
  };

  for (const c of CASES) {
    const custom = c.overrides ? ` ${JSON.stringify(c.overrides)}` : "";
    describe(`${c.preset} ${c.arch}${custom}, ${c.workers} workers, every MoE layer remote`, () => {
      const tag = `${c.arch}-${c.preset}-${c.workers}${c.overrides ? "-custom" : ""}`;
      const eq = equivalenceRun({
        case: c,
        tag,
        dir: tmp.dir,
        modelId: MODEL_ID,
        ...(c.overrides ? { model: () => customModel(c) } : {}),
        // on a loaded machine a 3 GB slice per worker loads in minutes, the 6 GB model too, and a
        // shape-true token costs real layers' compute
        ...(c.preset === "shape"
          ? { spawn: { startTimeoutMs: 1_800_000 }, harness: { timeoutMs: 1_800_000 } }
          : {}),
        setupTimeoutMs: 3_600_000,
      });

      it("identical tokens, bit-identical logits, one split per MoE layer and ubatch", async () => {
        // every layer of the family is MoE, the Gated DeltaNet ones as well as the attention ones
        expect(eq.info.layers).toEqual(c.moeLayers);
        const { run } = await eq.expectSwarmEquivalent();
        const { info } = eq;
        const w0 = await readGguf(join(tmp.dir, "w0.gguf"));
        const w0Experts = split(info.nExpert, c.workers)[0]!.length;
        const sliceBytesPerExpert = Number(w0.tensors.reduce((s, t) => s + t.nbytes, 0n)) / w0Experts;
        const ubatches = c.nPredict + 1;
        const plugin = run.plugin!;
        const tokS = (ms: number) => ((c.nPredict - 1) / (ms / 1000)).toFixed(2);
        console.log(
          `${tag}: ${info.layers.length} MoE layers, ${plugin.splits / ubatches} split(s) per ubatch, ` +
            `slice ${sliceBytesPerExpert} bytes per expert (all layers); ` +
            `decode plain ${tokS(eq.plain.decodeMs)} tok/s, swarm ${tokS(run.decodeMs)} tok/s; ` +
            `per layer ${JSON.stringify(plugin.layers[String(info.layers[0])])}`,
        );
      }, 3_600_000);
    });
  }
});

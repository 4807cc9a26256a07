import { synthesizeMoeModel, syntheticPreset } from "./src/index.js";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";
const archs = (process.env.ARCHS ?? "qwen3moe,qwen2moe,mixtral").split(",");
const preset = (process.env.PRESET ?? "tiny") as "tiny";
const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, progressLogs: false, logLevel: LlamaLogLevel.error, maxThreads: 1 });
const prompts = ["The swarm computes every expert", "The river starts in the hills above the town.", "Once upon a time"];
for (const arch of archs) {
  const path = `/tmp/lmx/${arch}-${preset}.gguf`;
  const t0 = performance.now();
  await synthesizeMoeModel(syntheticPreset(preset, arch as any), path);
  const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 });
  console.log(`== ${arch} ${preset} synth ${(performance.now()-t0).toFixed(0)} ms`);
  for (const p of prompts) {
    const ctx = await model.createContext({ contextSize: 256, batchSize: 64, threads: 1 });
    const seq = ctx.getSequence();
    const out: number[] = [];
    for await (const tk of seq.evaluate(model.tokenize(p), { temperature: 0 })) { out.push(tk); if (out.length >= 48) break; }
    console.log(JSON.stringify(p + " ||" + model.detokenize(out)));
    await ctx.dispose();
  }
  await model.dispose();
}

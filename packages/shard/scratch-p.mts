import { getLlama, LlamaLogLevel } from "node-llama-cpp";
import { syntheticLanguageModel } from "./src/synth/language-model.js";
const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, progressLogs: false, logLevel: LlamaLogLevel.error, maxThreads: 1 });
const model = await llama.loadModel({ modelPath: "/tmp/lmx/qwen3moe-tiny.gguf", gpuLayers: 0 });
const lm = syntheticLanguageModel(512, 64, 1, 2.5);
const ctx = await model.createContext({ contextSize: 256, batchSize: 64, threads: 1 });
const seq = ctx.getSequence();
let n = 0;
for await (const step of seq.evaluateWithMetadata(model.tokenize("The river"), { probabilities: true }, { temperature: 4, seed: 3, topK: 512, topP: 1, minP: 0 })) {
  const p = step.probabilities!;
  let forb = 0, forbMax = 0, allowedSum = 0;
  for (const [t, v] of p) { if (!lm.generated[t]) { forb++; forbMax = Math.max(forbMax, v); } else allowedSum += v; }
  console.log(p.size, forb, forbMax, allowedSum.toFixed(4), JSON.stringify(model.detokenize([step.token])));
  if (++n > 5) break;
}

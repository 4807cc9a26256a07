// Loads a GGUF with llama.cpp through node-llama-cpp 3.21.1 (its prebuilt binary only: never a
// build or a download) using node-llama-cpp's own CPU/GPU split option (gpuLayers), creates a
// context of the planned shape, decodes a few tokens and reports what llama.cpp logged about
// its buffers. A child process of the tests, so a llama.cpp abort cannot take the runner down.
import { LlamaLogLevel, prebuiltCpuLlama } from "./llama-child.mjs";

const [modelPath, optionsJson] = process.argv.slice(2);
const options = JSON.parse(optionsJson);
const logs = [];
const llama = await prebuiltCpuLlama({
  logLevel: LlamaLogLevel.info,
  logger: (_level, message) => logs.push(message),
});
const model = await llama.loadModel({ modelPath, gpuLayers: options.gpuLayers });
const context = await model.createContext({
  contextSize: options.contextSize,
  batchSize: options.batchSize,
  flashAttention: options.flashAttention,
  threads: 1,
});
const sequence = context.getSequence();
const tokens = [...model.tokenize("The river starts in the hills above the town.")];
const out = [];
for await (const token of sequence.evaluate(tokens, { temperature: 0 })) {
  out.push(token);
  if (out.length >= 4) break;
}
const result = {
  gpu: llama.gpu,
  gpuLayers: model.gpuLayers,
  contextSize: context.contextSize,
  tokens: out,
  logs: logs.filter((l) => /buffer size|llama_kv_cache: size|llama_memory_recurrent: size/.test(l)),
};
await context.dispose();
await model.dispose();
await llama.dispose();
process.stdout.write(JSON.stringify(result));

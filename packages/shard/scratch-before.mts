import { getLlama, LlamaLogLevel } from "node-llama-cpp";
const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, progressLogs: false, logLevel: LlamaLogLevel.error, maxThreads: 1 });
const model = await llama.loadModel({ modelPath: process.argv[2]!, gpuLayers: 0 });
for (const p of ["The swarm computes every expert", "Once upon a time"]) {
  const ctx = await model.createContext({ contextSize: 256, batchSize: 64, threads: 1 });
  const out: number[] = [];
  for await (const tk of ctx.getSequence().evaluate(model.tokenize(p), { temperature: 0 })) { out.push(tk); if (out.length >= 64) break; }
  console.log(JSON.stringify(p + " ||" + model.detokenize(out)));
  await ctx.dispose();
}

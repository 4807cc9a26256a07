import { readFileSync, writeFileSync } from "node:fs";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";
import { readGguf, findTensor } from "./src/index.js";
const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, progressLogs: false, logLevel: LlamaLogLevel.error, maxThreads: 1 });
async function greedy(path: string, prompt: string) {
  const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 });
  const ctx = await model.createContext({ contextSize: 256, batchSize: 64, threads: 1 });
  const out: number[] = [];
  for await (const tk of ctx.getSequence().evaluate(model.tokenize(prompt), { temperature: 0 })) { out.push(tk); if (out.length >= 64) break; }
  const text = model.detokenize(out); await ctx.dispose(); await model.dispose(); return { out, text };
}
const preset = process.env.PRESET ?? "tiny";
for (const arch of ["qwen3moe", "qwen2moe", "mixtral"]) {
  const path = `/tmp/lmx/${arch}-${preset}.gguf`;
  const h = await readGguf(path);
  const f = readFileSync(path);
  for (const layer of [0, 1]) {
    const t = findTensor(h, `blk.${layer}.ffn_down_exps.weight`)!;
    const slab = Number(t.nbytes) / t.shape[2]!;
    const o = Number(t.absoluteOffset);
    const g = Buffer.from(f);
    f.copy(g, o, o + slab, o + 2 * slab); f.copy(g, o + slab, o, o + slab);
    writeFileSync("/tmp/lmx/swapped.gguf", g);
    for (const p of ["The swarm computes every expert", "Once upon a time"]) {
      const a = await greedy(path, p), b = await greedy("/tmp/lmx/swapped.gguf", p);
      const first = a.out.findIndex((x, i) => x !== b.out[i]);
      console.log(arch, "L" + layer, JSON.stringify(p), "first diff at", first, first >= 0 ? JSON.stringify(b.text.slice(0, 120)) : "");
    }
  }
}

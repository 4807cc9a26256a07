// Loads GGUF models with llama.cpp (node-llama-cpp 3.21.1, its prebuilt CPU binary only: never a
// build or a download), tokenises prompts and decodes greedily, twice per model with a fresh
// context. Runs in a child process of the tests, so a crash inside llama.cpp cannot take the test
// runner down. Prints one JSON object on stdout.
import { prebuiltCpuLlama, withSequence } from "./llama-child.mjs";

const [modelsJson, promptsJson, nTokensText] = process.argv.slice(2);
const models = JSON.parse(modelsJson);
const prompts = JSON.parse(promptsJson);
const nTokens = Number(nTokensText);

const llama = await prebuiltCpuLlama();

async function decode(model, tokens) {
  return withSequence(model, async (sequence) => {
    const out = [];
    const margins = [];
    for await (const step of sequence.evaluateWithMetadata(
      tokens,
      { probabilities: true },
      { temperature: 0 },
    )) {
      const [first, second] = step.probabilities.entries();
      margins.push(Math.log(first[1] / second[1]));
      out.push(step.token);
      if (out.length >= nTokens) break;
    }
    return { tokens: out, margins };
  });
}

const results = [];
for (const path of models) {
  const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 });
  try {
    const tokenized = prompts.map((p) => {
      const tokens = [...model.tokenize(p)];
      return { prompt: p, tokens, text: model.detokenize(tokens) };
    });
    const first = await decode(model, tokenized[0].tokens);
    const second = await decode(model, tokenized[0].tokens);
    results.push({
      path,
      tokenized,
      runs: [first, second],
      text: model.detokenize(first.tokens),
    });
  } finally {
    await model.dispose();
  }
}
await llama.dispose();
process.stdout.write(`${JSON.stringify({ gpu: llama.gpu, results })}\n`);

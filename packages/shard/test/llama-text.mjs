// Reads synthetic models back with llama.cpp (node-llama-cpp 3.21.1's prebuilt CPU binary, never a
// build or a download): every token's piece as llama.cpp detokenises it, greedy text from each
// prompt, and the sampler's full probability table at a high temperature with no truncation.
// Runs in a child process of the tests (a llama.cpp abort fails the test, not the runner); prints
// one JSON object on stdout.
import { prebuiltCpuLlama, withSequence } from "./llama-child.mjs";

const { models, prompts, nTokens, sampleSteps } = JSON.parse(process.argv[2]);

const llama = await prebuiltCpuLlama();

async function greedy(model, prompt) {
  return withSequence(model, async (sequence) => {
    const tokens = [];
    for await (const token of sequence.evaluate(model.tokenize(prompt), { temperature: 0 })) {
      tokens.push(token);
      if (tokens.length >= nTokens) break;
    }
    return { prompt, tokens, text: model.detokenize(tokens) };
  });
}

/** Per step: how many tokens the sampler's table lists, and the largest probability of any token in `never`. */
async function sample(model, prompt, vocab, never) {
  const blocked = new Set(never);
  return withSequence(model, async (sequence) => {
    const steps = [];
    const options = { temperature: 4, topK: vocab, topP: 1, minP: 0, seed: 1 };
    for await (const step of sequence.evaluateWithMetadata(
      model.tokenize(prompt),
      { probabilities: true },
      options,
    )) {
      let neverMax = 0;
      let listed = 0;
      for (const [token, p] of step.probabilities) {
        listed++;
        if (blocked.has(token)) neverMax = Math.max(neverMax, p);
      }
      steps.push({ token: step.token, listed, neverMax });
      if (steps.length >= sampleSteps) break;
    }
    return steps;
  });
}

const results = [];
for (const m of models) {
  const model = await llama.loadModel({ modelPath: m.path, gpuLayers: 0 });
  try {
    const result = { path: m.path };
    if (m.pieces) {
      result.pieces = [];
      result.specialPieces = [];
      for (let id = 0; id < m.vocab; id++) {
        result.pieces.push(model.detokenize([id], false));
        result.specialPieces.push(model.detokenize([id], true));
      }
    }
    result.greedy = [];
    for (const prompt of m.prompts ?? prompts) result.greedy.push(await greedy(model, prompt));
    if (m.never) result.sampled = await sample(model, prompts[0], m.vocab, m.never);
    results.push(result);
  } finally {
    await model.dispose();
  }
}
await llama.dispose();
process.stdout.write(`${JSON.stringify({ gpu: llama.gpu, results })}\n`);

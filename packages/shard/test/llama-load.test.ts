// llama.cpp itself (the pinned release inside node-llama-cpp 3.21.1, prebuilt CPU binary) loads
// the synthetic models of every architecture, tokenises text with their BPE vocabulary and decodes
// greedily and deterministically, with clear top-1/top-2 margins. The model runs in a child
// process (test/llama-decode.mjs), so a llama.cpp abort fails the test instead of the runner.

import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import { SYNTHETIC_ARCHS, synthesizeMoeModel, syntheticPreset } from "../src/index.js";
import { buildTokenizer } from "../src/synth/tokenizer.js";

const tmp = tempDir("moeswarm-llama-");
afterAll(() => tmp.remove());

interface DecodeRun {
  tokens: number[];
  margins: number[];
}
interface DecodeResult {
  gpu: string | false;
  results: Array<{
    path: string;
    tokenized: Array<{ prompt: string; tokens: number[]; text: string }>;
    runs: [DecodeRun, DecodeRun];
    text: string;
  }>;
}

const PROMPTS = [
  "The river starts in the hills above the town.",
  'Experts compute their outputs, and the router adds them: 42 + 7 = 49!\nNew line, (brackets) & "quotes".',
  " leading space, trailing space ",
];
const N_TOKENS = 16;

function decode(paths: string[]): DecodeResult {
  const script = join(dirname(fileURLToPath(import.meta.url)), "llama-decode.mjs");
  const res = spawnSync(
    process.execPath,
    [script, JSON.stringify(paths), JSON.stringify(PROMPTS), String(N_TOKENS)],
    {
      encoding: "utf8",
      timeout: 180_000,
      cwd: join(dirname(fileURLToPath(import.meta.url)), ".."),
    },
  );
  if (res.status !== 0) {
    throw new Error(
      `llama-decode exited with ${res.status} (signal ${res.signal}):\n${res.stderr}\n${res.stdout}`,
    );
  }
  return JSON.parse(res.stdout) as DecodeResult;
}

describe("llama.cpp loads and decodes synthetic models", () => {
  it("for every synthetic architecture and a quantised qwen3moe", { timeout: 240_000 }, async () => {
    const paths: string[] = [];
    for (const arch of SYNTHETIC_ARCHS) {
      const path = join(tmp.dir, `${arch}.gguf`);
      await synthesizeMoeModel(syntheticPreset("tiny", arch), path);
      paths.push(path);
    }
    const quantised = join(tmp.dir, "qwen3moe-q4k.gguf");
    await synthesizeMoeModel(
      {
        ...syntheticPreset("tiny"),
        nEmbd: 256,
        nHead: 4,
        headDim: 64,
        nFfExp: 256,
        nExpert: 4,
        nExpertUsed: 2,
        nLayer: 1,
        types: { experts: "Q4_K", attention: "Q4_0", embeddings: "BF16", output: "Q8_0", router: "F16" },
      },
      quantised,
    );
    paths.push(quantised);

    const out = decode(paths);
    expect(out.gpu).toBe(false);
    const tok = buildTokenizer(512);
    const margins: number[] = [];
    for (const r of out.results) {
      // Text round-trips through llama.cpp's tokenizer, and the merges are in use: "The river..."
      // takes far fewer tokens than bytes, and " the" is the single token "Ġthe".
      for (const t of r.tokenized) {
        expect(t.text, r.path).toBe(t.prompt);
        expect(t.tokens.every((id) => id >= 0 && id < 512)).toBe(true);
      }
      expect(r.tokenized[0]!.tokens.length).toBeLessThan(PROMPTS[0]!.length / 2);
      expect(r.tokenized[0]!.tokens.map((id) => tok.tokens[id]).join("")).toBe(
        "TheĠriverĠstartsĠinĠtheĠhillsĠaboveĠtheĠtown.",
      );
      // Greedy decoding runs and is deterministic.
      const [a, b] = r.runs;
      expect(a.tokens.length, r.path).toBe(N_TOKENS);
      expect(b.tokens, r.path).toEqual(a.tokens);
      expect(b.margins).toEqual(a.margins);
      expect(new Set(a.tokens).size, `${r.path} decodes more than one token`).toBeGreaterThan(1);
      margins.push(...a.margins);
    }
    // Top-1/top-2 logit margins far above rounding noise: greedy choices are not near-ties. (The
    // smallest, over eight families' greedy steps, is ~3e-4: still ~100x the f32 rounding of
    // logits of this size, ~1e-6 relative.)
    margins.sort((x, y) => x - y);
    const median = margins[margins.length >> 1]!;
    expect(median).toBeGreaterThan(0.5);
    expect(margins[0]!).toBeGreaterThan(1e-4);
  });
});

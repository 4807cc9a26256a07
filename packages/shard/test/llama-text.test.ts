// The text synthetic models generate, read back by llama.cpp itself (node-llama-cpp 3.21.1, in a
// child process: test/llama-text.mjs): every token's piece is valid UTF-8 or the token can never be
// sampled, greedy decoding gives English-like text made of corpus words, and a wrong expert changes
// that text.

import { spawnSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  readGguf,
  SYNTHETIC_ARCHS,
  type SyntheticArch,
  type SyntheticMoeOptions,
  synthesizeMoeModel,
  syntheticPreset,
} from "../src/index.js";
import { TOKENIZER_CORPUS } from "../src/synth/corpus.js";
import { syntheticLanguageModel } from "../src/synth/language-model.js";
import { buildTokenizer, byteToChar, TOKEN_TYPE } from "../src/synth/tokenizer.js";

const here = dirname(fileURLToPath(import.meta.url));
const tmp = tempDir("moeswarm-text-");
afterAll(() => tmp.remove());

const PROMPTS = ["The swarm computes every expert", "Once upon a time", "The river starts in the hills"];
const N_TOKENS = 64;
const SAMPLE_STEPS = 24;

interface Greedy {
  prompt: string;
  tokens: number[];
  text: string;
}
interface TextResult {
  path: string;
  pieces?: string[];
  specialPieces?: string[];
  greedy: Greedy[];
  sampled?: Array<{ token: number; listed: number; neverMax: number }>;
}
interface ModelRequest {
  path: string;
  vocab: number;
  pieces?: boolean;
  never?: number[];
  prompts?: string[];
}

function readBack(models: ModelRequest[]): TextResult[] {
  const res = spawnSync(
    process.execPath,
    [
      join(here, "llama-text.mjs"),
      JSON.stringify({ models, prompts: PROMPTS, nTokens: N_TOKENS, sampleSteps: SAMPLE_STEPS }),
    ],
    { encoding: "utf8", timeout: 300_000, cwd: join(here, ".."), maxBuffer: 64 << 20 },
  );
  if (res.status !== 0) {
    throw new Error(
      `llama-text exited with ${res.status} (signal ${res.signal}):\n${res.stderr}\n${res.stdout}`,
    );
  }
  const out = JSON.parse(res.stdout) as { gpu: string | false; results: TextResult[] };
  expect(out.gpu).toBe(false);
  return out.results;
}

/** The bytes of a token as the tokenizer defines them (GPT-2's byte mapping undone). */
function tokenBytes(token: string): Uint8Array {
  const chars = byteToChar();
  return Uint8Array.from([...token].map((c) => chars.indexOf(c)));
}

const WORD = /[A-Za-z]+(?:'[a-z]+)?/g;
const wordsOf = (text: string) => [...text.matchAll(WORD)].map((m) => m[0].toLowerCase());
const CORPUS_WORDS = new Set(wordsOf(TOKENIZER_CORPUS));
const CORPUS_PAIRS = new Set(
  TOKENIZER_CORPUS.split("\n").flatMap((line) => {
    const w = wordsOf(line);
    return w.slice(1).map((x, i) => `${w[i]} ${x}`);
  }),
);

/**
 * Share of the text's words that are words of the corpus, share of its adjacent word pairs that
 * are adjacent somewhere in a line of the corpus, and how many distinct words it uses.
 */
function readability(text: string) {
  const words = wordsOf(text);
  const inCorpus = words.filter((w) => CORPUS_WORDS.has(w)).length;
  const pairs = words.slice(1).map((x, i) => `${words[i]} ${x}`);
  const attested = pairs.filter((p) => CORPUS_PAIRS.has(p)).length;
  return {
    words: words.length,
    corpusShare: inCorpus / Math.max(1, words.length),
    pairShare: attested / Math.max(1, pairs.length),
    distinct: new Set(words).size,
  };
}

/**
 * A copy of the model with experts 0 and 1 of every MoE layer's ffn_down_exps swapped: a wrong
 * expert wherever the router picks one of them (glm4moe and deepseek2 lead with dense layers, llama4
 * alternates, deepseek2's grouped routing seldom picks a given pair in its first MoE layer).
 * `everyPair`: experts 2i and 2i+1 swapped for every i, so every routed expert is a wrong one.
 */
async function swapExperts(path: string, out: string, everyPair = false): Promise<void> {
  const header = await readGguf(path);
  const downs = header.tensors.filter((x) => /^blk\.\d+\.ffn_down_exps\.weight$/.test(x.name));
  if (downs.length === 0) throw new Error(`${path} has no routed experts`);
  const bytes = readFileSync(path);
  const swapped = Buffer.from(bytes);
  for (const t of downs) {
    const slab = Number(t.nbytes) / t.shape[2]!;
    for (let e = 0; e < (everyPair ? t.shape[2]! : 2); e += 2) {
      const at = Number(t.absoluteOffset) + e * slab;
      bytes.copy(swapped, at, at + slab, at + 2 * slab);
      bytes.copy(swapped, at + slab, at, at + slab);
    }
  }
  writeFileSync(out, swapped);
}

interface Case {
  arch: SyntheticArch;
  preset: "tiny" | "small";
  path: string;
  /** Other options than the preset's (same vocabulary and width). */
  options?: SyntheticMoeOptions;
}

describe("synthetic models generate text a person can read", () => {
  const cases: Case[] = [
    ...SYNTHETIC_ARCHS.map((arch) => ({
      arch,
      preset: "tiny" as const,
      path: join(tmp.dir, `${arch}-tiny.gguf`),
    })),
    { arch: "qwen3moe", preset: "small", path: join(tmp.dir, "qwen3moe-small.gguf") },
    // As the shape-true preset: Q4_K_M types, experts written as random valid blocks (direct)
    {
      arch: "qwen35moe",
      preset: "small",
      path: join(tmp.dir, "qwen35moe-small-direct.gguf"),
      options: { ...syntheticPreset("small", "qwen35moe"), mix: "Q4_K_M", weights: "direct" },
    },
  ];
  let results: TextResult[];
  let swapped: TextResult[];

  beforeAll(async () => {
    const requests: ModelRequest[] = [];
    for (const c of cases) {
      const options = c.options ?? syntheticPreset(c.preset, c.arch);
      await synthesizeMoeModel(options, c.path);
      const lm = syntheticLanguageModel(options.vocab, options.nEmbd, options.seed);
      const never = [...lm.generated.keys()].filter((id) => lm.generated[id] === 0);
      requests.push({ path: c.path, vocab: options.vocab, pieces: true, never });
    }
    const swaps: ModelRequest[] = [];
    for (const c of cases.filter((x) => x.preset === "tiny" || x.options)) {
      const out = c.path.replace(".gguf", "-swapped.gguf");
      // 64 experts of which 8 are used: a single swapped pair is seldom routed to
      await swapExperts(c.path, out, c.options !== undefined);
      swaps.push({ path: out, vocab: syntheticPreset(c.preset, c.arch).vocab, prompts: [PROMPTS[0]!] });
    }
    const all = readBack([...requests, ...swaps]);
    results = all.slice(0, requests.length);
    swapped = all.slice(requests.length);
  }, 300_000);

  it("every token's piece, as llama.cpp detokenises it, is what the tokenizer defines; the pieces that are not valid UTF-8 are the 128 high byte tokens, never generated", () => {
    for (const [i, c] of cases.entries()) {
      const r = results[i]!;
      const vocab = syntheticPreset(c.preset, c.arch).vocab;
      const tok = buildTokenizer(vocab);
      const lm = syntheticLanguageModel(vocab, syntheticPreset(c.preset, c.arch).nEmbd, 1);
      expect(r.pieces).toHaveLength(vocab);
      const invalid: number[] = [];
      for (let id = 0; id < vocab; id++) {
        const control = tok.tokenTypes[id] === TOKEN_TYPE.CONTROL;
        // llama.cpp leaves control tokens out of text unless asked for special tokens
        if (control) {
          expect(r.pieces![id]).toBe("");
          expect(r.specialPieces![id]).toBe(tok.tokens[id]);
          expect(lm.generated[id]).toBe(0);
          continue;
        }
        const bytes = tokenBytes(tok.tokens[id]!);
        expect(r.pieces![id], `token ${id}`).toBe(new TextDecoder().decode(bytes));
        let valid = true;
        try {
          new TextDecoder("utf-8", { fatal: true }).decode(bytes);
        } catch {
          valid = false;
        }
        if (!valid) invalid.push(id);
        if (lm.generated[id]) {
          expect(valid, `generated token ${id}`).toBe(true);
          expect(r.pieces![id]).not.toContain("\uFFFD");
        }
      }
      // token b < 256 is byte b
      expect(invalid).toEqual([...Array(128).keys()].map((b) => b + 128));
    }
  });

  it("a never-generated token has probability exactly 0 in llama.cpp's sampler at temperature 4 with no truncation", () => {
    for (const r of results) {
      expect(r.sampled).toHaveLength(SAMPLE_STEPS);
      for (const step of r.sampled!) {
        expect(step.neverMax, r.path).toBe(0);
        expect(step.listed).toBeGreaterThan(256); // the whole table, not a truncated one
      }
    }
  });

  it("greedy decoding gives valid UTF-8 text made of corpus words", () => {
    const lines: string[] = [];
    for (const [i, c] of cases.entries()) {
      for (const g of results[i]!.greedy) {
        expect(g.tokens).toHaveLength(N_TOKENS);
        expect(g.text).not.toContain("\uFFFD");
        const r = readability(g.text);
        lines.push(
          `${c.arch} ${c.preset} ${JSON.stringify(g.prompt)} -> ${JSON.stringify(g.text)} (${r.words} words, ${(100 * r.corpusShare).toFixed(1)}% corpus words, ${(100 * r.pairShare).toFixed(1)}% corpus word pairs, ${r.distinct} distinct)`,
        );
      }
    }
    console.log(`[text]\n${lines.join("\n")}`);
    for (const [i] of cases.entries()) {
      for (const g of results[i]!.greedy) {
        const r = readability(g.text);
        expect(r.words).toBeGreaterThan(N_TOKENS / 2);
        expect(r.corpusShare).toBeGreaterThanOrEqual(0.95);
        expect(r.pairShare).toBeGreaterThanOrEqual(0.6);
        expect(r.distinct).toBeGreaterThanOrEqual(4);
      }
    }
  });

  it("a wrong expert (experts 0 and 1 swapped in every MoE layer; with direct weights every pair) changes the greedy tokens, in every family", () => {
    const swappedCases = cases.filter((x) => x.preset === "tiny" || x.options);
    for (const [k, s] of swapped.entries()) {
      const i = cases.indexOf(swappedCases[k]!);
      const original = results[i]!.greedy[0]!;
      const changed = s.greedy[0]!;
      const first = original.tokens.findIndex((t, j) => t !== changed.tokens[j]);
      const what = cases[i]!.options
        ? `${cases[i]!.arch} small direct, experts 2i/2i+1 swapped`
        : `${cases[i]!.arch} tiny, experts 0/1 swapped`;
      console.log(`[text] ${what}: first different token ${first}`);
      expect(first, what).toBeGreaterThanOrEqual(0);
      expect(changed.text).not.toContain("\uFFFD");
    }
  });
});

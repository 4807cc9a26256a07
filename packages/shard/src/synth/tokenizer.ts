import { InvalidArgumentError } from "@moeswarm/core";
import { TOKENIZER_CORPUS } from "./corpus.js";
import { Sfc32 } from "./prng.js";

/** llama.cpp's `llama_token_type` values (include/llama.h), as stored in tokenizer.ggml.token_type. */
export const TOKEN_TYPE = { NORMAL: 1, UNKNOWN: 2, CONTROL: 3, USER_DEFINED: 4, UNUSED: 5, BYTE: 6 } as const;

export const SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] as const;

/** A GPT-2 style byte-level BPE vocabulary: the 256 byte tokens, learned merges, special tokens. */
export interface SyntheticTokenizer {
  /** Token strings in id order (bytes mapped to printable characters as GPT-2 does). */
  readonly tokens: readonly string[];
  readonly tokenTypes: Int32Array;
  /** Merges in rank order, each `"left right"`. */
  readonly merges: readonly string[];
  readonly eosId: number;
  readonly bosId: number;
}

let byteChars: string[] | undefined;

/** GPT-2's `bytes_to_unicode`: byte b is written as this character in token strings. */
export function byteToChar(): readonly string[] {
  if (byteChars) return byteChars;
  const printable: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) printable.push(b);
  for (let b = 0xa1; b <= 0xac; b++) printable.push(b);
  for (let b = 0xae; b <= 0xff; b++) printable.push(b);
  const map = new Array<string>(256);
  for (const b of printable) map[b] = String.fromCharCode(b);
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (map[b] === undefined) map[b] = String.fromCharCode(256 + n++);
  }
  byteChars = map;
  return map;
}

// The pre-tokeniser of Qwen2 (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2), in JavaScript syntax.
const PRE_TOKENIZE =
  /(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+/gu;

/** Splits text as Qwen2's pre-tokeniser does, each piece in byte-mapped characters. */
export function preTokenize(text: string): string[] {
  const chars = byteToChar();
  const encoder = new TextEncoder();
  const pieces: string[] = [];
  for (const match of text.matchAll(PRE_TOKENIZE)) {
    let word = "";
    for (const b of encoder.encode(match[0])) word += chars[b];
    pieces.push(word);
  }
  return pieces;
}

function wordCounts(text: string): Map<string, number> {
  const counts = new Map<string, number>();
  for (const word of preTokenize(text)) counts.set(word, (counts.get(word) ?? 0) + 1);
  return counts;
}

const ranksOf = new WeakMap<SyntheticTokenizer, { ranks: Map<string, number>; ids: Map<string, number> }>();

/**
 * The token ids of one pre-tokenised piece, merged by rank as llama.cpp's BPE tokenizer does
 * (the lowest-ranked adjacent pair first).
 */
export function encodePiece(tok: SyntheticTokenizer, piece: string): number[] {
  let lookup = ranksOf.get(tok);
  if (!lookup) {
    lookup = {
      ranks: new Map(tok.merges.map((m, i) => [m, i])),
      ids: new Map(tok.tokens.map((t, i) => [t, i])),
    };
    ranksOf.set(tok, lookup);
  }
  const { ranks, ids } = lookup;
  const symbols = [...piece];
  for (;;) {
    let best = -1;
    let bestRank = Number.POSITIVE_INFINITY;
    for (let i = 0; i + 1 < symbols.length; i++) {
      const rank = ranks.get(`${symbols[i]} ${symbols[i + 1]}`);
      if (rank !== undefined && rank < bestRank) {
        bestRank = rank;
        best = i;
      }
    }
    if (best < 0) break;
    symbols.splice(best, 2, symbols[best]! + symbols[best + 1]!);
  }
  return symbols.map((s) => ids.get(s)!);
}

/** Largest vocabulary the synthetic tokenizer builds (real models stay below 2^18). */
export const MAX_VOCAB = 262_144;

const cache = new Map<number, SyntheticTokenizer>();

/**
 * Once the corpus has no pair left to merge (about 1,480 tokens), pairs of learned tokens make
 * up the rest, as the rare words of a real vocabulary: valid merges that ordinary text seldom
 * reaches. Every token but the 128 bytes >= 0x80 is whole UTF-8 (the corpus is ASCII), so the
 * language model can leave exactly those out of what it generates.
 */
function addRareMerges(tokens: string[], known: Set<string>, merges: string[], target: number): void {
  const rng = new Sfc32(0x5eed, 0xb9e);
  const learned = tokens.length;
  let misses = 0;
  while (tokens.length < target) {
    const leftId = rng.nextU32() % learned;
    const left = tokens[leftId]!;
    const right = tokens[256 + (rng.nextU32() % (learned - 256))]!;
    const merged = left + right;
    // A lone byte >= 0x80 is part of a UTF-8 sequence: a token made with one would not be text.
    const partial = leftId >= 0x80 && leftId < 256;
    if (partial || merged.length > 16 || known.has(merged) || right.startsWith("\u0120")) {
      if (++misses > 1_000_000) {
        throw new InvalidArgumentError(`cannot build a vocabulary of ${target} tokens`);
      }
      continue;
    }
    known.add(merged);
    tokens.push(merged);
    merges.push(`${left} ${right}`);
  }
}

/**
 * Learns byte-pair merges from the built-in English corpus until the vocabulary has `vocab`
 * tokens (256 bytes + merges + 3 special tokens); beyond what the corpus teaches, rare merges
 * fill the rest. Deterministic: pair-count ties go to the smaller pair string.
 */
export function buildTokenizer(vocab: number): SyntheticTokenizer {
  const cached = cache.get(vocab);
  if (cached) return cached;
  const minVocab = 256 + SPECIAL_TOKENS.length;
  if (!Number.isSafeInteger(vocab) || vocab < minVocab || vocab > MAX_VOCAB) {
    throw new InvalidArgumentError(
      `vocab must be an integer in [${minVocab}, ${MAX_VOCAB}], got ${String(vocab)}`,
    );
  }
  const target = vocab - SPECIAL_TOKENS.length;
  const chars = byteToChar();
  const tokens: string[] = [...chars];
  const known = new Set(tokens);
  const merges: string[] = [];
  const words = [...wordCounts(TOKENIZER_CORPUS)].map(([w, count]) => ({ symbols: [...w], count }));

  while (tokens.length < target) {
    const pairs = new Map<string, number>();
    for (const { symbols, count } of words) {
      for (let i = 0; i + 1 < symbols.length; i++) {
        const key = `${symbols[i]} ${symbols[i + 1]}`;
        pairs.set(key, (pairs.get(key) ?? 0) + count);
      }
    }
    let best: string | undefined;
    let bestCount = 0;
    for (const [key, count] of pairs) {
      if (count > bestCount || (count === bestCount && best !== undefined && key < best)) {
        best = key;
        bestCount = count;
      }
    }
    if (best === undefined) {
      addRareMerges(tokens, known, merges, target);
      break;
    }
    const space = best.indexOf(" ");
    const left = best.slice(0, space);
    const right = best.slice(space + 1);
    const merged = left + right;
    merges.push(best);
    if (!known.has(merged)) {
      known.add(merged);
      tokens.push(merged);
    }
    for (const word of words) {
      const s = word.symbols;
      if (s.length < 2) continue;
      const out: string[] = [];
      for (let i = 0; i < s.length; i++) {
        if (i + 1 < s.length && s[i] === left && s[i + 1] === right) {
          out.push(merged);
          i++;
        } else out.push(s[i]!);
      }
      word.symbols = out;
    }
  }
  const eosId = tokens.length;
  tokens.push(...SPECIAL_TOKENS);
  const tokenTypes = new Int32Array(tokens.length).fill(TOKEN_TYPE.NORMAL);
  tokenTypes.fill(TOKEN_TYPE.CONTROL, eosId);
  const result: SyntheticTokenizer = { tokens, tokenTypes, merges, eosId, bosId: eosId };
  cache.set(vocab, result);
  return result;
}

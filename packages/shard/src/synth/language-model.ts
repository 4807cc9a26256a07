// A small language model folded into a synthetic model's token_embd and output weights, so that
// greedy decoding reads as English-like text: a class-based bigram model of the built-in corpus.
//
// Each token's embedding is a constant component (the same for every token) plus one spike in the
// dimension of its context class (the most frequent corpus tokens each have their own class, all
// other tokens share one); the output row of a token the corpus uses as a whole word or punctuation
// holds, per class dimension, the centred log-probability of following that class. The layers
// (attention, experts) add their random outputs to the residual stream on top: they move the
// logits, so a wrong expert changes the text where the bigram's top candidates are close.
//
// Tokens the model must never emit (byte tokens, which are not whole UTF-8 sequences, word pieces,
// special tokens) have an output row that only reads the constant component, with a weight that
// puts their logits more than 1000 below every generated token's: their probability is exactly 0
// in f32 softmax (expf underflows below -104) at any temperature up to about 9.
import { TOKENIZER_CORPUS } from "./corpus.js";
import { hashString, Sfc32 } from "./prng.js";
import { buildTokenizer, encodePiece, preTokenize, type SyntheticTokenizer } from "./tokenizer.js";

/** What synthesize.ts needs: token_embd and output, row by row (one row per token id). */
export interface SyntheticLanguageModel {
  readonly vocab: number;
  readonly nEmbd: number;
  /** 1 for the tokens greedy decoding (or any sampling) can produce: whole corpus words and punctuation. */
  readonly generated: Uint8Array;
  /** Writes token `token`'s embedding (nEmbd values) into `out`. */
  embeddingRow(token: number, out: Float32Array): void;
  /** Writes token `token`'s row of the output matrix (nEmbd values) into `out`. */
  outputRow(token: number, out: Float32Array): void;
}

// Magnitudes relative to sqrt(nEmbd) (the residual of a layer adds about 1 per dimension): the
// constant component, the class spike, the jitter of tokens without a class of their own.
const CONSTANT = 1;
const SPIKE = 3;
const JITTER = 0.25;
/** Logit (before the output norm's weights) of a never-generated token: far below any other. */
const FORBIDDEN_LOGIT = -2000;
/** Add-lambda smoothing towards the unigram distribution. */
const SMOOTHING = 0.5;
/** Jitter of the generated tokens' output rows, in units of ln P. */
const TIE_BREAK = 0.05;

/** Natural logarithm from +, *, / only (exactly rounded everywhere, unlike libm's log). */
export function ln(x: number): number {
  let m = x;
  let e = 0;
  while (m >= 2) {
    m /= 2;
    e++;
  }
  while (m < 1) {
    m *= 2;
    e--;
  }
  // ln m = 2 atanh(z), z = (m - 1) / (m + 1) in [0, 1/3): 30 odd terms reach double precision.
  const z = (m - 1) / (m + 1);
  const z2 = z * z;
  let term = z;
  let sum = 0;
  for (let i = 1; i < 60; i += 2) {
    sum += term / i;
    term *= z2;
  }
  return 2 * sum + e * Math.LN2;
}

/** Bigram counts over the corpus's pieces that are one token each (a longer piece breaks the chain). */
interface CorpusCounts {
  unigram: Map<number, number>;
  /** prev -> (next -> count) */
  bigram: Map<number, Map<number, number>>;
  total: number;
}

/** A piece (in GPT-2's byte-mapped characters: Ġ a space, Ċ a newline) the model may generate. */
const WORD_OR_PUNCTUATION = /^Ġ?(?:[A-Za-z]+|[A-Za-z]+'[a-z]+|[.,;:!?]+Ċ*)$/;

function countCorpus(tok: SyntheticTokenizer): CorpusCounts {
  const unigram = new Map<number, number>();
  const bigram = new Map<number, Map<number, number>>();
  let total = 0;
  let prev = -1;
  for (const piece of preTokenize(TOKENIZER_CORPUS)) {
    const ids = encodePiece(tok, piece);
    // words and punctuation (digits one by one read as noise: "102424")
    const id = ids.length === 1 && WORD_OR_PUNCTUATION.test(piece) ? ids[0]! : -1;
    if (id >= 0) {
      unigram.set(id, (unigram.get(id) ?? 0) + 1);
      total++;
      if (prev >= 0) {
        const row = bigram.get(prev) ?? new Map<number, number>();
        bigram.set(prev, row);
        row.set(id, (row.get(id) ?? 0) + 1);
      }
    }
    prev = id;
  }
  return { unigram, bigram, total };
}

/** Classes, dimensions and the score table: everything rows are computed from. */
function buildModel(vocab: number, nEmbd: number, seed: number, logitScale: number): SyntheticLanguageModel {
  const tok = buildTokenizer(vocab);
  const { unigram, bigram, total } = countCorpus(tok);
  // Generated tokens, in id order; contexts ranked by how often they precede another word.
  const outputs = [...unigram.keys()].sort((a, b) => a - b);
  const contexts = [...bigram.keys()].sort((a, b) => {
    const d = (unigram.get(b) ?? 0) - (unigram.get(a) ?? 0);
    return d !== 0 ? d : a - b;
  });
  const nClass = Math.max(0, Math.min(nEmbd - 1, contexts.length + 1));
  const own = Math.max(0, nClass - 1); // contexts with a class of their own; the last class is "other"
  const outIndex = new Map(outputs.map((id, i) => [id, i]));
  const classOf = new Int32Array(vocab).fill(nClass - 1);
  for (let i = 0; i < own; i++) classOf[contexts[i]!] = i;

  // Seeded placement of the constant and the class dimensions.
  const rng = new Sfc32(hashString("language-model", seed >>> 0), nEmbd);
  const perm = Int32Array.from({ length: nEmbd }, (_, i) => i);
  for (let i = nEmbd - 1; i > 0; i--) {
    const j = rng.nextU32() % (i + 1);
    [perm[i], perm[j]] = [perm[j]!, perm[i]!];
  }
  const constDim = perm[0]!;
  const classDim = perm.subarray(1, 1 + nClass);

  // score[k * nOut + o]: centred ln P(output o | class k), smoothed towards the unigram.
  const nOut = outputs.length;
  const score = new Float64Array(nClass * nOut);
  for (let k = 0; k < nClass; k++) {
    const follow = new Float64Array(nOut);
    let n = 0;
    const members = k < own ? [contexts[k]!] : contexts.slice(own);
    for (const c of members) {
      for (const [next, count] of bigram.get(c) ?? []) {
        const o = outIndex.get(next);
        if (o === undefined) continue;
        follow[o]! += count;
        n += count;
      }
    }
    let mean = 0;
    for (let o = 0; o < nOut; o++) {
      const p = (follow[o]! + (SMOOTHING * unigram.get(outputs[o]!)!) / total) / (n + SMOOTHING);
      follow[o] = ln(p);
      mean += follow[o]!;
    }
    mean /= nOut;
    for (let o = 0; o < nOut; o++) score[k * nOut + o] = follow[o]! - mean;
  }
  // Centred per token as well: a word that follows almost anything (" the") would otherwise have a
  // long output row, and the layers' noise, projected on it, would pick it anywhere ("The the").
  // Its mean moves to the constant dimension, which every embedding carries.
  const tokenMean = new Float64Array(nOut);
  if (nClass > 0) {
    for (let o = 0; o < nOut; o++) {
      let m = 0;
      for (let k = 0; k < nClass; k++) m += score[k * nOut + o]!;
      m /= nClass;
      tokenMean[o] = m;
      for (let k = 0; k < nClass; k++) score[k * nOut + o]! -= m;
    }
  }

  const root = Math.sqrt(nEmbd);
  const constant = CONSTANT * root;
  const spike = SPIKE * root;
  // The output norm divides by the rms (about sqrt(CONSTANT^2 + SPIKE^2 + residual)); undo it
  // roughly so the logits are logitScale * ln P whatever nEmbd.
  const rms = Math.sqrt(CONSTANT * CONSTANT + SPIKE * SPIKE + 2);
  const classWeight = (logitScale * rms) / spike;
  const forbidWeight = (-FORBIDDEN_LOGIT * rms) / constant;
  const generated = new Uint8Array(vocab);
  for (const id of outputs) generated[id] = 1;

  return {
    vocab,
    nEmbd,
    generated,
    embeddingRow(token, out) {
      const k = classOf[token]!;
      if (k === nClass - 1) {
        // tokens without a class of their own differ a little (the same bits for the same seed)
        new Sfc32(hashString("embedding", seed >>> 0), token).fillTriangular(out, JITTER);
      } else out.fill(0);
      out[constDim] = constant;
      if (nClass > 0) out[classDim[k]!]! += spike;
    },
    outputRow(token, out) {
      out.fill(0);
      const o = outIndex.get(token);
      if (o === undefined) {
        out[constDim] = -forbidWeight;
        return;
      }
      // a seeded jitter far below the bigram's steps: no two tokens tie (equal counts would)
      new Sfc32(hashString("output", seed >>> 0), token).fillTriangular(out, TIE_BREAK * classWeight);
      out[constDim] = (classWeight * tokenMean[o]! * spike) / constant;
      for (let k = 0; k < nClass; k++) out[classDim[k]!]! += classWeight * score[k * nOut + o]!;
    },
  };
}

const models = new Map<string, SyntheticLanguageModel>();

/**
 * The language model for a vocabulary size, embedding width and seed (cached: token_embd and
 * output are written from the same one). `logitScale` multiplies the log-probabilities.
 */
export function syntheticLanguageModel(
  vocab: number,
  nEmbd: number,
  seed: number,
  logitScale = 2.5,
): SyntheticLanguageModel {
  const key = `${vocab}/${nEmbd}/${seed}/${logitScale}`;
  let model = models.get(key);
  if (!model) {
    model = buildModel(vocab, nEmbd, seed, logitScale);
    if (models.size > 16) models.clear();
    models.set(key, model);
  }
  return model;
}

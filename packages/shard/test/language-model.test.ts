// The language model folded into synthetic models' token_embd and output (language-model.ts),
// checked in JavaScript; test/llama-text.test.ts reads the written models back with llama.cpp.
import { describe, expect, it } from "vitest";
import { TOKENIZER_CORPUS } from "../src/synth/corpus.js";
import { ln, syntheticLanguageModel } from "../src/synth/language-model.js";
import { buildTokenizer, byteToChar, encodePiece, preTokenize, TOKEN_TYPE } from "../src/synth/tokenizer.js";

const bytesOf = (token: string) => Uint8Array.from([...token].map((c) => byteToChar().indexOf(c)));

describe("synthetic language model", () => {
  it("ln agrees with Math.log to double precision", () => {
    for (const x of [1e-300, 1e-9, 0.001, 0.3, 0.5, 1, 1.5, 2, Math.E, 10, 12345.678, 1e300]) {
      expect(Math.abs(ln(x) - Math.log(x)), String(x)).toBeLessThanOrEqual(
        4e-16 * Math.max(1, Math.abs(Math.log(x))),
      );
    }
  });

  it("generates only whole corpus words and punctuation, all valid UTF-8, never byte or special tokens", () => {
    for (const vocab of [512, 2048, 8192]) {
      const tok = buildTokenizer(vocab);
      const lm = syntheticLanguageModel(vocab, 64, 1);
      const generated = [...lm.generated.keys()].filter((id) => lm.generated[id] === 1);
      expect(generated.length, String(vocab)).toBeGreaterThan(50);
      const decoder = new TextDecoder("utf-8", { fatal: true });
      for (const id of generated) {
        expect(id >= 256 || id < 0x80, `byte token ${id}`).toBe(true);
        expect(tok.tokenTypes[id]).toBe(TOKEN_TYPE.NORMAL);
        const text = decoder.decode(bytesOf(tok.tokens[id]!));
        expect(text).toMatch(/^ ?(?:[A-Za-z]+|[A-Za-z]+'[a-z]+|[.,;:!?]+\n*)$/);
      }
      // every token but the bytes >= 0x80 and the specials is whole UTF-8 text
      for (let id = 0; id < tok.eosId; id++) {
        if (id >= 0x80 && id < 256) continue;
        expect(() => decoder.decode(bytesOf(tok.tokens[id]!)), `token ${id}`).not.toThrow();
      }
    }
  });

  it("encodes the corpus as llama.cpp's BPE would: merges by rank, every word of the corpus one token from ~1,500 tokens on", () => {
    const tok = buildTokenizer(2048);
    const pieces = preTokenize(TOKENIZER_CORPUS);
    expect(pieces.every((p) => encodePiece(tok, p).length === 1)).toBe(true);
    const small = buildTokenizer(512);
    expect(encodePiece(small, "Ġriver").map((id) => small.tokens[id])).toEqual(["Ġriver"]);
    expect(
      encodePiece(small, "Ġswarm")
        .map((id) => small.tokens[id])
        .join(""),
    ).toBe("Ġswarm");
  });

  it("puts the bigram's likeliest follower on top when the layers add nothing", () => {
    // logits of the embedding alone through the output rows (RMS norm with unit weights)
    const tok = buildTokenizer(2048);
    const nEmbd = 256;
    const lm = syntheticLanguageModel(2048, nEmbd, 1);
    const id = (t: string) => tok.tokens.indexOf(t);
    const e = new Float32Array(nEmbd);
    const o = new Float32Array(nEmbd);
    const next = (token: number) => {
      lm.embeddingRow(token, e);
      const rms = Math.sqrt(e.reduce((a, v) => a + v * v, 0) / nEmbd);
      let best = -1;
      let bestLogit = Number.NEGATIVE_INFINITY;
      for (let v = 0; v < 2048; v++) {
        lm.outputRow(v, o);
        let logit = 0;
        for (let i = 0; i < nEmbd; i++) logit += (o[i]! * e[i]!) / rms;
        if (logit > bestLogit) {
          bestLogit = logit;
          best = v;
        }
      }
      return tok.tokens[best];
    };
    expect(next(id("Ġriver"))).toBe("Ġrose"); // "the river rose" (twice in the corpus)
    expect(next(id("Ġlong"))).toBe("Ġtime");
  });

  it("is deterministic and seeded: the same rows for the same seed, other dimensions for another", () => {
    const a = syntheticLanguageModel(512, 64, 1);
    const b = syntheticLanguageModel(512, 64, 2);
    const ra = new Float32Array(64);
    const rb = new Float32Array(64);
    const again = new Float32Array(64);
    a.embeddingRow(300, ra);
    b.embeddingRow(300, rb);
    a.embeddingRow(300, again);
    expect(again).toEqual(ra);
    expect(rb).not.toEqual(ra);
    expect(b.generated).toEqual(a.generated);
  });
});

// Seeded test inputs for the quantiser comparisons: named groups of rows that reach the branches
// of ggml's reference quantisers (all-zero blocks, one outlier, single-signed data, ties...).

import { rng } from "@moeswarm/testkit";

/** mulberry32: a small seeded PRNG, uniform in [0, 1) (the one in testkit). */
export { rng };

export function gaussian(next: () => number): () => number {
  return () => Math.sqrt(-2 * Math.log(1 - next())) * Math.cos(2 * Math.PI * next());
}

export interface InputCase {
  name: string;
  rows: number;
}

/** Rows of `ne0` values, grouped in named cases; `values` concatenates every row. */
export function quantInputs(ne0: number, seed: number): { cases: InputCase[]; values: Float32Array } {
  const u = rng(seed);
  const g = gaussian(u);
  const rows: number[][] = [];
  const cases: InputCase[] = [];
  const add = (name: string, n: number, fill: (i: number, row: number) => number): void => {
    for (let r = 0; r < n; r++) rows.push(Array.from({ length: ne0 }, (_, i) => fill(i, r)));
    cases.push({ name, rows: n });
  };
  add("gaussian", 4, () => g());
  add("uniform", 2, () => (u() * 2 - 1) * 3);
  add("zeros", 1, () => 0);
  add("huge", 1, () => g() * 1e4);
  add("scale overflows f16", 1, () => g() * 3e6);
  add("squares overflow f32", 1, () => g() * 1e19);
  add("near FLT_MAX", 1, () => Math.max(-3.4e38, Math.min(3.4e38, g() * 1.3e38)));
  add("tiny", 1, () => g() * 1e-6);
  add("subnormal", 1, () => g() * 1e-40);
  add("below GROUP_MAX_EPS", 1, () => g() * 1e-18);
  const outlierAt = Math.floor(u() * ne0);
  add("one outlier", 1, (i) => (i === outlierAt ? 50 : g() * 0.01));
  add("negative only", 1, () => -Math.abs(g()));
  add("positive only", 1, () => Math.abs(g()) + 0.25);
  add("constant", 1, () => 0.7);
  add("small integers (ties)", 1, () => Math.floor(u() * 17) - 8);
  add("halves (ties)", 1, () => (Math.floor(u() * 33) - 16) / 2);
  add("sparse blocks", 1, (i) => (Math.floor(i / 32) % 3 === 0 ? g() : 0));
  add("one nonzero per 16", 1, (i) => (i % 16 === 5 ? g() : 0));
  add("weights-like", 2, () => g() * 0.02);
  return { cases, values: Float32Array.from(rows.flat()) };
}

/** Name of the case holding `row`. */
export function caseOfRow(cases: readonly InputCase[], row: number): string {
  let r = row;
  for (const c of cases) {
    if (r < c.rows) return `${c.name} (row ${r})`;
    r -= c.rows;
  }
  return `row ${row}`;
}

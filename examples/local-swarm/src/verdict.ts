// The demo's verdict when the workers compute on another backend than the backbone (another ISA,
// the static executable, a GPU): their kernels sum in another order, so the logits differ by a
// little, and where plain llama.cpp's greedy choice is a near-tie that little can flip a token.
// Once the sequences differ, every later step sees another context, so only the first difference
// can be judged: it is accepted only as a near-tie, i.e. when the local run's top-2 margin at that
// step is below what the cross-backend error measured on the steps before it can flip, and the
// error at that step is of the same size as before (a wrong answer is not a near-tie).
// The same-backend verdict (llama-cpu workers) stays bit-identical logits and is not judged here.

/** Logit error beyond the largest measured before the difference that a step may show. */
export const ERROR_SAFETY = 2;
/**
 * The error is measured on the local run's top candidates of each step (and the swarm's choice):
 * the tokens that can win. The far tail of a vocabulary can carry logits of another magnitude
 * whose error says nothing about a flip between the top two.
 */
export const TOP_K = 8;

export type CrossBackendVerdict =
  | { kind: "identical"; tokens: number /** of the candidates (TOP_K) */; maxError: number }
  | {
      kind: "near-tie";
      tokens: number;
      /** 0-based position of the first differing token. */
      position: number;
      /** The local run's top-1 minus top-2 logit at that step. */
      margin: number;
      /** 2 x ERROR_SAFETY x `measuredError`: the largest margin the measured error can flip. */
      bound: number;
      /** Largest |logit difference| of the candidates (TOP_K) over the steps before `position`. */
      measuredError: number;
      /** |logit difference| at `position`. */
      errorAtPosition: number;
    }
  | { kind: "mismatch"; tokens: number; position: number; reason: string };

/** Indices of the k largest values of `row`. */
function topIndices(row: Float32Array, k: number): number[] {
  const idx: number[] = [];
  for (let i = 0; i < row.length; i++) {
    if (idx.length < k) idx.push(i);
    else if ((row[i] as number) > (row[idx[k - 1] as number] as number)) idx[k - 1] = i;
    else continue;
    idx.sort((x, y) => (row[y] as number) - (row[x] as number));
  }
  return idx;
}

/** Largest |a - b| over the local top TOP_K of `a` and the token `also`. */
function candidateError(a: Float32Array, b: Float32Array, also: number | undefined): number {
  const at = topIndices(a, TOP_K);
  if (also !== undefined && also >= 0 && also < a.length) at.push(also);
  return Math.max(...at.map((v) => Math.abs((a[v] as number) - (b[v] as number))));
}

/** Index of the largest logit, and the top-1 minus top-2 margin. */
export function topTwo(row: Float32Array): { argmax: number; margin: number } {
  let first = -1;
  let top1 = Number.NEGATIVE_INFINITY;
  let top2 = Number.NEGATIVE_INFINITY;
  for (let i = 0; i < row.length; i++) {
    const v = row[i] as number;
    if (v > top1) {
      top2 = top1;
      top1 = v;
      first = i;
    } else if (v > top2) top2 = v;
  }
  return { argmax: first, margin: top1 - top2 };
}

/**
 * Judges a swarm decode against the local one: `plainRows[i]`/`swarmRows[i]` are the logits that
 * chose token i (greedy). Identical tokens: "identical". Else the first difference at position d
 * is a "near-tie" when d >= 1 (some error was measured), both runs' row d chose their token by
 * argmax (the rows are the steps they claim to be), the error at d is at most ERROR_SAFETY times
 * the largest error over rows 0..d-1 (E; errors measured on each step's local top TOP_K logits and
 * the swarm's token), and the local margin at d is below 2 x ERROR_SAFETY x E
 * (each of the two logits off by up to ERROR_SAFETY x E); else "mismatch", with the reason.
 */
export function crossBackendVerdict(
  plainTokens: readonly number[],
  swarmTokens: readonly number[],
  plainRows: readonly Float32Array[],
  swarmRows: readonly Float32Array[],
): CrossBackendVerdict {
  const tokens = plainTokens.length;
  let d = 0;
  while (d < tokens && swarmTokens[d] === plainTokens[d]) d++;
  const errors: number[] = [];
  for (let i = 0; i <= Math.min(d, tokens - 1); i++) {
    const a = plainRows[i];
    const b = swarmRows[i];
    if (!a || !b || a.length !== b.length) {
      return { kind: "mismatch", tokens, position: i, reason: `no logits row ${i} to compare` };
    }
    errors.push(candidateError(a, b, swarmTokens[i]));
  }
  if (d === tokens && swarmTokens.length === tokens) {
    return { kind: "identical", tokens, maxError: Math.max(0, ...errors) };
  }
  if (d === tokens) {
    return {
      kind: "mismatch",
      tokens,
      position: d,
      reason: `the swarm run has ${swarmTokens.length} tokens`,
    };
  }
  if (d === 0) {
    return {
      kind: "mismatch",
      tokens,
      position: 0,
      reason: "the first token differs: no error measured before it",
    };
  }
  const plain = topTwo(plainRows[d] as Float32Array);
  const swarm = topTwo(swarmRows[d] as Float32Array);
  if (plain.argmax !== plainTokens[d] || swarm.argmax !== swarmTokens[d]) {
    return {
      kind: "mismatch",
      tokens,
      position: d,
      reason: `logits row ${d} is not the step that chose token ${d}`,
    };
  }
  const measuredError = Math.max(...errors.slice(0, d));
  const errorAtPosition = errors[d] as number;
  const bound = 2 * ERROR_SAFETY * measuredError;
  if (errorAtPosition > ERROR_SAFETY * measuredError) {
    return {
      kind: "mismatch",
      tokens,
      position: d,
      reason: `the logit error at token ${d + 1} (${errorAtPosition.toPrecision(3)}) is over ${ERROR_SAFETY} x the largest before it (${measuredError.toPrecision(3)})`,
    };
  }
  if (plain.margin >= bound) {
    return {
      kind: "mismatch",
      tokens,
      position: d,
      reason: `the local top-2 margin at token ${d + 1} (${plain.margin.toPrecision(3)}) is no near-tie: the measured error flips at most ${bound.toPrecision(3)}`,
    };
  }
  return {
    kind: "near-tie",
    tokens,
    position: d,
    margin: plain.margin,
    bound,
    measuredError,
    errorAtPosition,
  };
}

/** The verdict as the demo prints it (first line "OK" or "MISMATCH"). */
export function verdictLines(v: CrossBackendVerdict): string[] {
  if (v.kind === "identical") {
    return [
      `verdict   every token identical; largest difference of the top-${TOP_K} logits ${v.maxError.toPrecision(3)}`,
    ];
  }
  if (v.kind === "near-tie") {
    return [
      `verdict   OK (near-tie): ${v.position}/${v.tokens} tokens identical, then token ${v.position + 1} differs where the local run's top-2 margin is ${v.margin.toPrecision(3)},`,
      `          below ${v.bound.toPrecision(3)} = 2 x ${ERROR_SAFETY} x the largest difference of the top-${TOP_K} logits over the ${v.position} steps before (${v.measuredError.toPrecision(3)}; ${v.errorAtPosition.toPrecision(3)} at that step); later tokens follow another context`,
    ];
  }
  return [`verdict   MISMATCH at token ${v.position + 1}: ${v.reason}`];
}

// The cross-backend verdict: a first difference passes only as a near-tie of the local run that
// the cross-backend error measured on the steps before it can flip (hand-computed cases).
import { describe, expect, it } from "vitest";
import { crossBackendVerdict, ERROR_SAFETY, topTwo, verdictLines } from "../src/verdict.js";

const row = (...v: number[]) => Float32Array.from(v);

describe("cross-backend verdict", () => {
  it("top-2: the argmax and the margin to the runner-up", () => {
    expect(topTwo(row(0.5, 2, 1.25, -3))).toEqual({ argmax: 1, margin: 0.75 });
    expect(topTwo(row(4, 1, 4))).toEqual({ argmax: 0, margin: 0 });
  });

  it("identical tokens: identical, with the largest logit difference", () => {
    const v = crossBackendVerdict(
      [1, 0],
      [1, 0],
      [row(0, 2, 1), row(3, 1, 0)],
      [row(0, 2.01, 1), row(3, 1, 0.5)],
    );
    expect(v.kind).toBe("identical");
    expect(v.kind === "identical" && v.maxError).toBeCloseTo(0.5, 6);
  });

  // steps 0 and 1 agree with errors 0.01 and 0.02 (E = 0.02, bound 2 x 2 x 0.02 = 0.08); at step 2
  // the local margin is 0.03 and the swarm's logits, off by <= 0.03 (<= 2E), pick the runner-up
  const before = { plain: [row(0, 5, 1), row(2, 0, 0)], swarm: [row(0, 5.01, 1), row(2.02, 0, 0)] };
  it("a first difference at a near-tie the measured error can flip: near-tie, reported as such", () => {
    const v = crossBackendVerdict(
      [1, 0, 2, 2],
      [1, 0, 1, 0],
      [...before.plain, row(0, 1, 1.03), row(0, 0, 9)],
      [...before.swarm, row(0, 1.02, 1.01), row(9, 0, 0)],
    );
    expect(v).toMatchObject({ kind: "near-tie", position: 2, tokens: 4 });
    if (v.kind !== "near-tie") return;
    expect(v.margin).toBeCloseTo(0.03, 6);
    expect(v.measuredError).toBeCloseTo(0.02, 6);
    expect(v.bound).toBeCloseTo(2 * ERROR_SAFETY * 0.02, 6);
    expect(v.errorAtPosition).toBeCloseTo(0.02, 6);
    expect(verdictLines(v)[0]).toMatch(
      /^verdict {3}OK \(near-tie\): 2\/4 tokens identical, then token 3 differs/,
    );
  });

  it("a difference the measured error cannot explain: mismatch", () => {
    // the error at the step (0.5) is far over 2 x E: a wrong answer, not summation order
    const big = crossBackendVerdict(
      [1, 0, 2],
      [1, 0, 1],
      [...before.plain, row(0, 1, 1.2)],
      [...before.swarm, row(0, 1.5, 1.2)],
    );
    expect(big).toMatchObject({ kind: "mismatch", position: 2 });
    expect(verdictLines(big)[0]).toMatch(/MISMATCH at token 3: the logit error/);
    // the first token differs: nothing was measured before it
    expect(crossBackendVerdict([2], [1], [row(0, 1, 1.001)], [row(0, 1.001, 1)])).toMatchObject({
      kind: "mismatch",
      position: 0,
    });
    // rows that are not the steps they claim (the local argmax is not its token)
    expect(
      crossBackendVerdict(
        [1, 0, 0],
        [1, 0, 1],
        [...before.plain, row(0, 1, 1.03)],
        [...before.swarm, row(0, 1.02, 1.01)],
      ),
    ).toMatchObject({ kind: "mismatch", reason: expect.stringMatching(/not the step/) });
    // a swarm run that stopped early
    expect(crossBackendVerdict([1, 0], [1], before.plain, before.swarm)).toMatchObject({ kind: "mismatch" });
  });

  it("measures the error on the candidates: a tail logit's large error does not widen the bound", () => {
    // 10 logits; index 9 is a far-tail value off by 50 at every step, the top-8 are off by <= 0.01
    const mk = (top: number[], tail: number) => Float32Array.from([...top, 0, tail]);
    const plain = [mk([9, 1, 1, 1, 1, 1, 1, 1], -1000), mk([1, 2, 1.5, 1, 1, 1, 1, 1], -1000)];
    const swarm = [mk([9.01, 1, 1, 1, 1, 1, 1, 1], -950), mk([1, 1.99, 2.0, 1, 1, 1, 1, 1], -950)];
    // step 1: local margin 0.5, swarm flips with a 0.5 error: E = 0.01 (not 50): a mismatch
    const v = crossBackendVerdict([0, 1], [0, 2], plain, swarm);
    expect(v).toMatchObject({ kind: "mismatch", position: 1 });
  });
});

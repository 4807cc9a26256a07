// The worker's answer to a small dispatch (the common case: one slice, few tokens, computed inline
// by the addon): `{ fill }`, which computes straight into the result frame's memory and returns
// its ms. The frame's bytes must be the old path's (an array from the thread pool, copied into
// the frame) with that ms; larger dispatches keep the old path; failures in the fill are counted.

import { decodeFrame, encodeFrame, type ResultFrame, resultFrame } from "@moeswarm/core";
import type { DispatchAnswer, DispatchAnswerInto, IncomingDispatch } from "@moeswarm/relay-client";
import { GgmlType } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { NativeExpertCompute, probeNative, SYNC_MAX_TOKENS } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { WorkerEventBody } from "../src/events.js";
import type { Settings } from "../src/options.js";
import { Serving } from "../src/serving.js";
import { SliceRouter } from "../src/slice-router.js";
import { bitsEqual, type Fixture, normals, randomIds, randomWeights, writeModel } from "./fixtures.js";

const N_EMBD = 64;
const N_EXPERT = 8;
const K = 4;
const EXPERTS = [...Array(N_EXPERT).keys()];

const status = await probeNative();
if (!status.available) {
  if (process.env.CI) throw new Error(`CI must build the native addon:\n${status.message}`);
  console.warn(`skipping the worker's in-frame answer tests:\n${status.message}`);
}

const tmp = tempDir("moeswarm-answer-into-");
let model: Fixture;
beforeAll(async () => {
  model = await writeModel(
    { type: GgmlType.Q8_0, nEmbd: N_EMBD, nFf: 32, nExpert: N_EXPERT, layers: [0, 1], seed: 41 },
    tmp.dir,
  );
});
afterAll(() => tmp.remove());

/** The fields of a dispatch the worker's answer reads. */
function dispatch(
  n: number,
  mode: "each" | "sum",
  seed: number,
  ids = randomIds(n, K, EXPERTS, seed + 1, 0.2),
) {
  const x = normals(n * N_EMBD, seed);
  const w = randomWeights(n, K, seed + 2);
  const req = {
    id: seed,
    from: "bb",
    model: "m",
    layer: seed % 2,
    n,
    embd: N_EMBD,
    k: K,
    dtype: "f32",
    mode,
    x,
    ids,
    w,
    deadline: undefined,
    compact: false,
    signal: new AbortController().signal,
    activations: () => x,
  };
  return req as unknown as IncomingDispatch;
}

const resultOf = (req: IncomingDispatch) =>
  ({
    t: "result",
    v: 1,
    id: req.id,
    to: req.from,
    mode: req.mode,
    n: req.n,
    k: req.k,
    embd: req.embd,
  }) as const;

const hex = (b: Uint8Array) => Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString("hex");

describe.skipIf(!status.available)("the worker's answer written into the result frame", () => {
  let events: WorkerEventBody[];
  const servingWith = (compute: NativeExpertCompute) => {
    events = [];
    const serving = new Serving({
      s: { id: "w1" } as Settings,
      emit: (body) => events.push(body),
      stop: new AbortController().signal,
      requestStop: () => {},
      fatal: () => {},
    });
    const router = new SliceRouter("m");
    router.add({ layers: { start: 0, end: 2 }, experts: { start: 0, end: N_EXPERT }, compute });
    serving.routers.set("m", router);
    return serving;
  };

  it(`1..${SYNC_MAX_TOKENS} tokens: { fill } gives the old path's frame bytes with its ms; more tokens: { y, ms } as before`, async () => {
    await using inline = await NativeExpertCompute.load(model.path, { threads: 1 });
    await using pooled = await NativeExpertCompute.load(model.path, { threads: 1, syncMaxTokens: 0 });
    const serving = servingWith(inline);
    let answered = 0;
    for (const n of [1, 2, SYNC_MAX_TOKENS, SYNC_MAX_TOKENS + 1]) {
      for (const mode of ["each", "sum"] as const) {
        const req = dispatch(n, mode, 10 * n + (mode === "sum" ? 1 : 0));
        const got = serving.answer(req);
        // computed inline: answered without a promise (relay-client sends it at once)
        expect(got instanceof Promise, `n=${n} ${mode}: a promise`).toBe(n > SYNC_MAX_TOKENS);
        const answer = await got;
        // the old path: the pool's array, in a frame of its own
        const old = await pooled.run({
          layer: req.layer,
          x: req.activations(),
          ids: req.ids,
          k: K,
          w: req.w!,
          mode,
        });
        if (n > SYNC_MAX_TOKENS) {
          const { y, ms } = answer as DispatchAnswer;
          expect(y).toBeInstanceOf(Float32Array);
          expect(ms).toBeGreaterThanOrEqual(0);
          expect(bitsEqual(y, old)).toBe(true);
          answered++;
          continue;
        }
        expect("y" in answer, `n=${n} ${mode}: no array of its own`).toBe(false);
        const { fill, ms } = answer as DispatchAnswerInto;
        expect(ms).toBeUndefined();
        // nothing is computed before the frame is written
        expect(serving.requests).toBe(answered);
        const bytes = encodeFrame({ ...resultOf(req), y: { values: old.length, fill } });
        answered++;
        expect(serving.requests).toBe(answered);
        const frame = decodeFrame(bytes) as ResultFrame;
        expect(frame.ms).toBeGreaterThan(0);
        const expected = encodeFrame(resultFrame({ ...resultOf(req), y: old, ms: frame.ms as number }));
        expect(hex(bytes), `n=${n} ${mode}`).toBe(hex(expected));
      }
    }
    expect(serving.tokens).toBe(2 * (1 + 2 + SYNC_MAX_TOKENS + SYNC_MAX_TOKENS + 1));
    expect(serving.failed).toBe(0);
  });

  it("a fill that fails is counted and reported like a failed compute, and its error is the answer", async () => {
    const compute = await NativeExpertCompute.load(model.path, { threads: 1 });
    const serving = servingWith(compute);
    const req = dispatch(1, "sum", 5);
    const answer = (await serving.answer(req)) as DispatchAnswerInto;
    // memory of the wrong length: refused before computing
    expect(() => answer.fill(new Float32Array(N_EMBD + 1))).toThrow(
      expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
    );
    // the compute closed between the answer and the frame's encoding
    const late = (await serving.answer(dispatch(1, "each", 6))) as DispatchAnswerInto;
    await compute.close();
    expect(() =>
      encodeFrame({ ...resultOf(req), mode: "each", y: { values: K * N_EMBD, fill: late.fill } }),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_NATIVE_CLOSED" }));
    expect(serving.failed).toBe(2);
    expect(serving.requests).toBe(0);
    expect(events.map((e) => (e as { code?: string }).code)).toEqual([
      "MOESWARM_INVALID_ARGUMENT",
      "MOESWARM_NATIVE_CLOSED",
    ]);
  });
});

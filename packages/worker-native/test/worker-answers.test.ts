import {
  bf16BitsToF32,
  decodeF16,
  dispatchFrame,
  encodeBf16,
  encodeF16,
  encodeFrame,
  encodeLengthPrefixed,
  pingFrame,
  pongFrame,
  type ResultFrame,
} from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { NativeExpertCompute, spawnExpertWorker } from "../src/index.js";
import { bitsEqual, normals, randomIds, randomWeights } from "./fixtures.js";
import { prefixed, protocolVectors, rawFrame, startWorker } from "./wire.js";
import {
  binary,
  K,
  missing,
  N_EMBD,
  N_FF,
  native,
  sliceExperts,
  writeTestSlice,
} from "./worker-exe-fixture.js";

describe.skipIf(Boolean(missing))("moeswarm-expert-worker: what it answers", () => {
  const tmp = tempDir("moeswarm-wn-");
  let slicePath: string;

  beforeAll(async () => {
    ({ slicePath } = await writeTestSlice(tmp.dir));
  });
  afterAll(() => tmp.remove());

  it.skipIf(!native.available)(
    "gives the same bytes as the addon, through the same ExpertCompute interface",
    async () => {
      await using worker = await spawnExpertWorker(binary!, slicePath, { threads: 2 });
      await using addon = await NativeExpertCompute.load(slicePath, { threads: 2 });
      expect(worker.info).toMatchObject({
        backend: "worker",
        layers: [1, 2],
        experts: sliceExperts,
        nEmbd: N_EMBD,
        nFf: N_FF,
        act: "silu",
      });
      expect(worker.registration).toMatchObject({
        model: "synthetic-moe",
        layers: [1, 2],
        experts: [0, 2, 5, 7],
        backend: "cpu",
      });
      for (const [n, layer] of [
        [1, 1],
        [7, 2],
        [33, 1],
      ] as const) {
        const x = normals(n * N_EMBD, n);
        const ids = randomIds(n, K, [...Array(8).keys()], 100 + n, 0.1).map((id) =>
          sliceExperts.includes(id) ? id : -1,
        );
        const w = randomWeights(n, K, 200 + n);
        for (const mode of ["each", "sum"] as const) {
          const req = { layer, x, ids, k: K, w: w, mode };
          const [a, b] = await Promise.all([worker.run(req), addon.run(req)]);
          expect(bitsEqual(a, b), `n=${n} ${mode}`).toBe(true);
        }
      }
    },
  );

  it("speaks the protocol canonically: hello, register, result and pong re-encode to the same bytes", async () => {
    const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1", "--id", "w-test"]);
    const [hello, register] = await p.peer.frames(2);
    expect(hello!.frame).toMatchObject({
      t: "hello",
      role: "worker",
      id: "w-test",
      caps: { backends: ["cpu"], dtypes: ["f32", "f16", "bf16"] },
    });
    expect(register!.frame).toMatchObject({
      t: "register",
      model: "synthetic-moe",
      layers: [1, 2],
      experts: [0, 2, 5, 7],
      backend: "cpu",
    });
    for (const r of [hello!, register!]) expect(encodeFrame(r.frame)).toEqual(r.bytes);

    const n = 3;
    const x = normals(n * N_EMBD, 4);
    const ids = new Int32Array([5, 0, -1, 2, 7, 5, 0, 2, -1, -1, -1, -1]);
    p.peer.write(
      encodeLengthPrefixed(
        dispatchFrame({
          id: 42,
          from: "bb-1",
          to: "w-test",
          model: "m",
          layer: 2,
          n,
          embd: N_EMBD,
          dtype: "f32",
          x,
          k: K,
          ids,
          mode: "each",
        }),
      ),
    );
    const vectors = protocolVectors();
    p.peer.write(prefixed(vectors.get("ping")!));
    p.peer.write(encodeLengthPrefixed(pingFrame({ seq: 200, ts: 1732900000000 })));
    const [, , result, pong1, pong2] = await p.peer.frames(5);
    const r = result!.frame as ResultFrame;
    expect(r).toMatchObject({
      t: "result",
      id: 42,
      to: "bb-1",
      from: "w-test",
      mode: "each",
      n,
      k: K,
      embd: N_EMBD,
    });
    expect(r.y.length).toBe(n * K * N_EMBD);
    expect(r.y.subarray(2 * N_EMBD, 3 * N_EMBD).every((v) => v === 0)).toBe(true);
    expect(r.ms).toBeGreaterThanOrEqual(0);
    expect(encodeFrame(r)).toEqual(result!.bytes);
    expect(pong1!.bytes).toEqual(encodeFrame(pongFrame({ seq: 1, ts: 1234.5 })));
    expect(pong2!.bytes).toEqual(vectors.get("pong")); // the doc's own bytes
    p.peer.write(encodeLengthPrefixed({ t: "drain", v: 1 }));
    expect((await p.exit).code).toBe(0);
  });

  it("answers a compact dispatch with the filled slots' rows only, canonically", async () => {
    const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1"]);
    await p.peer.frames(2);
    const n = 3;
    const x = normals(n * N_EMBD, 4);
    const ids = new Int32Array([5, 0, -1, 2, 7, 5, 0, 2, -1, -1, -1, -1]);
    const frame = (id: number, compact: boolean) =>
      encodeLengthPrefixed(
        dispatchFrame({
          id,
          model: "m",
          layer: 2,
          n,
          embd: N_EMBD,
          dtype: "f32",
          x,
          k: K,
          ids,
          mode: "each",
          compact,
        }),
      );
    p.peer.write(frame(1, false));
    p.peer.write(frame(2, true));
    // frames(n): the first n frames of the connection (hello and register first)
    const [, , full, compact] = await p.peer.frames(4);
    const f = full!.frame as ResultFrame;
    const c = compact!.frame as ResultFrame;
    expect(f.compact).toBeUndefined();
    expect(c).toMatchObject({ id: 2, compact: true, mode: "each", n, k: K });
    // the filled slots in order, each the row the full answer holds at its place
    const filled = [...ids.keys()].filter((s) => ids[s]! >= 0);
    expect(c.y.length).toBe(filled.length * N_EMBD);
    filled.forEach((s, row) => {
      expect(
        bitsEqual(c.y.subarray(row * N_EMBD, (row + 1) * N_EMBD), f.y.subarray(s * N_EMBD, (s + 1) * N_EMBD)),
      ).toBe(true);
    });
    expect(encodeFrame(c)).toEqual(compact!.bytes);
    // compact is for mode each only
    p.peer.write(
      rawFrame({
        t: "dispatch",
        v: 1,
        id: 3,
        model: "m",
        layer: 2,
        n,
        embd: N_EMBD,
        dtype: "f32",
        x: new Uint8Array(x.buffer, x.byteOffset, x.byteLength),
        k: K,
        ids: new Uint8Array(ids.buffer),
        w: new Uint8Array(new Float32Array(n * K).fill(0.5).buffer),
        mode: "sum",
        compact: true,
      }),
    );
    const refusal = (await p.peer.frames(5))[4];
    expect(refusal!.frame).toMatchObject({ t: "error", id: 3, code: "MOESWARM_PROTOCOL_BAD_FIELD" });
    p.peer.write(encodeLengthPrefixed({ t: "drain", v: 1 }));
    expect((await p.exit).code).toBe(0);
  });

  it("takes f16 and bf16 activations as their f32 values", async () => {
    await using worker = await spawnExpertWorker(binary!, slicePath, { threads: 1 });
    const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1"]);
    await p.peer.frames(2);
    const n = 4;
    const x = normals(n * N_EMBD, 9);
    const ids = randomIds(n, K, sliceExperts, 10);
    const f16 = encodeF16(x);
    const bf16 = encodeBf16(x);
    p.peer.write(
      encodeLengthPrefixed(
        dispatchFrame({
          id: 1,
          model: "m",
          layer: 1,
          n,
          embd: N_EMBD,
          dtype: "f16",
          x: f16,
          k: K,
          ids,
          mode: "each",
        }),
      ),
    );
    p.peer.write(
      encodeLengthPrefixed(
        dispatchFrame({
          id: 2,
          model: "m",
          layer: 1,
          n,
          embd: N_EMBD,
          dtype: "bf16",
          x: bf16,
          k: K,
          ids,
          mode: "each",
        }),
      ),
    );
    const [, , a, b] = await p.peer.frames(4);
    const viaF16 = await worker.run({ layer: 1, x: decodeF16(f16), ids, k: K, mode: "each" });
    const viaBf16 = await worker.run({
      layer: 1,
      x: Float32Array.from(bf16, bf16BitsToF32),
      ids,
      k: K,
      mode: "each",
    });
    expect(bitsEqual((a!.frame as ResultFrame).y, viaF16)).toBe(true);
    expect(bitsEqual((b!.frame as ResultFrame).y, viaBf16)).toBe(true);
    p.child.stdin.end();
    expect((await p.exit).code).toBe(0);
  });
});

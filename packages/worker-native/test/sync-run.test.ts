import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { describe, expect, it } from "vitest";
import { NativeExpertCompute, SYNC_MAX_TOKENS } from "../src/index.js";
import { bitsEqual, normals, randomIds, randomWeights } from "./fixtures.js";
import { EXPERTS, K, N_EMBD, nativeOrSkip, useSyncModels } from "./sync-fixture.js";

// The synchronous path of small requests (runSync on the calling thread) against the thread-pool
// path (run on libuv's pool): the same bits, the same order, and each taken when it should be.

const { status, addon } = await nativeOrSkip("the native synchronous-run tests");

/** Whether `p` settles within the microtasks queued now: a thread-pool run never can. */
async function settlesAtOnce(p: Promise<unknown>): Promise<boolean> {
  let settled = false;
  p.then(
    () => {
      settled = true;
    },
    () => {
      settled = true;
    },
  );
  for (let i = 0; i < 10; i++) await Promise.resolve();
  return settled;
}

describe.skipIf(!status.available)("native expert compute: small requests on the calling thread", () => {
  const models = useSyncModels("moeswarm-wn-sync-", [GgmlType.Q4_K, GgmlType.Q8_0, GgmlType.F16], 300);

  it("the addon has runSync, and it refuses unchecked input like run", async () => {
    const { handle } = await addon!.loadSlice(models.get(GgmlType.F16)!.path, { threads: 1 });
    expect(typeof handle.runSync).toBe("function");
    const x = normals(N_EMBD, 2);
    const code = (f: () => unknown) => {
      try {
        f();
        return "ok";
      } catch (e) {
        return (e as { code: string }).code;
      }
    };
    const sync = handle.runSync!.bind(handle);
    expect(code(() => sync(0, x, new Int32Array([0, 1, 2, 3]), 4, null, 0, false))).toBe("ok");
    expect(code(() => sync(0, x, new Int32Array([0, 1, 2, 300]), 4, null, 0, false))).toBe(
      "MOESWARM_NATIVE_COMPUTE",
    );
    expect(code(() => sync(0, new Float32Array(3), new Int32Array([0, 1, 2, 3]), 4, null, 0, false))).toBe(
      "MOESWARM_NATIVE_COMPUTE",
    );
    expect(code(() => sync(9, x, new Int32Array([0]), 1, null, 0, false))).toBe("MOESWARM_NATIVE_COMPUTE");
    expect(code(() => sync(0, x, new Int32Array([0]), 1, null, 1, false))).toBe("MOESWARM_NATIVE_COMPUTE");
    expect(code(() => sync(0, x, new Int32Array([0]), 0, null, 0, false))).toBe("MOESWARM_INVALID_ARGUMENT");
    await handle.close();
    expect(code(() => sync(0, x, new Int32Array([0]), 1, null, 0, false))).toBe("MOESWARM_NATIVE_CLOSED");
  });

  for (const type of [GgmlType.Q4_K, GgmlType.Q8_0, GgmlType.F16] as const) {
    it(`${ggmlTypeName(type)}: 1..${SYNC_MAX_TOKENS} tokens give the thread pool's bits, in each mode and the reference graph`, async () => {
      const path = models.get(type)!.path;
      await using inline = await NativeExpertCompute.load(path, { threads: 2 });
      await using pooled = await NativeExpertCompute.load(path, { threads: 2, syncMaxTokens: 0 });
      expect(inline.syncMaxTokens).toBe(SYNC_MAX_TOKENS);
      expect(pooled.syncMaxTokens).toBe(0);
      for (const n of [1, 3, SYNC_MAX_TOKENS]) {
        const x = normals(n * N_EMBD, 10 + n);
        // some empty slots: the output rows of those are zero on both paths
        const ids = randomIds(n, K, EXPERTS, 20 + n, 0.25);
        const w = randomWeights(n, K, 30 + n);
        for (const layer of [0, 2]) {
          for (const mode of ["each", "sum"] as const) {
            const req = { layer, x, ids, k: K, w, mode };
            const p = inline.run(req);
            expect(await settlesAtOnce(p), `n=${n} ${mode}: computed inline`).toBe(true);
            const q = pooled.run(req);
            expect(await settlesAtOnce(q), `n=${n} ${mode}: on the pool`).toBe(false);
            const [a, b] = await Promise.all([p, q]);
            expect(a.length).toBe(n * (mode === "each" ? K : 1) * N_EMBD);
            expect(bitsEqual(a, b), `n=${n} layer ${layer} ${mode}`).toBe(true);
          }
        }
        const full = randomIds(n, K, EXPERTS, 40 + n);
        const ref = { layer: 2, x, ids: full, k: K, w, mode: "sum" as const };
        expect(bitsEqual(await inline.runReference(ref), await pooled.runReference(ref))).toBe(true);
        expect(bitsEqual(await inline.run(ref), await inline.runReference(ref))).toBe(true);
      }
    });
  }

  it(`requests over ${SYNC_MAX_TOKENS} tokens go to the pool, and a small one behind them waits its turn`, async () => {
    await using compute = await NativeExpertCompute.load(models.get(GgmlType.Q8_0)!.path, { threads: 1 });
    const big = SYNC_MAX_TOKENS + 1;
    const bigReq = {
      layer: 0,
      x: normals(big * N_EMBD, 50),
      ids: randomIds(big, K, EXPERTS, 51),
      k: K,
      mode: "each" as const,
    };
    const small = {
      layer: 0,
      x: normals(N_EMBD, 52),
      ids: randomIds(1, K, EXPERTS, 53),
      k: K,
      mode: "each" as const,
    };
    const order: string[] = [];
    const first = compute.run(bigReq).then((y) => {
      order.push("big");
      return y;
    });
    const second = compute.run(small).then((y) => {
      order.push("small");
      return y;
    });
    // the small one is queued behind the big one, not computed ahead of it
    expect(await settlesAtOnce(second)).toBe(false);
    const [yBig, ySmall] = await Promise.all([first, second]);
    expect(order).toEqual(["big", "small"]);
    // and alone (inline now: nothing queued) it gives the same bits
    const again = compute.run(small);
    expect(await settlesAtOnce(again)).toBe(true);
    expect(bitsEqual(await again, ySmall)).toBe(true);
    expect(bitsEqual(await compute.run(bigReq), yBig)).toBe(true);
  });

  it("an aborted signal still rejects a small request, and syncMaxTokens is checked", async () => {
    const path = models.get(GgmlType.F16)!.path;
    await using compute = await NativeExpertCompute.load(path, { threads: 1 });
    const req = {
      layer: 0,
      x: normals(N_EMBD, 60),
      ids: new Int32Array([0, 1, 2, 3]),
      k: K,
      mode: "each" as const,
    };
    await expect(compute.run(req, { signal: AbortSignal.abort(new Error("stop")) })).rejects.toThrow("stop");
    await expect(NativeExpertCompute.load(path, { syncMaxTokens: -1 })).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
    });
    // a larger bound takes larger requests inline
    await using wide = await NativeExpertCompute.load(path, { threads: 1, syncMaxTokens: 64 });
    const n = 40;
    const big = {
      layer: 0,
      x: normals(n * N_EMBD, 61),
      ids: randomIds(n, K, EXPERTS, 62),
      k: K,
      mode: "each" as const,
    };
    const p = wide.run(big);
    expect(await settlesAtOnce(p)).toBe(true);
    expect(bitsEqual(await p, await compute.run(big))).toBe(true);
  });
});

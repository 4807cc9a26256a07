import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { describe, expect, it } from "vitest";
import { NativeExpertCompute, SYNC_MAX_TOKENS } from "../src/index.js";
import { bitsEqual, normals, randomIds, randomWeights } from "./fixtures.js";
import { EXPERTS, K, N_EMBD, nativeOrSkip, useSyncModels } from "./sync-fixture.js";

// runSync writing into the caller's memory (a result frame's): the pool's bits in the caller's
// array and no other, its length and memory checked, and runsInline saying when it applies.

const { status, addon } = await nativeOrSkip("the native runSyncInto tests");

function codeOf(f: () => unknown): string {
  try {
    f();
    return "ok";
  } catch (e) {
    return (e as { code: string }).code;
  }
}

describe.skipIf(!status.available)(
  "native expert compute: the answer written into the caller's memory",
  () => {
    const models = useSyncModels("moeswarm-wn-into-", [GgmlType.Q4_K, GgmlType.F16], 700);

    it("the addon's runSync writes into `out` and returns it; a wrong length or shared memory is refused", async () => {
      const { handle } = await addon!.loadSlice(models.get(GgmlType.F16)!.path, { threads: 1 });
      const x = normals(N_EMBD, 2);
      const ids = new Int32Array([0, 1, 2, 3]);
      const w = randomWeights(1, K, 3);
      const sync = handle.runSync!.bind(handle);
      const fresh = sync(0, x, ids, K, w, 1, false);
      // a view into a larger buffer at an offset, as a frame's y is, with a sentinel either side
      const frame = new Float32Array(N_EMBD + 4).fill(-7);
      const out = frame.subarray(2, 2 + N_EMBD);
      expect(sync(0, x, ids, K, w, 1, false, undefined, out)).toBe(out);
      expect(bitsEqual(out, fresh)).toBe(true);
      expect([frame[0], frame[1], frame[N_EMBD + 2], frame[N_EMBD + 3]]).toEqual([-7, -7, -7, -7]);
      expect(codeOf(() => sync(0, x, ids, K, w, 1, false, undefined, new Float32Array(N_EMBD - 1)))).toBe(
        "MOESWARM_NATIVE_OUTPUT",
      );
      // mode "each" needs k rows: the sum's length is short
      expect(codeOf(() => sync(0, x, ids, K, w, 0, false, undefined, new Float32Array(N_EMBD)))).toBe(
        "MOESWARM_NATIVE_OUTPUT",
      );
      expect(
        codeOf(() => sync(0, x, ids, K, w, 1, false, undefined, new Uint8Array(N_EMBD * 4) as never)),
      ).toBe("MOESWARM_INVALID_ARGUMENT");
      // the output over the input: refused, since the compute reads x while it writes y
      const both = normals(2 * N_EMBD, 4);
      const xIn = both.subarray(0, N_EMBD);
      expect(
        codeOf(() =>
          sync(0, xIn, ids, K, w, 1, false, undefined, both.subarray(N_EMBD / 2, N_EMBD / 2 + N_EMBD)),
        ),
      ).toBe("MOESWARM_INVALID_ARGUMENT");
      // adjacent is not overlapping
      expect(sync(0, xIn, ids, K, w, 1, false, undefined, both.subarray(N_EMBD))).toBeInstanceOf(
        Float32Array,
      );
      await handle.close();
    });

    for (const type of [GgmlType.Q4_K, GgmlType.F16] as const) {
      it(`${ggmlTypeName(type)}: runSyncInto gives run()'s bits on the thread pool, in each mode, 1..${SYNC_MAX_TOKENS} tokens`, async () => {
        const path = models.get(type)!.path;
        await using inline = await NativeExpertCompute.load(path, { threads: 2 });
        await using pooled = await NativeExpertCompute.load(path, { threads: 2, syncMaxTokens: 0 });
        for (const n of [1, 3, SYNC_MAX_TOKENS]) {
          const x = normals(n * N_EMBD, 10 + n);
          const ids = randomIds(n, K, EXPERTS, 20 + n, 0.25);
          const w = randomWeights(n, K, 30 + n);
          for (const layer of [0, 2]) {
            for (const mode of ["each", "sum"] as const) {
              const req = { layer, x, ids, k: K, w, mode };
              expect(inline.runsInline(req)).toBe(true);
              expect(pooled.runsInline(req)).toBe(false);
              const y = new Float32Array(n * (mode === "each" ? K : 1) * N_EMBD).fill(Number.NaN);
              inline.runSyncInto(req, y);
              expect(bitsEqual(y, await pooled.run(req)), `n=${n} layer ${layer} ${mode}`).toBe(true);
            }
          }
        }
      });
    }

    it("runsInline is false for a large request, with a run queued, and after close; runSyncInto's errors are typed", async () => {
      const compute = await NativeExpertCompute.load(models.get(GgmlType.Q4_K)!.path, { threads: 1 });
      const small = {
        layer: 0,
        x: normals(N_EMBD, 50),
        ids: randomIds(1, K, EXPERTS, 51),
        k: K,
        mode: "each" as const,
      };
      const big = SYNC_MAX_TOKENS + 1;
      const bigReq = {
        layer: 0,
        x: normals(big * N_EMBD, 52),
        ids: randomIds(big, K, EXPERTS, 53),
        k: K,
        mode: "each" as const,
      };
      expect(compute.runsInline(bigReq)).toBe(false);
      const queued = compute.run(bigReq);
      expect(compute.runsInline(small)).toBe(false);
      // called anyway (a run queued after the decision): it waits for the pool's run, and is right
      const y = new Float32Array(K * N_EMBD);
      compute.runSyncInto(small, y);
      await queued;
      expect(compute.runsInline(small)).toBe(true);
      expect(bitsEqual(y, await compute.run(small))).toBe(true);
      expect(() => compute.runSyncInto(small, new Float32Array(K * N_EMBD + 1))).toThrow(
        expect.objectContaining({ code: "MOESWARM_NATIVE_OUTPUT" }),
      );
      expect(() => compute.runSyncInto({ ...small, layer: 1 }, y)).toThrow(
        expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
      );
      await compute.close();
      expect(compute.runsInline(small)).toBe(false);
      expect(() => compute.runSyncInto(small, y)).toThrow(
        expect.objectContaining({ code: "MOESWARM_NATIVE_CLOSED" }),
      );
      // a compute without the inline path refuses rather than block the event loop on a pool run
      await using pooled = await NativeExpertCompute.load(models.get(GgmlType.Q4_K)!.path, {
        threads: 1,
        syncMaxTokens: 0,
      });
      expect(() => pooled.runSyncInto(small, y)).toThrow(
        expect.objectContaining({ code: "MOESWARM_NATIVE_COMPUTE" }),
      );
    });
  },
);

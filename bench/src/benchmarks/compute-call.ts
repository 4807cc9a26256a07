// `compute-call`: what a worker's compute call costs above its arithmetic, at 1, 8 and 64 tokens
// with n_embd 3072 (the activations and outputs of a 122B-shaped layer, so that every copy is true
// to size), top-8 of a 16-expert Q8_0 slice, mode "sum", and n_ff 32: a 122B layer's n_ff (1024)
// makes a token's arithmetic ~10-20 ms here (80 MB of weights read), which would bury the
// overhead being measured in its noise. expert-compute measures the arithmetic at full shape.
// - floor: the addon's `runSync` called directly (the arithmetic, plus N-API's argument checks);
// - pool: NativeExpertCompute with `syncMaxTokens: 0`, every call through the RunQueue and an
//   AsyncWorker on libuv's thread pool (the path every request took before; its output is now
//   written in place too);
// - inline: NativeExpertCompute with `syncMaxTokens: 64`, every call on the calling thread (the
//   default, 8, takes this path at 1 and 8 tokens and the pool at 64);
// - copy: inline, then its array copied into reused memory (a result frame's y): the worker's
//   answer to a small request before it was written in place;
// - into: the same compute's `runSyncInto`, the answer written into memory given to it (as the
//   worker writes a small request's answer straight into its result frame: no array of its own).
// The five are sampled in turns, call by call, so that they see the same machine load; overhead
// is each call's time minus the floor call of its turn, reported as median and p10..p90.
import { mkdtemp, rm } from "node:fs/promises";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { NativeExpertCompute } from "@moeswarm/worker-native";
import { type Benchmark, median, type Row } from "../harness.js";
import { nativeOrSkip, type SliceSpec, sliceRequest, THREADS, writeExpertSlice } from "../native-slice.js";

const N_EMBD = 3072;
const N_FF = 32;
const N_EXPERT = 16;
const K = 8;
const TYPE = GgmlType.Q8_0;
const TOKENS = [1, 8, 64] as const;
/** Turns per token count: enough for a stable median on a shared machine. */
const TURNS: Record<number, number> = { 1: 400, 8: 200, 64: 40 };
/** The benchmark's slice: layer 0's first N_EXPERT experts. */
const SLICE: SliceSpec = { type: TYPE, nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layer: 0 };

/** The part of the addon's slice handle this benchmark calls (see worker-native's native-binding.ts). */
interface BareHandle {
  runSync(
    layer: number,
    x: Float32Array,
    ids: Int32Array,
    k: number,
    w: Float32Array | null,
    mode: 0 | 1,
    reference: boolean,
  ): Float32Array;
  close(): Promise<void>;
}

const us = (ns: number) => Math.round(ns / 100) / 10;

function quantile(sorted: readonly number[], q: number): number {
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.round(q * (sorted.length - 1))))]!;
}

/** Times of one call, ns. */
async function timed(f: () => unknown): Promise<number> {
  const t0 = process.hrtime.bigint();
  await f();
  return Number(process.hrtime.bigint() - t0);
}

export const computeCall: Benchmark = {
  name: "compute-call",
  description: `a worker's compute call above its arithmetic: floor (addon runSync) vs the thread-pool path vs the inline path vs inline into given memory, n_embd ${N_EMBD} n_ff ${N_FF}, top-${K}, ${ggmlTypeName(TYPE)}`,
  async run() {
    const probe = await nativeOrSkip();
    if (probe.skipped) return probe.skipped;
    const { status } = probe;
    const addon = createRequire(import.meta.url)(status.path) as {
      loadSlice(path: string, o: { threads: number }): Promise<{ handle: Partial<BareHandle> }>;
    };
    const dir = await mkdtemp(join(tmpdir(), "moeswarm-bench-call-"));
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    const notes: string[] = [
      `threads ${THREADS}; overhead = a call's wall time minus the floor call of the same turn (median, p10..p90); the default syncMaxTokens is 8`,
    ];
    try {
      const path = join(dir, "slice.gguf");
      await writeExpertSlice(path, SLICE);
      const { handle } = await addon.loadSlice(path, { threads: THREADS });
      if (typeof handle.runSync !== "function") {
        await handle.close?.();
        return { rows: [], ratios: {}, notes: ["this build of the addon has no runSync: rebuild it"] };
      }
      const bare = handle as BareHandle;
      const pool = await NativeExpertCompute.load(path, { threads: THREADS, syncMaxTokens: 0 });
      const inline = await NativeExpertCompute.load(path, { threads: THREADS, syncMaxTokens: 64 });
      try {
        for (const n of TOKENS) {
          const req = sliceRequest(SLICE, n, K, 7000 + n);
          const floor = () => bare.runSync(0, req.x, req.ids, K, req.w, 1, false);
          // (a frame's y: memory reused call after call)
          const out = new Float32Array(n * N_EMBD);
          const paths = {
            pool: () => pool.run(req),
            inline: () => inline.run(req),
            // the worker's small answer before: the inline array, then copied into the frame
            copy: async () => {
              out.set(await inline.run(req));
              return out;
            },
            into: () => {
              inline.runSyncInto(req, out);
              return out;
            },
          };
          const names = Object.keys(paths) as Array<keyof typeof paths>;
          // same bits on every path, and a warm graph cache
          const want = floor();
          for (const run of Object.values(paths)) {
            const y = await run();
            if (
              Buffer.compare(Buffer.from(y.buffer, y.byteOffset, y.byteLength), Buffer.from(want.buffer)) !==
              0
            )
              throw new Error(`n=${n}: a path's output differs from the floor's`);
          }
          const floorNs: number[] = [];
          const over: Record<keyof typeof paths, number[]> = { pool: [], inline: [], copy: [], into: [] };
          for (let t = 0; t < TURNS[n]!; t++) {
            const f = await timed(floor);
            floorNs.push(f);
            // rotate which path goes first, so that none always follows the floor
            for (let i = 0; i < names.length; i++) {
              const p = names[(t + i) % names.length]!;
              over[p].push((await timed(paths[p])) - f);
            }
          }
          const turnFloor = [...floorNs];
          floorNs.sort((a, b) => a - b);
          const row: Row = { tokens: n, "floor p50 us": us(quantile(floorNs, 0.5)) };
          for (const p of names) {
            const o = [...over[p]].sort((a, b) => a - b);
            row[`${p} over p50 us`] = us(quantile(o, 0.5));
            row[`${p} over p10..p90 us`] = `${us(quantile(o, 0.1))}..${us(quantile(o, 0.9))}`;
          }
          rows.push(row);
          // per turn, the call over the floor call: 1.0 is a call that costs only its arithmetic
          for (const p of names) {
            ratios[`${p}/floor n=${n}`] = median(over[p].map((o, t) => (turnFloor[t]! + o) / turnFloor[t]!));
            ratios[`${p} overhead us n=${n}`] = median(over[p]) / 1000;
          }
        }
      } finally {
        await pool.close();
        await inline.close();
        await bare.close();
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
    notes.push(
      "goal (issue #15): inline overhead <= ~50 us at 1 token; at 64 tokens the default path is the pool, so that the event loop is never held for the floor's time",
    );
    return { rows, ratios, notes };
  },
};

// `expert-compute`: routed-expert FFN throughput of @moeswarm/worker-native at the Qwen3.5-122B
// expert shape (n_embd 3072, n_ff 1024), top-8, on a 16-expert slice in Q4_K and Q8_0:
// - native (the N-API addon: every (token, slot) pair one row of a k=1 ggml_mul_mat_id graph)
//   against the same tokens through one monolithic graph built as llama.cpp's build_moe_ffn
//   builds it (the ratio should be ~1.0: the worker adds no cost over llama.cpp's own graph);
// - native against the pure-TypeScript path (the ratio is the speed-up of the native code).
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { NativeExpertCompute, TsExpertCompute } from "@moeswarm/worker-native";
import { type Benchmark, measure, type Row } from "../harness.js";
import { nativeOrSkip, type SliceSpec, sliceRequest, THREADS, writeExpertSlice } from "../native-slice.js";

const N_EMBD = 3072;
const N_FF = 1024;
const N_EXPERT = 16;
const K = 8;
const LAYER = 0;
const TOKENS = [1, 8, 64] as const;
/** The TypeScript path is measured where it finishes in seconds. */
const TS_TOKENS = new Set([1, 8]);
/** The slice's experts are the model's 0, 16, 32, ... (ids as a real slice of 256 has them). */
const SLICE: Omit<SliceSpec, "type"> = {
  nEmbd: N_EMBD,
  nFf: N_FF,
  nExpert: N_EXPERT,
  layer: LAYER,
  idStride: 16,
  name: "expert-compute-bench",
};
/** Alternating samples of native and monolithic runs, so both see the same machine load. */
const ROUNDS = 9;

interface Sample {
  /** Median wall time, ns. */
  wall: number;
  /** Median CPU time of the process (user + system), ns: what other processes cannot inflate. */
  cpu: number;
}

/** `a` and `b` sampled alternately after one warm-up each, so that both see the same machine load. */
async function alternate(
  a: () => Promise<unknown>,
  b: () => Promise<unknown>,
  rounds: number,
): Promise<[Sample, Sample]> {
  await a();
  await b();
  const walls: [number[], number[]] = [[], []];
  const cpus: [number[], number[]] = [[], []];
  for (let r = 0; r < rounds; r++) {
    for (const i of [0, 1] as const) {
      const c0 = process.cpuUsage();
      const t0 = process.hrtime.bigint();
      await (i === 0 ? a : b)();
      const wall = Number(process.hrtime.bigint() - t0);
      const c = process.cpuUsage(c0);
      walls[i].push(wall);
      cpus[i].push((c.user + c.system) * 1000);
    }
  }
  const median = (v: number[]) => [...v].sort((x, y) => x - y)[Math.floor(v.length / 2)]!;
  return [
    { wall: median(walls[0]), cpu: median(cpus[0]) },
    { wall: median(walls[1]), cpu: median(cpus[1]) },
  ];
}

export const expertCompute: Benchmark = {
  name: "expert-compute",
  description: `routed-expert FFN, n_embd ${N_EMBD} n_ff ${N_FF}, top-${K} of a ${N_EXPERT}-expert slice: native vs monolithic ggml graph vs TypeScript`,
  async run() {
    const probe = await nativeOrSkip();
    if (probe.skipped) return probe.skipped;
    const { status } = probe;
    const dir = await mkdtemp(join(tmpdir(), "moeswarm-bench-experts-"));
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    const notes: string[] = [
      `threads ${THREADS}; CPU features ${status.cpu}; tokens/s = n tokens / median wall time of one run`,
    ];
    try {
      for (const type of [GgmlType.Q4_K, GgmlType.Q8_0]) {
        const name = ggmlTypeName(type);
        const path = join(dir, `slice-${name}.gguf`);
        await writeExpertSlice(path, { ...SLICE, type });
        const native = await NativeExpertCompute.load(path, { threads: THREADS });
        // every expert dequantised once and kept: the TypeScript path at its best
        const ts = await TsExpertCompute.load(path, { cacheBytes: 4 * 3 * N_EMBD * N_FF * N_EXPERT });
        try {
          notes.push(`${name}: repacked by ggml: ${native.native.tensors[0]!.repacked}`);
          for (const n of TOKENS) {
            const req = sliceRequest(SLICE, n, K, 1000 + n);
            const [nat, mono] = await alternate(
              () => native.run(req),
              () => native.runReference(req),
              ROUNDS,
            );
            const nativeNs = nat.wall;
            const row: Row = {
              type: name,
              tokens: n,
              "native tok/s": n / (nat.wall / 1e9),
              "monolithic tok/s": n / (mono.wall / 1e9),
              "native cpu ms": nat.cpu / 1e6,
              "monolithic cpu ms": mono.cpu / 1e6,
            };
            ratios[`native_vs_monolithic_${name}_n${n}`] = mono.wall / nat.wall;
            ratios[`native_vs_monolithic_cpu_${name}_n${n}`] = mono.cpu / nat.cpu;
            if (TS_TOKENS.has(n)) {
              const tTs = await measure(`ts ${name} n=${n}`, () => ts.run(req), {
                minTimeMs: 0,
                minSamples: 2,
                warmup: 1,
              });
              row["ts tok/s"] = n / (tTs.medianNs / 1e9);
              ratios[`native_speedup_vs_ts_${name}_n${n}`] = tTs.medianNs / nativeNs;
            }
            rows.push(row);
          }
        } finally {
          await native.close();
          await ts.close();
        }
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
    notes.push(
      "native_vs_monolithic > 1 means the sliced worker path is faster than llama.cpp's graph shape",
    );
    return { rows, ratios, notes };
  },
};

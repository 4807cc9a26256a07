import {
  combineBackend,
  combineEach,
  dispatchExperts,
  type ExpertHandler,
  InProcessTransport,
  Placement,
  type Routing,
} from "@moeswarm/dispatch";
import { type Benchmark, interleaved, median, type Row } from "../harness.js";

// The f32 combine of dispatchExperts (issue #15): the JS loop it had before, copied here verbatim as
// the floor measured in the same run, against the combine dispatch uses now (WebAssembly SIMD where
// the runtime has it), at n_embd 3072, k 8 and 1, 8, 64 tokens. The two are timed in turn, round
// after round, so load that comes and goes falls on both; the figure is old / new per round (a
// speed-up), its median and the 10th-90th percentile spread. Then one dispatchExperts call at one
// token with two instant in-process workers (the setting the profile in the issue used).

const EMBD = 3072;
const K = 8;
const TOKENS = [1, 8, 64];
const N_EXPERT = 128;

/** The combine before #15 (combine.ts `combineSlotsF32` at 1966462), unchanged: the floor. */
function combineBefore(
  out: Float32Array,
  n: number,
  k: number,
  embd: number,
  weights: Float32Array,
  slots: { src: (Float32Array | undefined)[]; off: Float64Array },
): void {
  for (let i = 0; i < n; i++) {
    const o = i * embd;
    let first = true;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      const y = slots.src[s];
      if (y === undefined) continue;
      const w = weights[s]!;
      const yo = slots.off[s]!;
      if (first) {
        for (let c = 0; c < embd; c++) out[o + c] = w * y[yo + c]!;
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[o + c]! += Math.fround(w * y[yo + c]!);
      }
    }
  }
}

/** combineEach as it was: the old combine over the mode-"each" layout. */
function combineEachBefore(y: Float32Array, weights: Float32Array, n: number): Float32Array {
  const out = new Float32Array(n * EMBD);
  const src: (Float32Array | undefined)[] = new Array(n * K).fill(y);
  const off = Float64Array.from({ length: n * K }, (_, s) => s * EMBD);
  combineBefore(out, n, K, EMBD, weights, { src, off });
  return out;
}

function lcg(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

function quantile(xs: readonly number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))]!;
}

/** Old / new per round: median and the 10-90% spread. */
function ratioStats(old: readonly number[], now: readonly number[]) {
  const r = old.map((o, i) => o / now[i]!);
  return { median: median(r), p10: quantile(r, 0.1), p90: quantile(r, 0.9) };
}

async function combineRows(rows: Row[], ratios: Record<string, number>): Promise<void> {
  const rand = lcg(15);
  for (const n of TOKENS) {
    const y = Float32Array.from({ length: n * K * EMBD }, () => rand() - 0.5);
    const weights = Float32Array.from({ length: n * K }, () => rand());
    const a = combineEachBefore(y, weights, n);
    const b = combineEach(y, weights, { n, k: K, embd: EMBD });
    const ua = new Uint32Array(a.buffer);
    const ub = new Uint32Array(b.buffer);
    if (ua.some((v, i) => v !== ub[i])) throw new Error(`combine: new and old differ at n=${n}`);
    // calls per timed sample: ~0.5 ms of old work, so the timer's cost stays out of the figure
    const batch = Math.max(1, Math.round(64 / n));
    // both optimised by the JIT before any round is timed
    for (let i = 0; i < 50; i++) {
      combineEachBefore(y, weights, n);
      combineEach(y, weights, { n, k: K, embd: EMBD });
    }
    const [old, now] = await interleaved(
      [
        [
          "old",
          async () => {
            for (let i = 0; i < batch; i++) combineEachBefore(y, weights, n);
          },
        ],
        [
          "new",
          async () => {
            for (let i = 0; i < batch; i++) combineEach(y, weights, { n, k: K, embd: EMBD });
          },
        ],
      ],
      { minTimeMs: 1500, minRounds: 30 },
    );
    const stats = ratioStats(old!.samples, now!.samples);
    ratios[`old_over_new_t${n}`] = stats.median;
    rows.push({
      case: `combine t${n}`,
      old_us: median(old!.samples) / 1e3 / batch,
      new_us: median(now!.samples) / 1e3 / batch,
      old_min_us: Math.min(...old!.samples) / 1e3 / batch,
      new_min_us: Math.min(...now!.samples) / 1e3 / batch,
      "old/new": stats.median,
      p10: stats.p10,
      p90: stats.p90,
      rounds: old!.samples.length,
    });
  }
}

/** A worker that answers at once with a precomputed output of the right size. */
function instantWorker(rand: () => number): ExpertHandler {
  const cache = new Map<number, Float32Array>();
  return (req) => {
    let y = cache.get(req.n);
    if (!y) {
      y = Float32Array.from({ length: req.n * req.k * req.embd }, () => rand() - 0.5);
      cache.set(req.n, y);
    }
    return { mode: req.mode, n: req.n, k: req.k, embd: req.embd, y };
  };
}

async function dispatchRow(rows: Row[], ratios: Record<string, number>): Promise<void> {
  const rand = lcg(2);
  const ids = ["w0", "w1"];
  const placement = Placement.fromRegistrations(
    ids.map((id, w) => ({
      id,
      model: "bench",
      layers: [0],
      experts: Array.from({ length: N_EXPERT }, (_, e) => e).filter((e) => e % 2 === w),
    })),
  );
  const transport = new InProcessTransport(ids.map((id) => [id, instantWorker(rand)] as const));
  const routing: Routing = {
    n: 1,
    k: K,
    ids: Int32Array.from([3, 10, 17, 24, 41, 66, 99, 120]),
    weights: Float32Array.from({ length: K }, () => rand()),
  };
  const hidden = Float32Array.from({ length: EMBD }, () => rand() - 0.5);
  const options = { layer: 0, placement, transport, deadlineMs: 60_000 };
  const batch = 20;
  for (let i = 0; i < 200; i++) await dispatchExperts(hidden, routing, options);
  const [call] = await interleaved(
    [
      [
        "dispatch",
        async () => {
          for (let i = 0; i < batch; i++) await dispatchExperts(hidden, routing, options);
        },
      ],
    ],
    { minTimeMs: 1500, minRounds: 30 },
  );
  const us = median(call!.samples) / 1e3 / batch;
  ratios.dispatch_us_t1_w2 = us;
  rows.push({
    case: "dispatchExperts t1 w2",
    new_us: us,
    new_min_us: Math.min(...call!.samples) / 1e3 / batch,
    p10: quantile(call!.samples, 0.1) / 1e3 / batch,
    p90: quantile(call!.samples, 0.9) / 1e3 / batch,
    rounds: call!.samples.length,
  });
}

export const combine: Benchmark = {
  name: "combine",
  description: `the f32 combine, old JS vs now, n_embd ${EMBD}, k ${K}; dispatchExperts at 1 token, 2 instant workers`,
  async run() {
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    await combineRows(rows, ratios);
    await dispatchRow(rows, ratios);
    return {
      rows,
      ratios,
      notes: [
        `combine in use: ${combineBackend()} (MOESWARM_COMBINE=js forces the JS fallback)`,
        "old/new: per round, old combine time / new (a speed-up), median and 10th-90th percentiles; both give the same bits (checked before timing)",
        "dispatchExperts t1 w2: one call (one layer, one token, top-8, two in-process workers answering at once), us per call; compare with the same row of a run at the commit before",
      ],
    };
  },
};

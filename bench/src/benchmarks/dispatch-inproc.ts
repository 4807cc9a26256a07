import {
  combineEach,
  dispatchExperts,
  type ExpertHandler,
  InProcessTransport,
  Placement,
  type Routing,
} from "@moeswarm/dispatch";
import { type Benchmark, measure, type Row } from "../harness.js";

// The cost of dispatchExperts itself (grouping by owner, building each worker's request, the
// concurrent fan-out, result validation, the f32 combine) with in-process workers that answer
// instantly with precomputed outputs, next to the combine arithmetic alone on the same numbers.
// The ratio dispatch / combine is the figure: how much the sharding machinery adds to the work a
// monolithic combine must do anyway.

const N_EMBD = 3072;
const K = 8;
const N_EXPERT = 128;
const WORKERS = [2, 8, 32];
const TOKENS = [1, 8, 64];

function lcg(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

function routingFor(n: number, rand: () => number): Routing {
  const ids = new Int32Array(n * K);
  const weights = new Float32Array(n * K);
  for (let i = 0; i < n; i++) {
    const pool = Array.from({ length: N_EXPERT }, (_, e) => e);
    for (let j = 0; j < K; j++) {
      ids[i * K + j] = pool.splice(Math.floor(rand() * pool.length), 1)[0]!;
      weights[i * K + j] = rand();
    }
  }
  return { n, k: K, ids, weights };
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

export const dispatchInproc: Benchmark = {
  name: "dispatch-inproc",
  description: `dispatchExperts overhead vs the combine alone: n_embd ${N_EMBD}, top-${K} of ${N_EXPERT}, instant in-process workers`,
  async run() {
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    for (const workers of WORKERS) {
      const rand = lcg(workers);
      const ids = Array.from({ length: workers }, (_, w) => `w${w}`);
      const placement = Placement.fromRegistrations(
        ids.map((id, w) => ({
          id,
          model: "bench",
          layers: [0],
          experts: Array.from({ length: N_EXPERT }, (_, e) => e).filter((e) => e % workers === w),
        })),
      );
      const transport = new InProcessTransport(ids.map((id) => [id, instantWorker(rand)] as const));
      for (const n of TOKENS) {
        const routing = routingFor(n, rand);
        const hidden = Float32Array.from({ length: n * N_EMBD }, () => rand() - 0.5);
        const yAll = Float32Array.from({ length: n * K * N_EMBD }, () => rand() - 0.5);
        const options = { layer: 0, placement, transport, deadlineMs: 60_000 };
        const requests = new Set(Array.from(routing.ids, (e) => e % workers)).size;
        const dispatch = await measure(
          `dispatch w${workers} t${n}`,
          () => dispatchExperts(hidden, routing, options),
          {
            minTimeMs: 250,
          },
        );
        const combine = await measure(
          `combine t${n}`,
          () => combineEach(yAll, routing.weights, { n, k: K, embd: N_EMBD }),
          { minTimeMs: 250, batch: n === 1 ? 20 : 1 },
        );
        const ratio = dispatch.medianNs / combine.medianNs;
        ratios[`dispatch_over_combine_w${workers}_t${n}`] = ratio;
        rows.push({
          workers,
          tokens: n,
          requests,
          dispatch_us: dispatch.medianNs / 1e3,
          combine_us: combine.medianNs / 1e3,
          dispatch_us_per_token: dispatch.medianNs / 1e3 / n,
          overhead_us_per_token: (dispatch.medianNs - combine.medianNs) / 1e3 / n,
          ratio,
        });
      }
    }
    return {
      rows,
      ratios,
      notes: [
        "dispatch_us: one dispatchExperts call (one layer) with workers that return precomputed outputs; combine_us: combineEach on the same [n x k x n_embd] outputs",
        "ratio = dispatch / combine (median times); overhead_us_per_token = (dispatch - combine) / tokens",
      ],
    };
  },
};

// The mixed-type slice of test/mixed-types.test.ts and the order of requests its runs send, shared
// with the standalone reproducer of issue #19 (test/vk-repro.ts), so that both drive a worker
// through the very same graphs.

import { type GgufMetadataValue, ggufValue, writeGguf } from "@moeswarm/shard";
import {
  type Fixture,
  type FixtureTensor,
  normals,
  randomIds,
  randomWeights,
  TYPES,
  writeModel,
} from "./fixtures.js";

export const N_EMBD = 256;
export const N_FF = 256;
export const N_EXPERT = 8;
export const K = 4;
export const ITERS = 3;

/** Layer i holds TYPES[i] (f32, f16, bf16, q8_0, q4_0, q4_K, q6_K), all in one file. */
export async function writeMixed(dir: string): Promise<Fixture> {
  const tensors = new Map<string, FixtureTensor>();
  for (const [il, type] of TYPES.entries()) {
    const m = await writeModel(
      { type, nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layers: [il], seed: 500 + il },
      dir,
    );
    for (const [name, t] of m.tensors) tensors.set(name, t);
  }
  const metadata = new Map<string, GgufMetadataValue>();
  metadata.set("general.architecture", ggufValue.str("qwen3moe"));
  const path = `${dir}/mixed.gguf`;
  await writeGguf({ metadata, tensors: [...tensors.values()] }, path);
  const spec = {
    type: TYPES[0],
    nEmbd: N_EMBD,
    nFf: N_FF,
    nExpert: N_EXPERT,
    layers: [...TYPES.keys()],
    seed: 500,
  };
  return { spec, path, tensors, dir, cleanup: () => {} };
}

/** One request of a schedule: an "each" run and a "sum" run over the same rows. */
export interface MixedStep {
  label: string;
  layer: number;
  n: number;
  x: Float32Array;
  ids: Int32Array;
  w: Float32Array;
}

/**
 * The mixed case: every layer, ITERS times over, at n = 1 and 8 with 20% empty slots (new row
 * counts each pass, so graphs are rebuilt and the cache of 16 evicts).
 */
export function* mixedSteps(): Generator<MixedStep> {
  for (let it = 0; it < ITERS; it++) {
    const seed = 10 * it;
    for (const layer of TYPES.keys()) {
      for (const n of [1, 8]) {
        yield {
          label: `pass ${it} layer ${layer} n ${n}`,
          layer,
          n,
          x: normals(n * N_EMBD, 41 + n + seed),
          ids: randomIds(n, K, [...Array(N_EXPERT).keys()], 42 + n + seed, 0.2),
          w: randomWeights(n, K, 43 + n + seed),
        };
      }
    }
  }
}

/** The chunk case's requests: one per layer of 8 tokens x 4 slots (~25 rows). */
export function* chunkSteps(): Generator<MixedStep> {
  for (const layer of TYPES.keys()) {
    const n = 8;
    yield {
      label: `chunk layer ${layer}`,
      layer,
      n,
      x: normals(n * N_EMBD, 61 + layer),
      ids: randomIds(n, K, [...Array(N_EXPERT).keys()], 62 + layer, 0.2),
      w: randomWeights(n, K, 63 + layer),
    };
  }
}

// The cross-backend matrix: the same dispatch frames (activations, expert ids, k) through every
// expert-compute backend this machine has, each compared with the f64 oracle and with the others,
// per ggml type and batch size. Equivalence is what lets a swarm mix phones, desktops and GPUs.
//
//   pnpm --filter @moeswarm/bench matrix [--short] [--json]
//
// --short (CI): 3 types, batches 1 and 8. A backend that cannot run here is listed with the reason.

import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { cosine, relL2 } from "@moeswarm/core";
import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import {
  type ExpertCompute,
  expertWorkerPath,
  loadExpertCompute,
  spawnExpertWorker,
  spawnVulkanExpertWorker,
} from "@moeswarm/worker-native";
// the f64 oracle and the synthetic models of worker-native's equivalence tests: one definition
import {
  type Fixture,
  normals,
  oracleEach,
  randomIds,
  TYPES,
  writeModelPerType,
} from "../../packages/worker-native/test/fixtures.js";

const N_EMBD = 256;
const N_FF = 256;
const N_EXPERT = 8;
const K = 4;

interface Backend {
  name: string;
  load(path: string): Promise<ExpertCompute>;
}

const BACKENDS: Backend[] = [
  { name: "x86 addon", load: (p) => loadExpertCompute(p, { backend: "native", threads: 1 }) },
  { name: "llama-cpu", load: (p) => loadExpertCompute(p, { backend: "llama-cpu", threads: 1 }) },
  {
    name: "aarch64 (qemu)",
    load: (p) =>
      spawnExpertWorker(expertWorkerPath({ target: "linux-arm64", variant: "armv82" }), p, {
        launcher: "qemu-aarch64-static",
        threads: 1,
      }),
  },
  // lavapipe (a CPU-type Vulkan device) counts here: it runs ggml-vulkan's shaders
  { name: "vulkan", load: (p) => spawnVulkanExpertWorker(p, { allowCpuDevice: true, threads: 1 }) },
  {
    name: "cuda",
    load: async (p) => {
      const exe = join(expertWorkerPath(), "..", "..", "linux-x64-cuda", "moeswarm-expert-worker");
      if (!existsSync(exe)) throw new Error("no CUDA build (worker-native's scripts/build-gpu.sh cuda)");
      return spawnExpertWorker(exe, p, { device: "gpu" });
    },
  },
  { name: "ts", load: (p) => loadExpertCompute(p, { backend: "ts" }) },
];

/** Min cosine and max relative L2 over the filled slots of two "each" outputs. */
function compare(a: Float32Array, b: Float32Array | Float64Array): { cos: number; rel: number } {
  let cos = 1;
  let rel = 0;
  for (let s = 0; s < a.length / N_EMBD; s++) {
    const x = a.subarray(s * N_EMBD, (s + 1) * N_EMBD);
    const y = b.subarray(s * N_EMBD, (s + 1) * N_EMBD);
    cos = Math.min(cos, cosine(x, y));
    rel = Math.max(rel, relL2(x, y));
  }
  return { cos, rel };
}

export interface MatrixResult {
  backends: string[];
  unavailable: Record<string, string>;
  /** rows[type][batch][backend] vs the oracle. */
  oracle: Record<string, Record<number, Record<string, { cos: number; rel: number }>>>;
  /** pairs[type]["a|b"]: worst over batches. */
  pairs: Record<string, Record<string, { cos: number; rel: number }>>;
}

export async function runMatrix(
  types: readonly GgmlType[],
  batches: readonly number[],
): Promise<MatrixResult> {
  const dir = mkdtempSync(join(tmpdir(), "moeswarm-matrix-"));
  try {
    const models: Map<GgmlType, Fixture> = await writeModelPerType(
      { nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layers: [0] },
      500,
      dir,
    );
    const result: MatrixResult = { backends: [], unavailable: {}, oracle: {}, pairs: {} };
    for (const type of types) {
      const model = models.get(type)!;
      const name = ggmlTypeName(type);
      const outputs = new Map<string, Float32Array[]>();
      const refs: Float64Array[] = [];
      const frames = batches.map((n) => ({
        x: normals(n * N_EMBD, 600 + n),
        ids: randomIds(n, K, [...Array(N_EXPERT).keys()], 700 + n),
      }));
      for (const f of frames) refs.push(await oracleEach(model, 0, f.x, f.ids, K));
      for (const b of BACKENDS) {
        if (result.unavailable[b.name]) continue;
        let compute: ExpertCompute;
        try {
          compute = await b.load(model.path);
        } catch (error) {
          result.unavailable[b.name] = (error as Error).message.split("\n")[0]!;
          continue;
        }
        try {
          const ys: Float32Array[] = [];
          for (const f of frames)
            ys.push(await compute.run({ layer: 0, x: f.x, ids: f.ids, k: K, mode: "each" }));
          outputs.set(b.name, ys);
          if (!result.backends.includes(b.name)) result.backends.push(b.name);
        } finally {
          await compute.close();
        }
      }
      result.oracle[name] = {};
      batches.forEach((n, i) => {
        const row: Record<string, { cos: number; rel: number }> = {};
        for (const [b, ys] of outputs) row[b] = compare(ys[i]!, refs[i]!);
        result.oracle[name]![n] = row;
      });
      result.pairs[name] = {};
      const names = [...outputs.keys()];
      for (let i = 0; i < names.length; i++) {
        for (let j = i + 1; j < names.length; j++) {
          let cos = 1;
          let rel = 0;
          batches.forEach((_, bi) => {
            const c = compare(outputs.get(names[j]!)![bi]!, outputs.get(names[i]!)![bi]!);
            cos = Math.min(cos, c.cos);
            rel = Math.max(rel, c.rel);
          });
          result.pairs[name]![`${names[i]}|${names[j]}`] = { cos, rel };
        }
      }
    }
    return result;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

const cell = (c: { cos: number; rel: number } | undefined) =>
  c ? `${c.cos.toFixed(6)} / ${c.rel.toExponential(1)}` : "-";

export function formatMatrix(r: MatrixResult): string {
  const w = 20;
  const lines: string[] = [];
  lines.push("vs the f64 oracle: min cosine / max rel. L2 per slot");
  lines.push(["type", "n", ...r.backends].map((s, i) => s.padEnd(i < 2 ? (i ? 4 : 6) : w)).join(" "));
  for (const [type, rows] of Object.entries(r.oracle)) {
    for (const [n, row] of Object.entries(rows)) {
      lines.push([type.padEnd(6), n.padEnd(4), ...r.backends.map((b) => cell(row[b]).padEnd(w))].join(" "));
    }
  }
  lines.push("");
  lines.push("between backends (worst over the batches): min cosine / max rel. L2");
  for (const [type, pairs] of Object.entries(r.pairs)) {
    for (const [pair, c] of Object.entries(pairs))
      lines.push(`${type.padEnd(6)} ${pair.replace("|", " vs ").padEnd(34)} ${cell(c)}`);
  }
  for (const [b, why] of Object.entries(r.unavailable)) lines.push(`not here: ${b}: ${why}`);
  return lines.join("\n");
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: { short: { type: "boolean" }, json: { type: "boolean" }, help: { type: "boolean", short: "h" } },
  });
  if (values.help) {
    process.stdout.write("usage: pnpm --filter @moeswarm/bench matrix [--short] [--json]\n");
    return;
  }
  const types = values.short ? [GgmlType.F32, GgmlType.Q8_0, GgmlType.Q4_K] : TYPES;
  const batches = values.short ? [1, 8] : [1, 8, 64];
  process.stderr.write(`matrix: ${types.length} types x batches ${batches.join(", ")} ...\n`);
  const r = await runMatrix(types, batches);
  process.stdout.write(values.json ? `${JSON.stringify(r)}\n` : `${formatMatrix(r)}\n`);
}

if (process.argv[1] && import.meta.url.endsWith(process.argv[1].split("/").pop()!)) await main();

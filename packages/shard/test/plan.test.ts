// The offload planner on a Qwen3.5-122B-A10B-shaped header (written header-only with the shard
// writer, read back from the file and over HTTP Range requests): exact sums, the KV cache and
// recurrent state of the hybrid architecture from the published configuration, the -ot regex
// against every tensor name, the --n-cpu-moe equivalence, swarm slices, and the reference plan.

import { createReadStream, statSync } from "node:fs";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { InvalidArgumentError } from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  assignSwarm,
  equivalentNCpuMoe,
  expertOverridePattern,
  GgmlType,
  type GgufHeader,
  type GgufWriteTensor,
  ggufValue,
  httpSource,
  kvCacheSize,
  modelHparams,
  nCpuMoePattern,
  numberSetPattern,
  type OffloadPlan,
  offloadPlanToJson,
  parseByteSize,
  planOffload,
  readGguf,
  recurrentStateSize,
  toGiB,
  writeGguf,
} from "../src/index.js";
import { QWEN35_122B, qwen35moeModel } from "./plan-fixtures.js";

const GIB = 1n << 30n;
const tmp = tempDir("moeswarm-plan-");
const path122 = join(tmp.dir, "qwen35-122b-q4km.gguf");
let header: GgufHeader;
let server: Server;
let base: string;
let requests = 0;

beforeAll(async () => {
  await writeGguf(qwen35moeModel(QWEN35_122B), path122, { headerOnly: true });
  header = await readGguf(path122);
  server = createServer((req, res) => {
    requests++;
    const size = statSync(path122).size;
    const m = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range ?? "");
    if (!m) {
      res.writeHead(400).end();
      return;
    }
    const start = Number(m[1]);
    const end = Math.min(Number(m[2]), size - 1);
    res.writeHead(206, {
      "content-range": `bytes ${start}-${end}/${size}`,
      "content-length": end - start + 1,
    });
    createReadStream(path122, { start, end }).pipe(res);
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

afterAll(async () => {
  await new Promise<void>((r) => server.close(() => r()));
  tmp.remove();
});

/** Every tensor once; device sums add up to the model; VRAM/RAM weights are what their tensors hold. */
function checkSums(plan: OffloadPlan, h: GgufHeader, tiedOutput = 0n): void {
  const names = plan.tensors.map((t) => t.name);
  expect(new Set(names).size).toBe(h.tensors.length);
  expect(names).toEqual(h.tensors.map((t) => t.name));
  let total = 0n;
  for (const t of h.tensors) total += t.nbytes;
  expect(plan.modelBytes).toBe(total);
  const w = plan.weights;
  expect(w.vram + w.ram + w.swarm + w.skipped).toBe(total);
  const by = (d: string) => plan.tensors.filter((t) => t.device === d).reduce((s, t) => s + t.bytes, 0n);
  expect(by("vram")).toBe(w.vram);
  expect(by("ram")).toBe(w.ram);
  expect(plan.vram.weights).toBe(w.vram + tiedOutput);
  expect(plan.ram.weights).toBe(w.ram);
  // The data section holds every tensor, padded to the alignment, and nothing else.
  const align = BigInt(h.alignment);
  expect(h.dataSize >= total).toBe(true);
  expect(h.dataSize - total < align * BigInt(h.tensors.length)).toBe(true);
  // Device totals are the sum of their parts.
  for (const d of [plan.vram, plan.ram]) {
    expect(d.total).toBe(d.weights + d.kvCache + d.recurrentState + d.compute + d.margin);
  }
}

describe("the 122B-shaped header", () => {
  it("holds the published shape in Q4_K_M types: 74.2 GB, 48 blocks, 12 of them attention", () => {
    const hp = modelHparams(header);
    expect(hp.arch).toBe("qwen35moe");
    expect(hp.nLayerAll).toBe(48);
    expect(hp.recurrent.filter((r) => !r).length).toBe(12);
    expect(hp.recurrent.map((r, i) => (r ? -1 : i)).filter((i) => i >= 0)).toEqual([
      3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47,
    ]);
    expect(hp.nVocab).toBe(248320);
    // Q4_K: 144 bytes per 256 values, Q6_K 210; gate/up Q4_K, down Q6_K on use_more_bits layers.
    const q4 = (3072n / 256n) * 144n * 1024n * 256n;
    const down6 = (1024n / 256n) * 210n * 3072n * 256n;
    const layerBytes = (l: number) =>
      header.tensors
        .filter((t) => t.name.startsWith(`blk.${l}.ffn_`) && t.name.includes("_exps."))
        .reduce((s, t) => s + t.nbytes, 0n);
    expect(layerBytes(47)).toBe(2n * q4 + down6);
    expect(layerBytes(40)).toBe(3n * q4);
    const total = header.tensors.reduce((s, t) => s + t.nbytes, 0n);
    expect(total).toBe(74_201_739_264n);
  });

  it("reads over HTTP Range in a few requests and plans the same as from the file", async () => {
    requests = 0;
    const source = httpSource(`${base}/model.gguf`);
    const remote = await readGguf(source);
    await source.close();
    expect(requests).toBeLessThanOrEqual(3);
    const a = planOffload(header, { vram: "64GiB", ram: "128GiB", ctx: 8192 });
    const b = planOffload(remote, { vram: "64GiB", ram: "128GiB", ctx: 8192 });
    expect(offloadPlanToJson(b)).toEqual(offloadPlanToJson(a));
  });
});

describe("KV cache and recurrent state", () => {
  it("counts only the 12 attention blocks for the KV cache and a fixed state for the 36 others", () => {
    const hp = modelHparams(header);
    const c = QWEN35_122B;
    const shape = (ctx: number, kv: "f16" | "q8_0" = "f16") => ({
      ctx,
      batch: 2048,
      ubatch: 512,
      seqs: 1,
      kvType: kv,
      kvTypeV: kv,
      flashAttention: true,
      kvUnified: false,
    });
    // Per token and attention block: K and V of n_head_kv x head_dim, f16.
    const perToken = BigInt(2 * c.nHeadKv * c.headDim * 2);
    expect(kvCacheSize(hp, shape(8192)).total).toBe(12n * 8192n * perToken);
    expect(kvCacheSize(hp, shape(262144)).total).toBe(12n * 262144n * perToken);
    // llama.cpp pads the context to 256 cells.
    expect(kvCacheSize(hp, shape(8000)).cells).toBe(8192);
    // q8_0: 34 bytes per 32 values.
    expect(kvCacheSize(hp, shape(8192, "q8_0")).total).toBe(
      12n * 8192n * 2n * BigInt((c.nHeadKv * c.headDim * 34) / 32),
    );
    // Gated DeltaNet state: conv (d_conv - 1) x (value dim + 2 x key dim) and value dim x head dim, f32.
    const keyDim = c.linearKeyHeads * c.linearHeadDim;
    const valueDim = c.linearValueHeads * c.linearHeadDim;
    const state = BigInt((c.convKernel - 1) * (valueDim + 2 * keyDim) + c.linearHeadDim * valueDim) * 4n;
    expect(recurrentStateSize(hp, { seqs: 1 }).total).toBe(36n * state);
    expect(recurrentStateSize(hp, { seqs: 4 }).total).toBe(4n * 36n * state);
  });
});

describe("planOffload on the 122B-shaped header", () => {
  it("keeps everything on a big GPU and counts every tensor once", () => {
    const plan = planOffload(header, { vram: "141GiB", ram: "64GiB", ctx: 8192 });
    checkSums(plan, header);
    expect(plan.fits).toBe(true);
    expect(plan.ramLayers).toEqual([]);
    expect(plan.overrideTensor).toBeUndefined();
    // token_embd stays in host memory, as llama.cpp keeps the input layer on the CPU.
    expect(plan.ram.weights).toBe(header.tensors.find((t) => t.name === "token_embd.weight")!.nbytes);
  });

  it("offloads whole expert layers from the end until a 64 GiB GPU fits", () => {
    const plan = planOffload(header, { vram: "64GiB", ram: "128GiB", ctx: 8192 });
    checkSums(plan, header);
    expect(plan.fits).toBe(true);
    expect(plan.ramLayers).toEqual([42, 43, 44, 45, 46, 47]);
    expect(plan.vram.total <= 64n * GIB).toBe(true);
    // One layer fewer would not fit.
    const fewer = planOffload(header, {
      vram: "64GiB",
      ram: "128GiB",
      ctx: 8192,
      order: [47, 46, 45, 44, 43],
    });
    expect(fewer.fits).toBe(false);
    expect(plan.overrideTensor).toBe("^blk\\.4[2-7]\\.ffn_(up|down|gate)_exps\\.weight$=CPU");
    expect(plan.nCpuMoe).toBeUndefined();
    expect(plan.llamaArgs).toContain("--override-tensor");
  });

  it("offloads from the beginning as --n-cpu-moe does, and says so", () => {
    const plan = planOffload(header, { vram: "64GiB", ram: "128GiB", ctx: 8192, order: "first" });
    checkSums(plan, header);
    expect(plan.ramLayers).toEqual([0, 1, 2, 3, 4, 5]);
    expect(plan.nCpuMoe).toBe(6);
    expect(plan.overrideTensor).toBe("^blk\\.[0-5]\\.ffn_(up|down|gate)_exps\\.weight$=CPU");
  });

  it("reproduces the reference: 10 expert layers in RAM, 14.2 GiB, at the model's full context", () => {
    const plan = planOffload(header, { vram: "64GiB", ram: "128GiB", ctx: QWEN35_122B.contextLength });
    checkSums(plan, header);
    expect(plan.fits).toBe(true);
    expect(plan.ramLayers).toEqual([38, 39, 40, 41, 42, 43, 44, 45, 46, 47]);
    const ramExperts = plan.layers.filter((l) => l.device === "ram").reduce((s, l) => s + l.bytes, 0n);
    expect(toGiB(ramExperts)).toBe("14.2");
    // VRAM in use (the free margin aside): 62.9 GiB against the reference's 62.6 GiB.
    const used = plan.vram.total - plan.vram.margin;
    expect(toGiB(used)).toBe("62.9");
    expect(plan.overrideTensor).toBe("^blk\\.(3[89]|4[0-7])\\.ffn_(up|down|gate)_exps\\.weight$=CPU");
  });

  it("keeps the most-selected layers on the GPU with demand statistics", () => {
    const demand = new Map<number, number[]>();
    for (let l = 0; l < 48; l++) demand.set(l, Array(256).fill(l === 5 || l === 20 ? 1 : 10));
    const plan = planOffload(header, { vram: "62GiB", ctx: 8192, demand });
    checkSums(plan, header);
    expect(plan.ramLayers.length).toBeGreaterThan(2);
    // The two least-selected layers leave first, then ties leave from the end.
    const n = plan.ramLayers.length;
    expect(plan.ramLayers).toEqual([5, 20, ...Array.from({ length: n - 2 }, (_, i) => 48 - n + 2 + i)]);
  });

  it("puts an explicit list of layers on the swarm", () => {
    const plan = planOffload(header, {
      vram: "64GiB",
      ctx: 8192,
      workers: [{ id: "a", capacity: "4GiB" }],
      swarm: [0, 1],
    });
    checkSums(plan, header);
    expect(plan.swarmLayers).toEqual([0, 1]);
    expect(plan.swarm!.assignments[0]!.slice!.layers).toEqual([0, 1]);
    expect(plan.overrides.map((o) => o.bufferType)).toEqual(["CPU", "MOESWARM"]);
  });

  it("reports a plan that cannot fit instead of throwing", () => {
    const plan = planOffload(header, { vram: "4GiB", ram: "16GiB", ctx: 8192 });
    checkSums(plan, header);
    expect(plan.fits).toBe(false);
    expect(plan.vram.fits).toBe(false);
    expect(plan.ram.fits).toBe(false);
    expect(plan.ramLayers.length).toBe(48);
  });

  it("takes an explicit compute reserve and margin", () => {
    const auto = planOffload(header, { vram: "64GiB", ctx: 8192 });
    const fixed = planOffload(header, { vram: "64GiB", ctx: 8192, reserve: "512MiB", margin: 0 });
    expect(fixed.computeBytes).toBe(512n << 20n);
    expect(fixed.vram.margin).toBe(0n);
    expect(fixed.ramLayers.length).toBeLessThan(auto.ramLayers.length);
  });

  it("validates its options", () => {
    const bad: Array<Record<string, unknown>> = [
      { vram: "lots" },
      { vram: -1 },
      { vram: "64GiB", ctx: 0 },
      { vram: "64GiB", kvType: "q3_k" },
      { vram: "64GiB", order: "middle" },
      { vram: "64GiB", order: [5, 5] },
      { vram: "64GiB", order: [99] },
      { vram: "64GiB", order: "demand" },
      { vram: "64GiB", swarm: [1] },
      {
        vram: "64GiB",
        workers: [
          { id: "a", capacity: "1GiB" },
          { id: "a", capacity: "1GiB" },
        ],
      },
    ];
    for (const options of bad) {
      expect(() => planOffload(header, options as never), JSON.stringify(options)).toThrow(
        InvalidArgumentError,
      );
    }
  });
});

describe("the -ot regex", () => {
  function matches(pattern: string, names: readonly string[]): string[] {
    const re = new RegExp(pattern.slice(0, pattern.lastIndexOf("=")));
    return names.filter((n) => re.test(n));
  }

  it("matches exactly the tensors of the offloaded layers among all tensor names", () => {
    const names = header.tensors.map((t) => t.name);
    for (const order of ["last", "first"] as const) {
      for (const vram of ["40GiB", "50GiB", "60GiB", "64GiB"]) {
        const plan = planOffload(header, { vram, ctx: 8192, order });
        const wanted = plan.tensors
          .filter((t) => t.device === "ram" && t.kind === "expert")
          .map((t) => t.name);
        expect(matches(plan.overrideTensor!, names), `${order} ${vram}`).toEqual(wanted);
      }
    }
    // Arbitrary layer sets, with gaps.
    const sets = [[0], [9, 10], [1, 3, 5, 7, 9, 11, 13], [19, 20, 21, 29, 30, 31, 39, 40, 41], [47]];
    for (const layers of sets) {
      const pattern = expertOverridePattern(layers, names);
      const want = names.filter((n) =>
        layers.some((l) => n.startsWith(`blk.${l}.ffn_`) && n.includes("_exps.")),
      );
      expect(matches(`${pattern}=CPU`, names), layers.join(",")).toEqual(want);
      expect(pattern).not.toMatch(/[,=]/);
    }
  });

  it("covers merged gate_up, biases and scales, and nothing of other layers", () => {
    const tensors: GgufWriteTensor[] = [];
    for (let l = 0; l < 120; l++) {
      const b = `blk.${l}.`;
      tensors.push({ name: `${b}attn_norm.weight`, type: GgmlType.F32, shape: [64] });
      tensors.push({ name: `${b}ffn_gate_inp.weight`, type: GgmlType.F32, shape: [64, 4] });
      tensors.push({ name: `${b}ffn_gate_up_exps.weight`, type: GgmlType.F16, shape: [64, 256, 4] });
      tensors.push({ name: `${b}ffn_gate_up_exps.bias`, type: GgmlType.F32, shape: [256, 4] });
      tensors.push({ name: `${b}ffn_down_exps.weight`, type: GgmlType.F16, shape: [128, 64, 4] });
      tensors.push({ name: `${b}ffn_down_exps.bias`, type: GgmlType.F32, shape: [64, 4] });
      tensors.push({ name: `${b}ffn_down_exps.scale`, type: GgmlType.F32, shape: [4] });
      tensors.push({ name: `${b}ffn_down_shexp.weight`, type: GgmlType.F16, shape: [128, 64] });
    }
    const names = tensors.map((t) => t.name);
    for (const layers of [
      [7, 8, 9, 10, 11],
      [95, 96, 97, 98, 99, 100, 101, 102, 103, 104],
      [0, 119],
      [100],
    ]) {
      const pattern = expertOverridePattern(layers, names);
      const want = names.filter((n) => layers.some((l) => n.startsWith(`blk.${l}.`)) && n.includes("_exps."));
      expect(want.length).toBe(layers.length * 5);
      expect(matches(`${pattern}=CPU`, names), pattern).toEqual(want);
    }
  });

  it("has number alternatives that match exactly their range", () => {
    const check = (a: number, b: number) => {
      const re = new RegExp(`^(?:${numberSetPattern(Array.from({ length: b - a + 1 }, (_, i) => a + i))})$`);
      for (let n = 0; n <= Math.max(1100, b + 100); n++) {
        if (re.test(String(n)) !== (n >= a && n <= b)) throw new Error(`${a}..${b} at ${n}: ${re.source}`);
      }
      expect(re.test(`0${a}`)).toBe(false);
    };
    for (let a = 0; a < 60; a += 1) for (let b = a; b < 130; b += 7) check(a, b);
    for (const [a, b] of [
      [9, 10],
      [99, 100],
      [8, 1000],
      [95, 1005],
      [0, 999],
      [10, 99],
    ] as const)
      check(a, b);
    expect(numberSetPattern([38, 39, 40, 41, 42, 43, 44, 45, 46, 47])).toBe("3[89]|4[0-7]");
    expect(numberSetPattern([30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47])).toBe(
      "3[0-9]|4[0-7]",
    );
  });

  it("finds --n-cpu-moe only when llama.cpp's own patterns move the same tensors", () => {
    const names = header.tensors.map((t) => t.name);
    const expertsOf = (layers: number[]) =>
      new Set(names.filter((n) => layers.some((l) => n.startsWith(`blk.${l}.ffn_`) && n.includes("_exps."))));
    expect(equivalentNCpuMoe(names, expertsOf([0, 1, 2]))).toBe(3);
    expect(equivalentNCpuMoe(names, expertsOf([1, 2]))).toBeUndefined();
    expect(equivalentNCpuMoe(names, expertsOf([45, 46, 47]))).toBeUndefined();
    expect(equivalentNCpuMoe(names, new Set(["blk.0.ffn_up_exps.weight"]))).toBeUndefined();
    // The pattern common/common.h builds for one layer.
    expect(nCpuMoePattern(12)).toBe("blk\\.12\\.ffn_(up|down|gate|gate_up)_(ch|)exps");
  });
});

describe("swarm slices", () => {
  const layers = [40, 41, 42, 43, 44, 45, 46, 47].map((layer) => ({
    layer,
    nExpert: 256,
    bytesPerExpert: 6_000_000n,
  }));
  const layerBytes = 256n * 6_000_000n;

  function coverage(plan: NonNullable<ReturnType<typeof assignSwarm>>) {
    const count = new Map<string, number>();
    for (const a of plan.assignments) {
      if (!a.slice) continue;
      expect(a.slice.bytes <= a.capacity).toBe(true);
      for (const l of a.slice.layers)
        for (const e of a.slice.experts) count.set(`${l}:${e}`, (count.get(`${l}:${e}`) ?? 0) + 1);
    }
    return count;
  }

  it("covers every expert once with one contiguous block per worker", () => {
    const workers = [
      { id: "gpu", capacity: layerBytes * 5n + 1000n },
      { id: "laptop", capacity: layerBytes + layerBytes / 2n },
      { id: "desktop", capacity: layerBytes },
      { id: "phone-1", capacity: layerBytes / 2n },
      { id: "phone-2", capacity: layerBytes / 2n + 6_000_000n },
      { id: "phone-3", capacity: layerBytes / 3n },
    ];
    const plan = assignSwarm(layers, workers)!;
    expect(plan).toBeDefined();
    const count = coverage(plan);
    expect(count.size).toBe(8 * 256);
    expect([...count.values()].every((c) => c === 1)).toBe(true);
    const gpu = plan.assignments.find((a) => a.worker === "gpu")!.slice!;
    expect(gpu.layers).toEqual([40, 41, 42, 43, 44]);
    expect(gpu.expertRanges).toEqual([{ start: 0, end: 256 }]);
    for (const a of plan.assignments) {
      if (a.slice) expect(a.slice.expertRanges.length).toBe(1);
    }
    // The last layer is split between two phones; the smallest phone is not needed.
    const slices = Object.fromEntries(plan.assignments.map((a) => [a.worker, a.slice]));
    expect(slices["phone-2"]!.expertRanges).toEqual([{ start: 0, end: 129 }]);
    expect(slices["phone-1"]!.expertRanges).toEqual([{ start: 129, end: 256 }]);
    expect(slices["phone-3"]).toBeUndefined();
  });

  it("gives up when the workers cannot cover the layers, and respects per-worker limits", () => {
    expect(assignSwarm(layers, [{ id: "a", capacity: layerBytes * 7n }])).toBeUndefined();
    const limited = assignSwarm(layers.slice(0, 2), [
      { id: "a", capacity: layerBytes * 2n, maxLayers: 1 },
      { id: "b", capacity: layerBytes * 2n, maxExperts: 128 },
      { id: "c", capacity: layerBytes * 2n, maxExperts: 128 },
    ])!;
    expect(limited).toBeDefined();
    const count = coverage(limited);
    expect(count.size).toBe(2 * 256);
    expect(limited.assignments[0]!.slice!.layers.length).toBe(1);
    for (const a of limited.assignments.slice(1)) expect(a.slice!.experts.length).toBeLessThanOrEqual(128);
  });

  it("replicates the hottest experts when demand statistics are given", () => {
    const demand = new Map<number, number[]>();
    for (const l of layers)
      demand.set(
        l.layer,
        Array.from({ length: 256 }, (_, e) => (l.layer === 46 && e % 16 === 3 ? 1000 : 1)),
      );
    const workers = [
      { id: "big", capacity: layerBytes * 8n },
      { id: "spare-1", capacity: 6_000_000n * 8n },
      { id: "spare-2", capacity: 6_000_000n * 8n },
    ];
    const plan = assignSwarm(layers, workers, { demand, maxCopies: 2 })!;
    const count = coverage(plan);
    const hot = Array.from({ length: 16 }, (_, i) => i * 16 + 3);
    for (const e of hot) expect(count.get(`46:${e}`)).toBe(2);
    expect([...count.values()].every((c) => c <= 2)).toBe(true);
    const replicas = plan.assignments.filter((a) => a.slice?.role === "replica");
    expect(replicas.map((a) => a.slice!.layers)).toEqual([[46], [46]]);
    expect(plan.copies.get(46)![3]).toBe(2);
  });

  it("serves the layers that leave the GPU from the swarm, the rest from RAM", () => {
    const workers = [
      { id: "gpu-a", capacity: "6GiB" },
      { id: "laptop", capacity: "3GiB" },
      { id: "phone", capacity: "1.6GiB" },
    ];
    const plan = planOffload(header, { vram: "60GiB", ram: "128GiB", ctx: 8192, workers });
    checkSums(plan, header);
    expect(plan.fits).toBe(true);
    expect(plan.swarmLayers.length).toBeGreaterThan(0);
    expect(plan.ramLayers.length).toBeGreaterThan(0);
    // Swarm layers leave first (from the end), the rest follow into RAM.
    expect(Math.min(...plan.swarmLayers)).toBeGreaterThan(Math.max(...plan.ramLayers));
    const [ramOt, swarmOt] = plan.overrideTensor!.split(",");
    expect(ramOt).toMatch(/=CPU$/);
    expect(swarmOt).toMatch(/=MOESWARM$/);
    const covered = coverage(plan.swarm!);
    expect(covered.size).toBe(plan.swarmLayers.length * 256);
    // RAM is tried first with swarm: "overflow", so with enough RAM the swarm holds nothing.
    const overflow = planOffload(header, {
      vram: "60GiB",
      ram: "128GiB",
      ctx: 8192,
      workers,
      swarm: "overflow",
    });
    expect(overflow.swarmLayers).toEqual([]);
    const tight = planOffload(header, { vram: "60GiB", ram: "8GiB", ctx: 8192, workers, swarm: "overflow" });
    expect(tight.swarmLayers.length).toBeGreaterThan(0);
    expect(tight.ram.fits).toBe(true);
  });
});

describe("byte sizes", () => {
  it("parses binary and decimal units", () => {
    expect(parseByteSize("64GiB")).toBe(64n * GIB);
    expect(parseByteSize("64G")).toBe(64n * GIB);
    expect(parseByteSize("64GB")).toBe(64_000_000_000n);
    expect(parseByteSize("1.5 GiB")).toBe((3n * GIB) / 2n);
    expect(parseByteSize(1234)).toBe(1234n);
    expect(parseByteSize(5n)).toBe(5n);
    expect(toGiB(62n * GIB + (GIB * 6n) / 10n)).toBe("62.6");
    for (const bad of ["", "GiB", "-1GiB", "1 PiB", "1e9", "1.2.3G"]) {
      expect(() => parseByteSize(bad), bad).toThrow(InvalidArgumentError);
    }
  });
});

it("plans a model without experts and a tied output layer", async () => {
  const path = join(tmp.dir, "dense.gguf");
  await writeGguf(
    {
      metadata: new Map([
        ["general.architecture", ggufValue.str("llama")],
        ["llama.block_count", ggufValue.u32(2)],
        ["llama.embedding_length", ggufValue.u32(64)],
        ["llama.attention.head_count", ggufValue.u32(4)],
        ["llama.attention.head_count_kv", ggufValue.u32(2)],
      ]),
      tensors: [
        { name: "token_embd.weight", type: GgmlType.F16, shape: [64, 1000] },
        { name: "blk.0.attn_q.weight", type: GgmlType.F16, shape: [64, 64] },
        { name: "blk.1.attn_q.weight", type: GgmlType.F16, shape: [64, 64] },
        { name: "output_norm.weight", type: GgmlType.F32, shape: [64] },
      ],
    },
    path,
    { headerOnly: true },
  );
  const h = await readGguf(path);
  const plan = planOffload(h, { vram: "1GiB", ctx: 512, margin: 0 });
  // No output.weight: llama.cpp duplicates token_embd into VRAM as the output layer.
  const embd = 64n * 1000n * 2n;
  checkSums(plan, h, embd);
  expect(plan.layers).toEqual([]);
  // Every block has a KV cache: 2 x 512 cells x (2 heads x 16) x f16, K and V.
  expect(plan.kv.total).toBe(2n * 512n * 32n * 2n * 2n);
  expect(plan.notes.some((n) => n.includes("output layer"))).toBe(true);
});

it("gives hostile headers a typed error, never a huge allocation", async () => {
  const write = async (name: string, blockCount: number, tensors: GgufWriteTensor[]) => {
    const path = join(tmp.dir, name);
    await writeGguf(
      {
        metadata: new Map([
          ["general.architecture", ggufValue.str("qwen3moe")],
          ["qwen3moe.block_count", ggufValue.u32(blockCount)],
          ["qwen3moe.embedding_length", ggufValue.u32(64)],
          ["qwen3moe.attention.head_count", ggufValue.u32(4)],
        ]),
        tensors,
      },
      path,
      { headerOnly: true },
    );
    return readGguf(path);
  };
  const far = await write("far.gguf", 2, [
    { name: "blk.999999999.ffn_up_exps.weight", type: GgmlType.F16, shape: [64, 64, 4] },
  ]);
  expect(() => planOffload(far, { vram: "1GiB" })).toThrow(/is beyond block_count 2/);
  const wide = await write("wide.gguf", 2, [
    { name: "blk.0.ffn_up_exps.weight", type: GgmlType.F16, shape: [32, 1, 100_000] },
  ]);
  expect(() => planOffload(wide, { vram: "1GiB" })).toThrow(/more than llama.cpp's 1024/);
  const deep = await write("deep.gguf", 1_000_000, []);
  expect(() => planOffload(deep, { vram: "1GiB" })).toThrow(/out of range/);
});

// Expert slicing: the slice's slabs are the source's bytes (checked by direct reads and by gguf-py,
// an independent reader), ranges compose to the whole, selections are validated with typed errors.

import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  bufferSource,
  type ExpertSlice,
  fileSource,
  findExpertTensors,
  findTensor,
  GgmlType,
  GgufValueType,
  getInteger,
  ggufValue,
  loadOrBuildManifest,
  readGguf,
  SLICE_KEYS,
  type SliceManifest,
  sliceExperts,
  synthesizeMoeModel,
  syntheticPreset,
  writeGguf,
} from "../src/index.js";
import { runGgufPy, tensor } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-slice-");
afterAll(() => tmp.remove());

const sha256 = (bytes: Uint8Array) => createHash("sha256").update(bytes).digest("hex");

async function collect(chunks: AsyncIterable<Uint8Array>): Promise<Buffer> {
  const parts: Uint8Array[] = [];
  for await (const c of chunks) parts.push(c);
  return Buffer.concat(parts);
}

let qwen3: string;
let qwen2: string;
let merged: string;
let manifest: SliceManifest;

beforeAll(async () => {
  qwen3 = join(tmp.dir, "qwen3moe.gguf");
  qwen2 = join(tmp.dir, "qwen2moe.gguf");
  await synthesizeMoeModel(syntheticPreset("tiny", "qwen3moe"), qwen3);
  await synthesizeMoeModel(syntheticPreset("tiny", "qwen2moe"), qwen2);
  manifest = (await loadOrBuildManifest(qwen3)).manifest;
  // A layout the synthesiser does not write: merged gate_up experts with per-expert bias and
  // scale companions (expert axis ne[2], ne[1] and ne[0]), and a dense first layer.
  merged = join(tmp.dir, "merged.gguf");
  await writeGguf(
    {
      metadata: new Map([
        ["general.architecture", ggufValue.str("gptoss")],
        ["general.name", ggufValue.str("merged-test")],
        ["gptoss.block_count", ggufValue.u32(2)],
        ["gptoss.expert_count", ggufValue.u32(4)],
        ["tokenizer.ggml.tokens", ggufValue.array(GgufValueType.STRING, ["a", "b"])],
      ]),
      tensors: [
        tensor("blk.0.ffn_up.weight", GgmlType.F32, [32, 16], 1),
        tensor("blk.1.ffn_gate_up_exps.weight", GgmlType.Q8_0, [32, 16, 4], 2),
        tensor("blk.1.ffn_gate_up_exps.bias", GgmlType.F32, [16, 4], 3),
        tensor("blk.1.ffn_down_exps.weight", GgmlType.F16, [8, 32, 4], 4),
        tensor("blk.1.ffn_down_exps.scale", GgmlType.F32, [4], 5),
        tensor("blk.1.ffn_gate_inp.weight", GgmlType.F32, [32, 4], 6),
      ],
    },
    merged,
  );
});

describe("findExpertTensors", () => {
  it("finds the routed-expert tensors, their expert axis and slab sizes", async () => {
    const layout = findExpertTensors(await readGguf(merged));
    expect(layout.layers.map((l) => l.layer)).toEqual([1]);
    const l = layout.layers[0]!;
    expect(l.nExpert).toBe(4);
    expect(l.tensors.map((t) => [t.name, t.projection, t.suffix, t.expertAxis, Number(t.slabBytes)])).toEqual(
      [
        ["blk.1.ffn_gate_up_exps.weight", "gate_up", "weight", 2, 16 * 34],
        ["blk.1.ffn_gate_up_exps.bias", "gate_up", "bias", 1, 16 * 4],
        ["blk.1.ffn_down_exps.weight", "down", "weight", 2, 8 * 32 * 2],
        ["blk.1.ffn_down_exps.scale", "down", "scale", 0, 4],
      ],
    );
    expect(Number(l.bytesPerExpert)).toBe(16 * 34 + 64 + 512 + 4);

    const q = findExpertTensors(await readGguf(qwen2));
    expect(q.layers.map((x) => x.tensors.map((t) => t.name.split(".")[2]))).toEqual([
      ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
      ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
    ]);
    expect(q).toMatchObject({ arch: "qwen2moe", blockCount: 2, expertCount: 8, expertUsedCount: 2 });
  });

  it("reports a model without experts as having none", async () => {
    const dense = join(tmp.dir, "dense.gguf");
    await writeGguf(
      {
        metadata: { "general.architecture": ggufValue.str("llama") },
        tensors: [tensor("blk.0.ffn_up.weight", GgmlType.F32, [4, 4], 1)],
      },
      dense,
    );
    expect(findExpertTensors(await readGguf(dense)).layers).toEqual([]);
    const err = await sliceExperts(dense, { layers: 0, experts: 0 }).catch((e: unknown) => e);
    expect(err).toMatchObject({ name: "GgufError", code: "MOESWARM_GGUF_NOT_MOE" });
  });
});

describe("sliceExperts", () => {
  it("copies exactly the chosen experts' slabs of the source, byte for byte", async () => {
    const source = readFileSync(qwen3);
    const header = await readGguf(qwen3);
    const experts = [0, 1, 5, 7];
    const slice = await sliceExperts(qwen3, { layers: [1], experts });
    try {
      const bytes = await collect(slice.stream());
      expect(bytes.byteLength).toBe(slice.length);
      const sh = await readGguf(bytes);
      expect(sh.tensors.map((t) => t.name)).toEqual([
        "blk.1.ffn_gate_exps.weight",
        "blk.1.ffn_up_exps.weight",
        "blk.1.ffn_down_exps.weight",
      ]);
      expect(sh.tensors.map((t) => t.absoluteOffset)).toEqual(
        slice.header.tensors.map((t) => t.absoluteOffset),
      );
      const hashes: string[] = [];
      for (const t of sh.tensors) {
        const src = findTensor(header, t.name)!;
        expect(t.type).toBe(src.type);
        expect(t.shape).toEqual([...src.shape.slice(0, 2), experts.length]);
        const slab = Number(src.nbytes) / src.shape[2]!;
        experts.forEach((e, i) => {
          const got = bytes.subarray(
            Number(t.absoluteOffset) + i * slab,
            Number(t.absoluteOffset) + (i + 1) * slab,
          );
          const want = source.subarray(
            Number(src.absoluteOffset) + e * slab,
            Number(src.absoluteOffset) + (e + 1) * slab,
          );
          expect(Buffer.compare(got, want), `${t.name} expert ${e}`).toBe(0);
          hashes.push(sha256(got));
        });
      }
      // The slice's keys: hyper-parameters kept, tokenizer arrays dropped, moeswarm.slice.* added.
      expect(getInteger(sh, "qwen3moe.expert_count")).toBe(8);
      expect(getInteger(sh, "qwen3moe.embedding_length")).toBe(64);
      expect(sh.metadata.has("tokenizer.ggml.tokens")).toBe(false);
      expect(sh.metadata.has("tokenizer.ggml.merges")).toBe(false);
      expect(sh.metadata.get("tokenizer.ggml.model")).toEqual(ggufValue.str("gpt2"));
      expect(sh.metadata.get(SLICE_KEYS.layers)).toMatchObject({ itemType: GgufValueType.UINT32 });
      expect([...(sh.metadata.get(SLICE_KEYS.layers)!.value as Uint32Array)]).toEqual([1]);
      expect([...(sh.metadata.get(SLICE_KEYS.experts)!.value as Uint32Array)]).toEqual(experts);
      expect(sh.metadata.get(SLICE_KEYS.source)).toEqual(ggufValue.str("moeswarm-synthetic-qwen3moe"));
      expect(sh.metadata.get(SLICE_KEYS.sourceSha256)).toEqual(
        ggufValue.str(sha256(source.subarray(0, header.headerSize))),
      );
      expect(sh.metadata.get(SLICE_KEYS.slabSha256)!.value).toEqual(hashes);
    } finally {
      await slice.close();
    }
  });

  it("writes the same bytes with or without the manifest, from a path, a buffer or a file source", async () => {
    const sel = { layers: { start: 0, end: 2 }, experts: { start: 2, end: 6 } };
    const a = await sliceExperts(qwen3, sel);
    const b = await sliceExperts(qwen3, { ...sel, manifest });
    const c = await sliceExperts(bufferSource(readFileSync(qwen3)), { ...sel, manifest, chunkSize: 1000 });
    const src = await fileSource(qwen3);
    const d = await sliceExperts(src, { ...sel, chunkSize: 4096 });
    const [ba, ...others] = await Promise.all([a, b, c, d].map((s) => collect(s.stream())));
    expect(others).toHaveLength(3);
    for (const other of others) expect(other.equals(ba!)).toBe(true);
    const out = join(tmp.dir, "written.gguf");
    await a.write(out);
    expect(readFileSync(out).equals(ba!)).toBe(true);
    for (const s of [a, b, c, d]) await s.close();
    // A ByteSource passed in stays open.
    expect((await src.read(0, 4)).byteLength).toBe(4);
    await src.close();
  });

  it("answers byte ranges: pieces concatenate to the whole stream", async () => {
    const slice = await sliceExperts(qwen3, { layers: [0, 1], experts: [1, 2, 3, 6], chunkSize: 777 });
    try {
      const whole = await collect(slice.stream());
      const cuts = [
        0,
        1,
        31,
        100,
        slice.header.headerSize,
        Number(slice.header.dataOffset) + 5,
        40_000,
        40_001,
        slice.length - 3,
        slice.length,
      ];
      const pieces: Buffer[] = [];
      for (let i = 0; i + 1 < cuts.length; i++) {
        const piece = await collect(slice.range(cuts[i]!, cuts[i + 1]!));
        expect(piece.byteLength).toBe(cuts[i + 1]! - cuts[i]!);
        pieces.push(piece);
      }
      expect(Buffer.concat(pieces).equals(whole)).toBe(true);
      expect((await collect(slice.range(0, slice.length))).equals(whole)).toBe(true);
      expect((await collect(slice.range(slice.length, slice.length))).byteLength).toBe(0);
      for (const [s, e] of [
        [-1, 3],
        [5, 4],
        [0, slice.length + 1],
        [0.5, 2],
      ] as const) {
        expect(() => slice.range(s, e), `${s}-${e}`).toThrow(
          expect.objectContaining({ code: "MOESWARM_INVALID_RANGE" }),
        );
      }
    } finally {
      await slice.close();
    }
  });

  it("slices merged gate_up experts and their bias and scale companions", async () => {
    const source = readFileSync(merged);
    const header = await readGguf(merged);
    const slice = await sliceExperts(merged, { layers: 1, experts: [1, 3] });
    const bytes = await collect(slice.stream());
    await slice.close();
    const sh = await readGguf(bytes);
    expect(sh.tensors.map((t) => [t.name, t.shape])).toEqual([
      ["blk.1.ffn_gate_up_exps.weight", [32, 16, 2]],
      ["blk.1.ffn_gate_up_exps.bias", [16, 2]],
      ["blk.1.ffn_down_exps.weight", [8, 32, 2]],
      ["blk.1.ffn_down_exps.scale", [2]],
    ]);
    for (const t of sh.tensors) {
      const src = findTensor(header, t.name)!;
      const slab = Number(src.nbytes) / 4;
      const want = Buffer.concat(
        [1, 3].map((e) =>
          source.subarray(Number(src.absoluteOffset) + e * slab, Number(src.absoluteOffset) + (e + 1) * slab),
        ),
      );
      expect(
        bytes.subarray(Number(t.absoluteOffset), Number(t.absoluteOffset + t.nbytes)).equals(want),
        t.name,
      ).toBe(true);
    }
  });

  it("a slice of a slice takes global ids and equals slicing the model directly", async () => {
    const outer = await sliceExperts(qwen3, { layers: [0, 1], experts: [1, 2, 3, 5, 6] });
    const outerBytes = await collect(outer.stream());
    await outer.close();
    const inner = await sliceExperts(outerBytes, { layers: [1], experts: [2, 5, 6] });
    const direct = await sliceExperts(qwen3, { layers: [1], experts: [2, 5, 6], manifest });
    expect((await collect(inner.stream())).equals(await collect(direct.stream()))).toBe(true);
    await inner.close();
    await direct.close();
    const err = await sliceExperts(outerBytes, { layers: [1], experts: [4] }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: "MOESWARM_INVALID_RANGE" });
    expect((err as Error).message).toMatch(/expert 4 is not in this slice/);
  });

  it("loads in gguf-py, whose slabs equal the source's", async () => {
    const slice = await sliceExperts(qwen3, { layers: [0, 1], experts: [0, 3, 4, 7] });
    const path = join(tmp.dir, "pyslice.gguf");
    await slice.write(path);
    await slice.close();
    const out = JSON.parse(
      await runGgufPy(
        `
import sys, json
import numpy as np
from gguf import GGUFReader
src, sl = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
f = lambda r, k: r.fields[k].contents()
experts = f(sl, "moeswarm.slice.experts")
st = {t.name: t for t in src.tensors}
equal = []
for t in sl.tensors:
    s = st[t.name]
    per = s.n_bytes // int(s.shape[-1])
    raw_src = np.asarray(src.data[s.data_offset:s.data_offset + s.n_bytes])
    raw = np.asarray(sl.data[t.data_offset:t.data_offset + t.n_bytes])
    want = np.concatenate([raw_src[e * per:(e + 1) * per] for e in experts])
    equal.append([t.name, [int(x) for x in t.shape], bool(np.array_equal(raw, want))])
print(json.dumps({
  "layers": f(sl, "moeswarm.slice.layers"), "experts": experts,
  "types": [int(t) for t in sl.fields["moeswarm.slice.experts"].types],
  "source": f(sl, "moeswarm.slice.source"), "slabs": len(f(sl, "moeswarm.slice.slab_sha256")),
  "expert_count": f(sl, "qwen3moe.expert_count"), "tensors": equal,
}))`,
        [qwen3, path],
      ),
    ) as {
      layers: number[];
      experts: number[];
      types: number[];
      source: string;
      slabs: number;
      expert_count: number;
      tensors: [string, number[], boolean][];
    };
    expect(out.layers).toEqual([0, 1]);
    expect(out.experts).toEqual([0, 3, 4, 7]);
    expect(out.types).toEqual([GgufValueType.ARRAY, GgufValueType.UINT32]);
    expect(out.source).toBe("moeswarm-synthetic-qwen3moe");
    expect(out.slabs).toBe(2 * 3 * 4);
    expect(out.expert_count).toBe(8);
    expect(out.tensors).toHaveLength(6);
    for (const [name, shape, equal] of out.tensors) {
      expect(shape[2], name).toBe(4);
      expect(equal, name).toBe(true);
    }
  });

  it("rejects bad selections with typed errors", async () => {
    const cases: Array<[Parameters<typeof sliceExperts>[1], string, RegExp]> = [
      [{ layers: [0], experts: [8] }, "MOESWARM_INVALID_RANGE", /expert 8 is out of range/],
      [{ layers: [0], experts: { start: 6, end: 9 } }, "MOESWARM_INVALID_RANGE", /invalid range 6:9/],
      [{ layers: [0], experts: { start: 3, end: 3 } }, "MOESWARM_INVALID_RANGE", /invalid range 3:3/],
      [{ layers: [0], experts: [] }, "MOESWARM_INVALID_RANGE", /no expert selected/],
      [{ layers: [], experts: [0] }, "MOESWARM_INVALID_RANGE", /no layer selected/],
      [{ layers: [0], experts: [2, 2] }, "MOESWARM_INVALID_RANGE", /selected twice/],
      [{ layers: [0], experts: [-1] }, "MOESWARM_INVALID_RANGE", /non-negative integers/],
      [{ layers: [2], experts: [0] }, "MOESWARM_INVALID_RANGE", /layer 2 is out of range/],
      [{ layers: [0], experts: "0:2" as never }, "MOESWARM_INVALID_ARGUMENT", /must be a range/],
    ];
    for (const [options, code, message] of cases) {
      const err = await sliceExperts(qwen3, options).catch((e: unknown) => e);
      expect(err, JSON.stringify(options)).toMatchObject({ code });
      expect((err as Error).message).toMatch(message);
    }
    const dense = await sliceExperts(merged, { layers: [0], experts: [0] }).catch((e: unknown) => e);
    expect(dense).toMatchObject({ name: "GgufError", code: "MOESWARM_GGUF_NOT_MOE" });
    expect((dense as Error).message).toMatch(/layer 0 .* has no routed experts/);
    const other = (await loadOrBuildManifest(qwen2)).manifest;
    const wrong = await sliceExperts(qwen3, { layers: [0], experts: [0], manifest: other }).catch(
      (e: unknown) => e,
    );
    expect(wrong).toMatchObject({ code: "MOESWARM_SLICE_MISMATCH" });
  });

  it("honours abort signals before and during streaming", async () => {
    const aborted = await sliceExperts(qwen3, {
      layers: [0],
      experts: [0],
      signal: AbortSignal.abort(),
    }).catch((e: unknown) => e);
    expect(aborted).toMatchObject({ name: "AbortError" });
    const slice: ExpertSlice = await sliceExperts(qwen3, {
      layers: [0, 1],
      experts: { start: 0, end: 8 },
      chunkSize: 1024,
      manifest,
    });
    const controller = new AbortController();
    let n = 0;
    const err = await (async () => {
      for await (const _ of slice.stream({ signal: controller.signal }))
        if (++n === 3) controller.abort(new Error("enough"));
    })().catch((e: unknown) => e);
    expect((err as Error).message).toBe("enough");
    await slice.close();
  });
});

// Manifests: slab sha256s match an independent hash of the source ranges (Python's hashlib over
// gguf-py's tensor offsets), the cache beside the model is reused and invalidated, and
// verifySlice catches any changed byte with the slab it is in.

import { createHash } from "node:crypto";
import { readFileSync, utimesSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  buildManifest,
  GgmlType,
  ggufValue,
  loadOrBuildManifest,
  manifestSlabs,
  parseManifest,
  readGguf,
  SLICE_KEYS,
  type SliceManifest,
  sliceExperts,
  synthesizeMoeModel,
  syntheticPreset,
  verifySlice,
  writeGguf,
} from "../src/index.js";
import { runGgufPy, tensor } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-manifest-");
afterAll(() => tmp.remove());

let model: string;
let manifest: SliceManifest;

async function sliceBytes(path: string, layers: number[], experts: number[]): Promise<Buffer> {
  const slice = await sliceExperts(path, { layers, experts });
  const parts: Uint8Array[] = [];
  for await (const c of slice.stream()) parts.push(c);
  await slice.close();
  return Buffer.concat(parts);
}

beforeAll(async () => {
  model = join(tmp.dir, "model.gguf");
  await synthesizeMoeModel(syntheticPreset("tiny", "qwen2moe"), model);
  manifest = await buildManifest(model);
});

describe("buildManifest", () => {
  it("hashes every expert slab as an independent reader and hasher do", async () => {
    const py = JSON.parse(
      await runGgufPy(
        String.raw`
import sys, json, hashlib, re
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
raw = open(sys.argv[1], "rb").read()
out = {}
for t in r.tensors:
    if not re.match(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.", t.name):
        continue
    n = int(t.shape[-1]); per = t.n_bytes // n; start = int(t.data_offset)
    out[t.name] = {"offset": start, "hashes": [hashlib.sha256(raw[start + e * per:start + (e + 1) * per]).hexdigest() for e in range(n)]}
print(json.dumps({"tensors": out}))`,
        [model],
      ),
    ) as { tensors: Record<string, { offset: number; hashes: string[] }> };
    const names = manifest.layers.flatMap((l) => l.tensors.map((t) => t.name));
    expect(names.sort()).toEqual(Object.keys(py.tensors).sort());
    for (const l of manifest.layers) {
      for (const t of l.tensors) {
        expect(t.offset, t.name).toBe(py.tensors[t.name]!.offset);
        expect(t.sha256, t.name).toEqual(py.tensors[t.name]!.hashes);
      }
    }
    const header = await readGguf(model);
    expect(manifest.source.headerSha256).toBe(
      createHash("sha256").update(readFileSync(model).subarray(0, header.headerSize)).digest("hex"),
    );
    expect(manifest.source).toMatchObject({
      name: "moeswarm-synthetic-qwen2moe",
      arch: "qwen2moe",
      alignment: 32,
    });
    expect(manifest).toMatchObject({ blockCount: 2, expertCount: 8, expertUsedCount: 2 });
    // manifestSlabs walks layer, tensor, expert with byte ranges inside the file.
    const slabs = [...manifestSlabs(manifest)];
    expect(slabs).toHaveLength(2 * 3 * 8);
    expect(slabs[9]).toMatchObject({ layer: 0, expert: 1, tensor: "blk.0.ffn_up_exps.weight" });
    expect(slabs.every((s) => s.end - s.start === (64 * 128 * 34) / 32)).toBe(true);
  });

  it("reports progress, honours abort, and refuses non-MoE files and slices", async () => {
    const seen: number[] = [];
    await buildManifest(model, { chunkSize: 4096, onProgress: (p) => seen.push(p.bytesDone) });
    expect(seen.at(-1)).toBe(manifest.layers.reduce((n, l) => n + l.nExpert * l.bytesPerExpert, 0));
    expect(seen.length).toBeGreaterThan(10);
    const controller = new AbortController();
    const err = await buildManifest(model, {
      chunkSize: 4096,
      signal: controller.signal,
      onProgress: (p) => p.bytesDone > 20_000 && controller.abort(new Error("stop")),
    }).catch((e: unknown) => e);
    expect((err as Error).message).toBe("stop");
    const dense = join(tmp.dir, "dense.gguf");
    await writeGguf(
      {
        metadata: { "general.architecture": ggufValue.str("llama") },
        tensors: [tensor("blk.0.ffn_up.weight", GgmlType.F32, [4, 4], 1)],
      },
      dense,
    );
    await expect(buildManifest(dense)).rejects.toMatchObject({ code: "MOESWARM_GGUF_NOT_MOE" });
    await expect(buildManifest(await sliceBytes(model, [0], [1]))).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
    });
  });
});

describe("loadOrBuildManifest", () => {
  it("caches beside the model and rebuilds when the model or the cache changes", async () => {
    const path = join(tmp.dir, "cached.gguf");
    writeFileSync(path, readFileSync(model));
    const first = await loadOrBuildManifest(path);
    expect(first).toMatchObject({ cached: false, manifestPath: `${path}.manifest.json` });
    expect(first.manifest.layers).toEqual(manifest.layers);
    const second = await loadOrBuildManifest(path);
    expect(second.cached).toBe(true);
    expect(second.manifest).toEqual(first.manifest);
    // A new mtime invalidates it.
    utimesSync(path, new Date(2001, 1, 1), new Date(2001, 1, 1));
    expect((await loadOrBuildManifest(path)).cached).toBe(false);
    expect((await loadOrBuildManifest(path)).cached).toBe(true);
    // So does a corrupt or foreign cache file.
    writeFileSync(`${path}.manifest.json`, "{not json");
    expect((await loadOrBuildManifest(path)).cached).toBe(false);
    const cached = JSON.parse(readFileSync(`${path}.manifest.json`, "utf8")) as SliceManifest;
    writeFileSync(
      `${path}.manifest.json`,
      JSON.stringify({ ...cached, source: { ...cached.source, headerSha256: "0".repeat(64) } }),
    );
    expect((await loadOrBuildManifest(path)).cached).toBe(false);
    // Elsewhere, when asked.
    const other = join(tmp.dir, "elsewhere.json");
    expect(await loadOrBuildManifest(path, { manifestPath: other })).toMatchObject({
      cached: false,
      manifestPath: other,
    });
    expect(parseManifest(JSON.parse(readFileSync(other, "utf8")))).toBeDefined();
  });

  it("parseManifest rejects malformed manifests", () => {
    const good = JSON.parse(JSON.stringify(manifest)) as Record<string, unknown>;
    expect(parseManifest(good)).toBe(good);
    const broken = [
      null,
      { ...good, format: "other" },
      { ...good, source: { ...(good.source as object), headerSha256: "xyz" } },
      {
        ...good,
        layers: [{ layer: 0, nExpert: 8, tensors: [{ ...manifest.layers[0]!.tensors[0]!, sha256: ["00"] }] }],
      },
      {
        ...good,
        layers: [{ layer: 0, nExpert: 8, tensors: [{ ...manifest.layers[0]!.tensors[0]!, slabBytes: 1 }] }],
      },
    ];
    for (const b of broken)
      expect(() => parseManifest(b)).toThrow(expect.objectContaining({ code: "MOESWARM_SLICE_MISMATCH" }));
  });
});

describe("verifySlice", () => {
  it("accepts an intact slice, with or without the manifest", async () => {
    const bytes = await sliceBytes(model, [0, 1], [1, 2, 6]);
    expect(await verifySlice(bytes, manifest)).toEqual({
      source: "moeswarm-synthetic-qwen2moe",
      layers: [0, 1],
      experts: [1, 2, 6],
      slabs: 18,
      bytes: 18 * 8704,
    });
    const path = join(tmp.dir, "ok-slice.gguf");
    writeFileSync(path, bytes);
    expect((await verifySlice(path)).slabs).toBe(18);
  });

  it("names the first bad slab when a byte is flipped", async () => {
    const bytes = await sliceBytes(model, [0, 1], [1, 2, 6]);
    const header = await readGguf(bytes);
    const t = header.tensors.find((x) => x.name === "blk.1.ffn_up_exps.weight")!;
    const slab = Number(t.nbytes) / 3;
    const flipped = Buffer.from(bytes);
    flipped[Number(t.absoluteOffset) + slab * 2 + 100]! ^= 0x40;
    for (const against of [manifest, undefined]) {
      const err = await verifySlice(flipped, against).catch((e: unknown) => e);
      expect(err).toMatchObject({
        name: "GgufError",
        code: "MOESWARM_SLICE_MISMATCH",
        details: {
          layer: 1,
          expert: 6,
          tensor: "blk.1.ffn_up_exps.weight",
          offset: String(Number(t.absoluteOffset) + 2 * slab),
          against: against ? "manifest" : "slice",
        },
      });
    }
    // A slice that agrees with itself but not with the model's manifest.
    const other = join(tmp.dir, "other.gguf");
    await synthesizeMoeModel({ ...syntheticPreset("tiny", "qwen2moe"), seed: 99 }, other);
    const foreign = await sliceBytes(other, [0], [1]);
    expect((await verifySlice(foreign)).slabs).toBe(3);
    await expect(verifySlice(foreign, manifest)).rejects.toMatchObject({
      code: "MOESWARM_SLICE_MISMATCH",
      message: expect.stringMatching(/cut from another model/),
    });
  });

  it("rejects files that are not intact slices", async () => {
    await expect(verifySlice(model, manifest)).rejects.toMatchObject({
      code: "MOESWARM_SLICE_MISMATCH",
      message: expect.stringMatching(/not a slice/),
    });
    // Slab hashes that do not cover the slabs.
    const bytes = await sliceBytes(model, [0], [1, 2]);
    const header = await readGguf(bytes);
    const md = new Map(header.metadata);
    md.set(SLICE_KEYS.slabSha256, ggufValue.str("x") as never);
    const path = join(tmp.dir, "no-hashes.gguf");
    const data = Buffer.from(bytes);
    await writeGguf(
      {
        metadata: md,
        tensors: header.tensors.map((t) => ({
          name: t.name,
          type: t.type,
          shape: t.shape,
          data: data.subarray(Number(t.absoluteOffset), Number(t.absoluteOffset + t.nbytes)),
        })),
      },
      path,
    );
    await expect(verifySlice(path)).rejects.toMatchObject({
      code: "MOESWARM_SLICE_MISMATCH",
      message: expect.stringMatching(/slab_sha256/),
    });
  });
});

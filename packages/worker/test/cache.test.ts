// The worker's slice cache under a size limit: what pruneSliceCache deletes to make room, in which
// order, and what it never deletes; and a slice file put there by cacheSlice.

import { existsSync, mkdirSync, readFileSync, statSync, utimesSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { InvalidArgumentError } from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import {
  type CachedSliceMeta,
  cacheSlice,
  listCachedSlices,
  pruneSliceCache,
  slicePaths,
  touchSlice,
} from "../src/slice-cache.js";

const tmp = tempDir("moeswarm-cache-");
afterAll(() => tmp.remove());

let n = 0;
/** A cache directory with complete slices of the given sizes and use times, and optional partials. */
function cacheWith(
  slices: Array<{ model: string; layers: [number, number]; bytes: number; savedAt: number; usedAt?: number }>,
  partials: Array<{ model: string; layers: [number, number]; bytes: number; mtime: number }> = [],
): string {
  const dir = join(tmp.dir, `c${n++}`);
  for (const s of slices) {
    const p = slicePaths(dir, s.model, { start: s.layers[0], end: s.layers[1] }, { start: 0, end: 8 });
    mkdirSync(p.dir, { recursive: true });
    writeFileSync(p.path, Buffer.alloc(s.bytes, 1));
    const meta: CachedSliceMeta = {
      model: s.model,
      layers: `${s.layers[0]}:${s.layers[1]}`,
      experts: "0:8",
      fileBytes: s.bytes,
      savedAt: s.savedAt,
      ...(s.usedAt !== undefined ? { usedAt: s.usedAt } : {}),
    };
    writeFileSync(p.metaPath, JSON.stringify(meta));
  }
  for (const q of partials) {
    const p = slicePaths(dir, q.model, { start: q.layers[0], end: q.layers[1] }, { start: 0, end: 8 });
    mkdirSync(p.dir, { recursive: true });
    writeFileSync(`${p.path}.part`, Buffer.alloc(q.bytes, 2));
    writeFileSync(`${p.path}.part.json`, "{}");
    utimesSync(`${p.path}.part`, q.mtime / 1000, q.mtime / 1000);
  }
  return dir;
}

const path = (dir: string, model: string, l0: number, l1: number) =>
  slicePaths(dir, model, { start: l0, end: l1 }, { start: 0, end: 8 }).path;

describe("pruneSliceCache", () => {
  it("deletes abandoned partials first, then the least recently used slices, until the download fits", async () => {
    const dir = cacheWith(
      [
        { model: "m", layers: [0, 1], bytes: 1000, savedAt: 1000, usedAt: 5000 }, // reused lately
        { model: "m", layers: [1, 2], bytes: 1000, savedAt: 2000 }, // least recently used
        { model: "other", layers: [0, 1], bytes: 1000, savedAt: 3000 },
        { model: "m", layers: [2, 3], bytes: 1000, savedAt: 500 }, // oldest, but being served
      ],
      [{ model: "m", layers: [5, 6], bytes: 300, mtime: 9000 }],
    );
    const served = path(dir, "m", 2, 3);
    const incoming = path(dir, "m", 7, 8);
    // 4300 bytes held; room for 1500 more under 4000 means 1800 must go: the partial, then two slices
    const r = await pruneSliceCache(dir, {
      maxBytes: 4000,
      incomingBytes: 1500,
      keep: new Set([served, incoming]),
    });
    expect(r.removed.map((x) => [x.kind, x.path])).toEqual([
      ["partial", `${path(dir, "m", 5, 6)}.part`],
      ["slice", path(dir, "m", 1, 2)],
      ["slice", path(dir, "other", 0, 1)],
    ]);
    expect(r.removed.map((x) => x.bytes)).toEqual([300, 1000, 1000]);
    expect(r).toMatchObject({ bytes: 2000, fits: true });
    expect(existsSync(`${path(dir, "m", 5, 6)}.part.json`)).toBe(false);
    expect((await listCachedSlices(dir)).map((c) => c.path).sort()).toEqual(
      [path(dir, "m", 0, 1), served].sort(),
    );
  });

  it("never deletes what it must keep, and says when that alone is over the limit", async () => {
    const dir = cacheWith([
      { model: "m", layers: [0, 1], bytes: 3000, savedAt: 1 },
      { model: "m", layers: [1, 2], bytes: 500, savedAt: 2 },
    ]);
    const keep = new Set([path(dir, "m", 0, 1)]);
    const r = await pruneSliceCache(dir, { maxBytes: 3200, incomingBytes: 1000, keep });
    expect(r.removed.map((x) => x.path)).toEqual([path(dir, "m", 1, 2)]);
    expect(r).toMatchObject({ bytes: 3000, fits: false });
    expect(existsSync(path(dir, "m", 0, 1))).toBe(true);
  });

  it("deletes nothing when the download fits, and keeps the .part being resumed", async () => {
    const dir = cacheWith(
      [{ model: "m", layers: [0, 1], bytes: 100, savedAt: 1 }],
      [{ model: "m", layers: [3, 4], bytes: 100, mtime: 1 }],
    );
    const resumed = path(dir, "m", 3, 4);
    const r = await pruneSliceCache(dir, { maxBytes: 10_000, incomingBytes: 5000, keep: new Set([resumed]) });
    expect(r).toEqual({ removed: [], bytes: 100, fits: true });
    const tight = await pruneSliceCache(dir, { maxBytes: 150, incomingBytes: 100, keep: new Set([resumed]) });
    expect(tight.removed.map((x) => x.path)).toEqual([path(dir, "m", 0, 1)]);
    expect(existsSync(`${resumed}.part`)).toBe(true);
  });

  it("a reuse (touchSlice) moves a slice to the back of the line", async () => {
    const dir = cacheWith([
      { model: "m", layers: [0, 1], bytes: 100, savedAt: 1000 },
      { model: "m", layers: [1, 2], bytes: 100, savedAt: 2000 },
    ]);
    const older = slicePaths(dir, "m", { start: 0, end: 1 }, { start: 0, end: 8 });
    await touchSlice(older);
    expect((JSON.parse(readFileSync(older.metaPath, "utf8")) as CachedSliceMeta).usedAt).toBeGreaterThan(
      2000,
    );
    const r = await pruneSliceCache(dir, { maxBytes: 150, incomingBytes: 50, keep: new Set() });
    expect(r.removed.map((x) => x.path)).toEqual([path(dir, "m", 1, 2)]);
  });
});

describe("cacheSlice", () => {
  it("puts a file into the cache as a finished download leaves it, linked rather than copied", async () => {
    const dir = join(tmp.dir, `c${n++}`);
    const file = join(tmp.dir, "cut.gguf");
    writeFileSync(file, Buffer.alloc(1000, 7));
    const cached = await cacheSlice(dir, {
      model: "m",
      layers: { start: 2, end: 4 },
      experts: { start: 32, end: 64 },
      file,
    });
    expect(cached.path).toBe(path(dir, "m", 2, 4).replace("0-8", "32-64"));
    // the worker's own listing finds it, with its ranges and size
    const listed = await listCachedSlices(dir, "m");
    expect(listed.map((c) => [c.layers, c.experts, c.meta.fileBytes])).toEqual([
      [{ start: 2, end: 4 }, { start: 32, end: 64 }, 1000],
    ]);
    expect(statSync(cached.path).ino).toBe(statSync(file).ino);
    // cached again over itself: still one slice, the same bytes
    await cacheSlice(dir, {
      model: "m",
      layers: { start: 2, end: 4 },
      experts: { start: 32, end: 64 },
      file,
    });
    expect(await listCachedSlices(dir, "m")).toHaveLength(1);
    expect(readFileSync(cached.path)).toEqual(readFileSync(file));
  });

  it("refuses a model id that cannot name a directory, and empty or reversed ranges", async () => {
    const dir = join(tmp.dir, `c${n++}`);
    const ok = { model: "m", layers: { start: 0, end: 1 }, experts: { start: 0, end: 8 }, file: "x" };
    await expect(cacheSlice(dir, { ...ok, model: "../up" })).rejects.toThrow(InvalidArgumentError);
    await expect(cacheSlice(dir, { ...ok, layers: { start: 1, end: 1 } })).rejects.toThrow(/layers/);
    await expect(cacheSlice(dir, { ...ok, experts: { start: 4, end: 2 } })).rejects.toThrow(/experts/);
    expect(existsSync(dir)).toBe(false);
  });
});

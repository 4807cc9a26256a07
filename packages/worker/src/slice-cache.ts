import { copyFile, link, mkdir, readdir, readFile, rm, stat, writeFile } from "node:fs/promises";
import { dirname, join } from "node:path";
import { InvalidArgumentError, type Range } from "@moeswarm/core";

/*
 * Slices a worker downloaded, kept across restarts:
 *   <cacheDir>/<model>/<l0>-<l1>_<e0>-<e1>.gguf   the slice (half-open layer and expert ranges;
 *                                                 "-" rather than ":", which some file systems refuse)
 *   <cacheDir>/<model>/<l0>-<l1>_<e0>-<e1>.json   what it is and the lease it was downloaded under
 * A slice is written there only after its download completed (downloads go to `.part`), and is
 * re-verified against the hub's manifest before every reuse.
 */

/** Model ids the hub accepts; the only ones used as a directory name. */
const MODEL_ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
const FILE = /^(\d{1,9})-(\d{1,9})_(\d{1,9})-(\d{1,9})\.json$/;

export interface CachedSliceMeta {
  model: string;
  /** "a:b" */
  layers: string;
  /** "a:b" */
  experts: string;
  /** Size of the slice file. */
  fileBytes: number;
  /** The download's ETag. */
  etag?: string | undefined;
  /** The source model's header sha256 (the manifest's), checked before reuse. */
  sourceSha256?: string | undefined;
  /** Unix ms when it was downloaded and verified. */
  savedAt: number;
  /** Unix ms when a run last reused it (the cache prunes the least recently used first). */
  usedAt?: number | undefined;
  /** The lease it was downloaded under (informative). */
  lease?: { leaseId: string; expiresAt: number; hub: string } | undefined;
}

export interface CachedSlice {
  model: string;
  layers: Range;
  experts: Range;
  path: string;
  metaPath: string;
  meta: CachedSliceMeta;
}

export interface SlicePaths {
  dir: string;
  path: string;
  metaPath: string;
}

export function checkModelId(model: string): string {
  if (typeof model !== "string" || !MODEL_ID.test(model)) {
    throw new InvalidArgumentError(`model id ${JSON.stringify(model)} cannot name a cache directory`);
  }
  return model;
}

export function slicePaths(cacheDir: string, model: string, layers: Range, experts: Range): SlicePaths {
  const dir = join(cacheDir, checkModelId(model));
  const base = `${layers.start}-${layers.end}_${experts.start}-${experts.end}`;
  return { dir, path: join(dir, `${base}.gguf`), metaPath: join(dir, `${base}.json`) };
}

export async function writeSliceMeta(paths: SlicePaths, meta: CachedSliceMeta): Promise<void> {
  await mkdir(paths.dir, { recursive: true });
  await writeFile(paths.metaPath, `${JSON.stringify(meta, null, 2)}\n`);
}

export async function removeSlice(paths: SlicePaths): Promise<void> {
  await rm(paths.path, { force: true });
  await rm(paths.metaPath, { force: true });
  await rm(`${paths.path}.part`, { force: true });
  await rm(`${paths.path}.part.json`, { force: true });
}

/**
 * Puts a slice file that is already on this machine (cut with `moeswarm-shard slice`, or copied
 * from another machine) into a worker's cache, as a finished download leaves one: the worker
 * then claims it before anything else, as it does a slice it downloaded in an earlier run, and
 * serves it only after checking it against the hub's manifest (a file that does not match is
 * deleted and downloaded again). Hard-linked where the file system allows, copied otherwise.
 * `layers` and `experts` are the half-open ranges the file holds. Returns the cached slice.
 */
export async function cacheSlice(
  cacheDir: string,
  o: { model: string; layers: Range; experts: Range; file: string },
): Promise<CachedSlice> {
  for (const [what, r] of [
    ["layers", o.layers],
    ["experts", o.experts],
  ] as const) {
    if (!Number.isInteger(r.start) || !Number.isInteger(r.end) || r.start < 0 || r.end <= r.start) {
      throw new InvalidArgumentError(
        `${what} must be a half-open range of integers start < end, got ${JSON.stringify(r)}`,
      );
    }
  }
  const paths = slicePaths(cacheDir, o.model, o.layers, o.experts);
  await mkdir(paths.dir, { recursive: true });
  await rm(paths.path, { force: true });
  await link(o.file, paths.path).catch(() => copyFile(o.file, paths.path));
  const meta: CachedSliceMeta = {
    model: o.model,
    layers: `${o.layers.start}:${o.layers.end}`,
    experts: `${o.experts.start}:${o.experts.end}`,
    fileBytes: (await stat(paths.path)).size,
    savedAt: Date.now(),
  };
  await writeSliceMeta(paths, meta);
  return {
    model: o.model,
    layers: o.layers,
    experts: o.experts,
    path: paths.path,
    metaPath: paths.metaPath,
    meta,
  };
}

/** The model directories of the cache (or the one of `model`) and the names in each; unreadable ones skipped. */
async function modelDirs(cacheDir: string, model?: string): Promise<Array<[string, string[]]>> {
  let models: string[];
  try {
    models = model === undefined ? await readdir(cacheDir) : [model];
  } catch {
    return [];
  }
  const out: Array<[string, string[]]> = [];
  for (const m of models) {
    if (!MODEL_ID.test(m)) continue;
    try {
      out.push([m, await readdir(join(cacheDir, m))]);
    } catch {
      // not a directory, or gone meanwhile
    }
  }
  return out;
}

/** Complete slices in the cache, newest first (a slice whose file is missing or of another size is skipped). */
export async function listCachedSlices(cacheDir: string, model?: string): Promise<CachedSlice[]> {
  const out: CachedSlice[] = [];
  for (const [m, names] of await modelDirs(cacheDir, model)) {
    for (const name of names) {
      const f = FILE.exec(name);
      if (!f) continue;
      const layers = { start: Number(f[1]), end: Number(f[2]) };
      const experts = { start: Number(f[3]), end: Number(f[4]) };
      if (layers.end <= layers.start || experts.end <= experts.start) continue;
      const paths = slicePaths(cacheDir, m, layers, experts);
      try {
        const meta = JSON.parse(await readFile(paths.metaPath, "utf8")) as CachedSliceMeta;
        const size = (await stat(paths.path)).size;
        if (meta.model !== m || meta.fileBytes !== size || typeof meta.savedAt !== "number") continue;
        out.push({ model: m, layers, experts, path: paths.path, metaPath: paths.metaPath, meta });
      } catch {
        // no slice file or unreadable metadata: not reusable
      }
    }
  }
  return out.sort((a, b) => b.meta.savedAt - a.meta.savedAt);
}

/** A cached slice or abandoned partial download that {@link pruneSliceCache} deleted. */
export interface PrunedSlice {
  path: string;
  bytes: number;
  /** "slice": a complete slice; "partial": a `.part` download no run is resuming. */
  kind: "slice" | "partial";
  model: string;
}

export interface PruneOptions {
  /** Bytes the cache may hold once `incomingBytes` more are written. */
  maxBytes: number;
  /** Bytes about to be downloaded into the cache. */
  incomingBytes: number;
  /** Slice paths (`.gguf`) never to delete: the ones served, the one being downloaded (and its `.part`). */
  keep: ReadonlySet<string>;
}

export interface PruneResult {
  removed: PrunedSlice[];
  /** Bytes in the cache after pruning, before the incoming download. */
  bytes: number;
  /** Whether `bytes + incomingBytes <= maxBytes` now (false: what must be kept is already too much). */
  fits: boolean;
}

/**
 * Makes room for a download: deletes abandoned partial downloads first (oldest first), then
 * complete slices by least recent use (`usedAt`, else `savedAt`), never one in `keep`, until the
 * cache plus `incomingBytes` fits `maxBytes`. Files it cannot read or delete are left alone.
 */
export async function pruneSliceCache(cacheDir: string, options: PruneOptions): Promise<PruneResult> {
  const { maxBytes, incomingBytes, keep } = options;
  interface Entry extends PrunedSlice {
    at: number;
    remove(): Promise<void>;
  }
  const entries: Entry[] = [];
  for (const [m, names] of await modelDirs(cacheDir)) {
    for (const name of names) {
      if (!name.endsWith(".gguf.part")) continue;
      const path = join(cacheDir, m, name);
      const slicePath = path.slice(0, -".part".length);
      if (keep.has(slicePath)) continue;
      try {
        const st = await stat(path);
        entries.push({
          path,
          bytes: st.size,
          kind: "partial",
          model: m,
          at: st.mtimeMs,
          remove: async () => {
            await rm(path, { force: true });
            await rm(`${path}.json`, { force: true });
          },
        });
      } catch {
        // gone meanwhile
      }
    }
  }
  let kept = 0;
  for (const c of await listCachedSlices(cacheDir)) {
    if (keep.has(c.path)) {
      kept += c.meta.fileBytes;
      continue;
    }
    entries.push({
      path: c.path,
      bytes: c.meta.fileBytes,
      kind: "slice",
      model: c.model,
      at: c.meta.usedAt ?? c.meta.savedAt,
      remove: () => removeSlice({ dir: dirname(c.path), path: c.path, metaPath: c.metaPath }),
    });
  }
  // partial downloads go first, then the least recently used slices
  entries.sort((a, b) => (a.kind === b.kind ? a.at - b.at : a.kind === "partial" ? -1 : 1));
  let total = kept + entries.reduce((n, e) => n + e.bytes, 0);
  const removed: PrunedSlice[] = [];
  for (const e of entries) {
    if (total + incomingBytes <= maxBytes) break;
    try {
      await e.remove();
    } catch {
      continue;
    }
    total -= e.bytes;
    removed.push({ path: e.path, bytes: e.bytes, kind: e.kind, model: e.model });
  }
  return { removed, bytes: total, fits: total + incomingBytes <= maxBytes };
}

/** Records that a run reused a cached slice now (for {@link pruneSliceCache}'s order). */
export async function touchSlice(paths: SlicePaths): Promise<void> {
  try {
    const meta = JSON.parse(await readFile(paths.metaPath, "utf8")) as CachedSliceMeta;
    await writeFile(paths.metaPath, `${JSON.stringify({ ...meta, usedAt: Date.now() }, null, 2)}\n`);
  } catch {
    // metadata unreadable: the slice is pruned by its file order, no harm
  }
}

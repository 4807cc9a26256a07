import { mkdir } from "node:fs/promises";
import { GgufError, type LeaseJson } from "@moeswarm/core";
import { type SliceManifest, verifySlice } from "@moeswarm/shard";
import { type DownloadResult, downloadResumable } from "./download.js";
import type { WorkerEventBody } from "./events.js";
import type { LeaseKeeper } from "./lease-keeper.js";
import { manifestOf } from "./manifest.js";
import type { Settings } from "./options.js";
import { pruneSliceCache, removeSlice, type SlicePaths, touchSlice, writeSliceMeta } from "./slice-cache.js";

// Putting a leased slice on disk, verified: the cached copy when it proves good, else a download
// (resumed, retried) checked slab by slab against the model's manifest, a few times at most.

/** Thrown while fetching when the lease went away (the hub forgot it): claim again. */
export class LeaseLost extends Error {}

/** What fetching needs from the run. */
export interface FetchContext {
  readonly s: Settings;
  emit(body: WorkerEventBody): void;
  /** The run's stop signal. */
  readonly stop: AbortSignal;
  /** The slice files being served: never pruned from the cache. */
  servedPaths(): string[];
  /** Told of each finished download: the bytes it fetched (not reused) and their rate. */
  downloaded(freshBytes: number, bytesPerSecond: number): void;
}

function slabOf(error: GgufError): { layer?: number; expert?: number; tensor?: string } {
  const d = error.details ?? {};
  return {
    ...(typeof d.layer === "number" ? { layer: d.layer } : {}),
    ...(typeof d.expert === "number" ? { expert: d.expert } : {}),
    ...(typeof d.tensor === "string" ? { tensor: d.tensor } : {}),
  };
}

/** Puts the leased slice on disk, verified; true when a cached copy was reused. */
export async function fetchSlice(
  ctx: FetchContext,
  lease: LeaseJson,
  keeper: LeaseKeeper,
  paths: SlicePaths,
  cached: boolean,
): Promise<boolean> {
  const signal = AbortSignal.any([ctx.stop, keeper.signal]);
  // a failure while the lease is gone (and the run not stopped) means: claim again
  const lost = () => {
    if (keeper.signal.aborted && !ctx.stop.aborted) throw new LeaseLost();
  };
  const guarded = async <T>(run: () => Promise<T>): Promise<T> => {
    try {
      return await run();
    } catch (error) {
      lost();
      throw error;
    }
  };
  const manifest = await guarded(() => manifestOf(ctx.s.hub, lease.manifest, signal));
  if (cached && (await reuseCached(ctx, manifest, paths, signal, lost))) return true;
  await mkdir(paths.dir, { recursive: true });
  await makeRoom(ctx, lease, paths);
  for (let attempt = 1; ; attempt++) {
    const url = ctx.s.hub.resolve(lease.url);
    const result = await guarded(() => download(ctx, url, paths, signal));
    try {
      await verify(ctx, manifest, paths, signal, false);
      await writeSliceMeta(paths, {
        model: lease.model,
        layers: lease.layers,
        experts: lease.experts,
        fileBytes: result.bytes,
        etag: result.etag,
        sourceSha256: manifest.source.headerSha256,
        savedAt: Date.now(),
        lease: { leaseId: lease.leaseId, expiresAt: keeper.lease.expiresAt, hub: ctx.s.hub.base.href },
      });
      return false;
    } catch (error) {
      lost();
      if (!(error instanceof GgufError)) throw error;
      await corrupt(ctx, error, paths, attempt, false);
      if (attempt >= ctx.s.maxVerifyAttempts) {
        throw new GgufError(
          "MOESWARM_SLICE_MISMATCH",
          `the slice failed verification ${attempt} times (last: ${error.message})`,
          { cause: error, details: { ...error.details, url: url.href, attempts: attempt } },
        );
      }
    }
  }
}

/** Verifies the cached copy; false (and the copy deleted) when it does not prove good. */
async function reuseCached(
  ctx: FetchContext,
  manifest: SliceManifest,
  paths: SlicePaths,
  signal: AbortSignal,
  lost: () => void,
): Promise<boolean> {
  try {
    await verify(ctx, manifest, paths, signal, true);
    await touchSlice(paths);
    return true;
  } catch (error) {
    lost();
    if (!(error instanceof GgufError)) throw error;
    await corrupt(ctx, error, paths, 0, true);
    return false;
  }
}

async function corrupt(
  ctx: FetchContext,
  error: GgufError,
  paths: SlicePaths,
  attempt: number,
  reused: boolean,
): Promise<void> {
  ctx.emit({
    event: "corrupt",
    error: error.message,
    ...slabOf(error),
    attempt,
    maxAttempts: ctx.s.maxVerifyAttempts,
    reused,
  });
  await removeSlice(paths);
}

/** With `cacheMaxBytes`, deletes what the cache can spare so the download fits. */
async function makeRoom(ctx: FetchContext, lease: LeaseJson, paths: SlicePaths): Promise<void> {
  const { s } = ctx;
  if (s.cacheMaxBytes === undefined) return;
  const keep = new Set(ctx.servedPaths());
  keep.add(paths.path);
  const pruned = await pruneSliceCache(s.cacheDir, {
    maxBytes: s.cacheMaxBytes,
    incomingBytes: lease.bytes,
    keep,
  });
  if (pruned.removed.length > 0 || !pruned.fits) {
    ctx.emit({
      event: "cache-pruned",
      removed: pruned.removed,
      cacheBytes: pruned.bytes,
      incomingBytes: lease.bytes,
      maxBytes: s.cacheMaxBytes,
      fits: pruned.fits,
    });
  }
}

/** One download of the slice (resumed and retried inside), its progress as events. */
async function download(
  ctx: FetchContext,
  url: URL,
  paths: SlicePaths,
  signal: AbortSignal,
): Promise<DownloadResult> {
  const { s } = ctx;
  let lastProgress = 0;
  let started = false;
  const t0 = performance.now();
  const result = await downloadResumable(url, paths.path, {
    signal,
    client: s.hub,
    headers: await s.hub.authHeader(),
    ...s.download,
    onResponse: ({ offset, total }) => {
      if (started) return;
      started = true;
      ctx.emit({ event: "download-start", url: url.href, bytes: total, resumeFrom: offset });
    },
    onProgress: ({ received, total }) => {
      const now = performance.now();
      if (now - lastProgress < s.progressIntervalMs && received !== total) return;
      lastProgress = now;
      const secs = (now - t0) / 1000;
      ctx.emit({
        event: "progress",
        received,
        total,
        bytesPerSecond: secs > 0 ? Math.round(received / secs) : 0,
      });
    },
    onRetry: ({ attempt, error, delayMs, received }) =>
      ctx.emit({
        event: "download-retry",
        attempt,
        error: error.message,
        code: error.code,
        delayMs,
        received,
      }),
  });
  const fresh = result.bytes - result.reusedBytes;
  const bps = result.ms > 0 ? (fresh * 1000) / result.ms : 0;
  ctx.downloaded(fresh, bps);
  ctx.emit({
    event: "downloaded",
    bytes: result.bytes,
    ms: result.ms,
    bytesPerSecond: Math.round(bps),
    requests: result.requests,
    resumes: result.resumes,
  });
  return result;
}

async function verify(
  ctx: FetchContext,
  manifest: SliceManifest,
  paths: SlicePaths,
  signal: AbortSignal,
  reused: boolean,
): Promise<void> {
  const t0 = performance.now();
  const v = await verifySlice(paths.path, manifest, { signal });
  ctx.emit({ event: "verified", slabs: v.slabs, bytes: v.bytes, ms: performance.now() - t0, reused });
}

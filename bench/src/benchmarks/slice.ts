import { spawnSync } from "node:child_process";
import { open } from "node:fs/promises";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import {
  type ByteSource,
  buildManifest,
  type ExpertSlice,
  ensureSyntheticModel,
  fileSource,
  findExpertTensors,
  loadOrBuildManifest,
  readGguf,
  type SliceManifest,
  sliceExperts,
} from "@moeswarm/shard";
import {
  type Benchmark,
  gbPerSecond,
  interleaved,
  measure,
  median,
  pairedRatio,
  type Row,
} from "../harness.js";

// Slicing layer 0 x all 64 experts of the `medium` synthetic qwen3moe (~460 MB, Q8_0 experts)
// against reading the same byte ranges of the same file in the same run, page cache warm:
// `dd` (what `cat` of those ranges costs, process start included) and Node's fs reads in 8 MiB
// chunks (what the slicer does underneath). The figure is slice GB/s / fs GB/s: 1.0 means the
// slice costs nothing beyond reading its bytes.

const CACHE_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", ".cache", "models");
const CHUNK = 8 * 1024 * 1024;

async function drain(chunks: AsyncIterable<Uint8Array>): Promise<number> {
  let n = 0;
  for await (const c of chunks) n += c.byteLength;
  return n;
}

/** RSS before `fn` and its peak while `fn` runs (sampled every 5 ms and at the end). */
async function peakRss<T>(fn: () => Promise<T>): Promise<{ value: T; before: number; peak: number }> {
  global.gc?.();
  const before = process.memoryUsage.rss();
  let peak = before;
  const timer = setInterval(() => {
    peak = Math.max(peak, process.memoryUsage.rss());
  }, 5);
  try {
    const value = await fn();
    peak = Math.max(peak, process.memoryUsage.rss());
    return { value, before, peak };
  } finally {
    clearInterval(timer);
  }
}

const MB = 1024 * 1024;

/** Manifest of the whole model: one streamed pass over every expert byte (cached, then fresh). */
async function measureManifest(path: string) {
  const manifestRun = await peakRss(() => loadOrBuildManifest(path, { writeCache: true }));
  const manifest = manifestRun.value.manifest;
  const freshManifest = await peakRss(async () => {
    const started = performance.now();
    const m = await buildManifest(path);
    return { m, seconds: (performance.now() - started) / 1000 };
  });
  const expertBytes = manifest.layers.reduce((n, l) => n + l.nExpert * l.bytesPerExpert, 0);
  const row: Row = {
    case: "manifest (all layers)",
    MiB: +(expertBytes / MB).toFixed(1),
    "GB/s": +gbPerSecond(expertBytes, freshManifest.value.seconds * 1e9).toFixed(3),
    "peak RSS delta MiB": +((freshManifest.peak - freshManifest.before) / MB).toFixed(1),
  };
  return { manifestRun, freshManifest, row };
}

/**
 * `dd` of the ranges, and `sh -c true` alone (what starting the processes costs). dd runs in a
 * block of its own, first: forking this process write-protects its memory (copy-on-write), and
 * the page faults that follow would slow whatever runs next in it.
 */
async function measureDd(path: string, ranges: readonly { start: number; length: number }[]) {
  const ddScript = ranges
    .map((r) => `dd if="$1" iflag=skip_bytes,count_bytes skip=${r.start} count=${r.length} bs=8M status=none`)
    .join("; ");
  const ddTimes = await interleaved(
    [
      [
        "dd of the ranges",
        async () => {
          const res = spawnSync("sh", ["-c", ddScript, "sh", path], {
            stdio: ["ignore", "ignore", "pipe"],
          });
          if (res.status !== 0) throw new Error(`dd failed: ${res.stderr}`);
        },
      ],
    ],
    { minTimeMs: 2000, minRounds: 9 },
  );
  const spawnOnly = await measure(
    "sh -c true",
    () => {
      spawnSync("sh", ["-c", "true"]);
    },
    { minTimeMs: 500, minSamples: 5 },
  );
  return { ddTimes, spawnOnly };
}

/**
 * Peak RSS while streaming the one-layer slice, then every layer x every expert (8x the bytes):
 * memory does not grow with the slice. Closes the slices and the source.
 */
async function measureStreamRss(
  src: ByteSource,
  sliceWith: ExpertSlice,
  nExpert: number,
  manifest: SliceManifest,
): Promise<{ rssRows: Row[]; rssAll: { before: number; peak: number } }> {
  const rssRun = await peakRss(() => drain(sliceWith.stream()));
  const all = await sliceExperts(src, {
    layers: { start: 0, end: manifest.layers.length },
    experts: { start: 0, end: nExpert },
    manifest,
  });
  const rssAll = await peakRss(() => drain(all.stream()));
  await sliceWith.close();
  await all.close();
  await src.close();
  const rssRows: Row[] = [
    {
      case: "stream RSS: 1 layer",
      MiB: +(sliceWith.length / MB).toFixed(1),
      "peak RSS delta MiB": +((rssRun.peak - rssRun.before) / MB).toFixed(1),
    },
    {
      case: `stream RSS: ${manifest.layers.length} layers`,
      MiB: +(all.length / MB).toFixed(1),
      "peak RSS delta MiB": +((rssAll.peak - rssAll.before) / MB).toFixed(1),
    },
  ];
  return { rssRows, rssAll };
}

export const slice: Benchmark = {
  name: "slice",
  description:
    "slice 1 layer x all experts of the medium synthetic model vs dd / fs reads of the same byte ranges",
  async run() {
    const rows: Row[] = [];
    const notes: string[] = [];
    const t0 = performance.now();
    const model = await ensureSyntheticModel("medium", { cacheDir: CACHE_DIR });
    const genSeconds = (performance.now() - t0) / 1000;
    notes.push(
      `model ${model.path} (${(model.size / MB).toFixed(1)} MiB) ${model.created ? `generated in ${genSeconds.toFixed(1)} s` : "reused from the cache"}`,
    );

    const header = await readGguf(model.path);
    const layer = findExpertTensors(header).layers[0]!;
    const ranges = layer.tensors.map((t) => ({
      start: Number(t.info.absoluteOffset),
      length: Number(t.info.nbytes),
    }));
    const bytes = ranges.reduce((n, r) => n + r.length, 0);

    const { manifestRun, freshManifest, row: manifestRow } = await measureManifest(model.path);
    const manifest = manifestRun.value.manifest;
    rows.push(manifestRow);

    // Warm the page cache for the ranges.
    const src = await fileSource(model.path);
    for (const r of ranges) {
      for (let p = 0; p < r.length; p += CHUNK) await src.read(r.start + p, Math.min(CHUNK, r.length - p));
    }

    const sliceWith = await sliceExperts(src, {
      layers: [layer.layer],
      experts: { start: 0, end: layer.nExpert },
      manifest,
    });
    if (sliceWith.length < bytes) throw new Error("slice shorter than its slabs");
    const handle = await open(model.path, "r");
    const cases: Array<[string, () => Promise<unknown>]> = [
      ["slice (manifest)", () => drain(sliceWith.stream())],
      [
        "slice (no manifest: hash, then stream)",
        async () => {
          const s = await sliceExperts(src, {
            layers: [layer.layer],
            experts: { start: 0, end: layer.nExpert },
          });
          await drain(s.stream());
        },
      ],
      [
        "fs read 8 MiB chunks",
        async () => {
          for (const r of ranges) {
            for (let p = 0; p < r.length; p += CHUNK) {
              const n = Math.min(CHUNK, r.length - p);
              await handle.read(new Uint8Array(n), 0, n, r.start + p);
            }
          }
        },
      ],
    ];
    const { ddTimes, spawnOnly } = await measureDd(model.path, ranges);
    const times = [...(await interleaved(cases, { minTimeMs: 6000, minRounds: 15 })), ...ddTimes];
    await handle.close();
    const [sliced, sliceHashing, fsRead, dd] = times.map((t) => t.samples) as [
      number[],
      number[],
      number[],
      number[],
    ];

    const { rssRows, rssAll } = await measureStreamRss(src, sliceWith, layer.nExpert, manifest);

    times.forEach(({ label, samples }) => {
      rows.push({
        case: label,
        MiB: +(bytes / MB).toFixed(1),
        "median ms": +(median(samples) / 1e6).toFixed(2),
        "min ms": +(Math.min(...samples) / 1e6).toFixed(2),
        "GB/s": +gbPerSecond(bytes, median(samples)).toFixed(3),
      });
    });
    rows.push(...rssRows);
    notes.push(
      `dd includes starting sh and ${ranges.length} dd processes (sh -c true alone: ${(spawnOnly.medianNs / 1e6).toFixed(1)} ms)`,
      `${times[0]!.samples.length} interleaved rounds of the in-process cases (dd measured before them); on a loaded machine the min column is the steadier figure`,
      `manifest: built in ${freshManifest.value.seconds.toFixed(2)} s; the cached load took the ${manifestRun.value.cached ? "cache" : "build"} path`,
      `process RSS: ${(rssAll.before / MB).toFixed(0)} MiB before streaming the whole expert set, peak ${(rssAll.peak / MB).toFixed(0)} MiB`,
    );
    return {
      rows,
      // Against fs: each round's pair (same load), then the median over rounds; dd ran apart.
      ratios: {
        "slice/fs-read": pairedRatio(fsRead, sliced),
        "slice/dd": median(dd) / median(sliced),
        "slice-no-manifest/fs-read": pairedRatio(fsRead, sliceHashing),
        // Best round of each: on a shared, loaded machine the least disturbed runs.
        "slice/fs-read (best)": Math.min(...fsRead) / Math.min(...sliced),
        "slice/dd (best)": Math.min(...dd) / Math.min(...sliced),
      },
      notes,
    };
  },
};

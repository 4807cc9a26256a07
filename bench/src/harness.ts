import { mkdirSync, writeFileSync } from "node:fs";
import { cpus } from "node:os";
import { join } from "node:path";

/** Timing of one measured function: nanoseconds per call over repeated runs. */
export interface Timing {
  label: string;
  iterations: number;
  meanNs: number;
  medianNs: number;
  p99Ns: number;
  minNs: number;
}

export interface MeasureOptions {
  /** Keep sampling until this much time has passed (default 300 ms). */
  minTimeMs?: number;
  /** At least this many samples (default 10). */
  minSamples?: number;
  /** Calls per sample, for very fast functions (default 1). */
  batch?: number;
  /** Untimed calls first, to warm JIT and caches (default 3). */
  warmup?: number;
}

export type Row = Record<string, string | number>;

/** What a benchmark reports: a table of rows and the ratios that are its figures. */
export interface BenchReport {
  rows: Row[];
  /** Named ratios against the baseline measured in the same run (the figures that matter). */
  ratios: Record<string, number>;
  notes?: string[];
}

export interface Benchmark {
  name: string;
  description: string;
  run(): Promise<BenchReport>;
}

function percentile(sorted: number[], p: number): number {
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[i]!;
}

/** Times `fn` (sync or async) and returns per-call statistics. */
export async function measure(
  label: string,
  fn: () => unknown,
  options: MeasureOptions = {},
): Promise<Timing> {
  const minTime = (options.minTimeMs ?? 300) * 1e6;
  const minSamples = options.minSamples ?? 10;
  const batch = options.batch ?? 1;
  for (let i = 0; i < (options.warmup ?? 3); i++) await fn();
  const samples: number[] = [];
  const start = process.hrtime.bigint();
  while (samples.length < minSamples || Number(process.hrtime.bigint() - start) < minTime) {
    const t0 = process.hrtime.bigint();
    for (let i = 0; i < batch; i++) await fn();
    samples.push(Number(process.hrtime.bigint() - t0) / batch);
  }
  const sorted = [...samples].sort((a, b) => a - b);
  const mean = samples.reduce((a, b) => a + b, 0) / samples.length;
  return {
    label,
    iterations: samples.length * batch,
    meanNs: mean,
    medianNs: percentile(sorted, 50),
    p99Ns: percentile(sorted, 99),
    minNs: sorted[0]!,
  };
}

/** The middle value (the upper one of an even count). */
export function median(xs: readonly number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[s.length >> 1]!;
}

/** Median over rounds of baseline time / measured time (a throughput ratio of the same round). */
export function pairedRatio(baseline: readonly number[], measured: readonly number[]): number {
  return median(baseline.map((b, i) => b / measured[i]!));
}

/**
 * Runs the cases in turn, round after round (after one warm-up round), rotating their order each
 * round, so that every case sees the same load: on a shared machine, timing each case in its own
 * block compares different loads. Sample r of every case comes from round r (nanoseconds).
 */
export async function interleaved(
  cases: ReadonlyArray<[string, () => Promise<unknown>]>,
  options: { minTimeMs: number; minRounds: number; maxRounds?: number },
): Promise<Array<{ label: string; samples: number[] }>> {
  const out = cases.map(([label]) => ({ label, samples: [] as number[] }));
  for (const [, fn] of cases) await fn();
  const maxRounds = options.maxRounds ?? Number.POSITIVE_INFINITY;
  const start = performance.now();
  for (
    let round = 0;
    round < maxRounds && (round < options.minRounds || performance.now() - start < options.minTimeMs);
    round++
  ) {
    for (let j = 0; j < cases.length; j++) {
      const i = (round + j) % cases.length;
      const t0 = process.hrtime.bigint();
      await cases[i]![1]();
      out[i]!.samples.push(Number(process.hrtime.bigint() - t0));
    }
  }
  return out;
}

/** Bytes per nanosecond is GB/s. */
export function gbPerSecond(bytes: number, ns: number): number {
  return bytes / ns;
}

export function formatTable(rows: Row[]): string {
  if (rows.length === 0) return "(no rows)";
  const cols = [...new Set(rows.flatMap((r) => Object.keys(r)))];
  const cell = (v: string | number | undefined) =>
    v === undefined ? "" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : v;
  const widths = cols.map((c) => Math.max(c.length, ...rows.map((r) => cell(r[c]).length)));
  const line = (vals: string[]) => vals.map((v, i) => v.padStart(widths[i]!)).join("  ");
  return [
    line(cols),
    line(widths.map((w) => "-".repeat(w))),
    ...rows.map((r) => line(cols.map((c) => cell(r[c])))),
  ].join("\n");
}

export interface BenchResultFile extends BenchReport {
  name: string;
  description: string;
  date: string;
  node: string;
  cpu: string;
  cores: number;
}

/** Runs one benchmark, prints its table and ratios, writes bench/results/<name>.json. */
export async function runBenchmark(bench: Benchmark, resultsDir: string): Promise<BenchResultFile> {
  const report = await bench.run();
  const result: BenchResultFile = {
    name: bench.name,
    description: bench.description,
    date: new Date().toISOString(),
    node: process.version,
    cpu: cpus()[0]?.model ?? "unknown",
    cores: cpus().length,
    ...report,
  };
  mkdirSync(resultsDir, { recursive: true });
  writeFileSync(join(resultsDir, `${bench.name}.json`), `${JSON.stringify(result, null, 2)}\n`);
  const ratios = Object.entries(report.ratios)
    .map(([k, v]) => `  ${k}: ${v.toPrecision(4)}`)
    .join("\n");
  process.stdout.write(
    `\n== ${bench.name}: ${bench.description}\n${formatTable(report.rows)}\nratios:\n${ratios}\n${(report.notes ?? []).map((n) => `note: ${n}\n`).join("")}`,
  );
  return result;
}

// Where a benchmark process's CPU goes, per round trip, from Linux `perf` (MOESWARM_BENCH_PERF=1):
// each process is sampled with `perf record -e cpu-clock -p <pid>` while the chains run, and the
// samples are summed by where they ran: code V8 compiled (JavaScript), V8's builtins (property
// access, calls, typed arrays), V8's runtime (the garbage collector, the compilers), OpenSSL,
// Node's C++, libuv, libc and the kernel. CPU figures per process say that a relay costs more than
// its floor; this says in what. Micro-benchmarks do not: decoding a round trip's two frames took
// 2.1 µs in a loop and 5-6 µs in the running relay.
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { once } from "node:events";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";

export const PERF_CATEGORIES = [
  "JavaScript",
  "V8 builtins",
  "V8 runtime",
  "OpenSSL",
  "Node C++",
  "libuv",
  "libc",
  "kernel",
  "other",
] as const;
export type PerfCategory = (typeof PERF_CATEGORIES)[number];
export type PerfSplit = Record<PerfCategory, number>;

const OPENSSL =
  /^(_?aesni|_?aes_|gcm_|_?gcm|ossl_|OPENSSL_|CRYPTO_|EVP_|SSL_|BIO_|tls1|tls13|ssl3|ChaCha|Poly1305|sha\d|SHA\d|node::crypto::)/;

/**
 * What ran at a sample, from perf's shared object and symbol. Code V8 compiled lives in anonymous
 * memory: perf names it `[JIT] tid N` with the process's perf map (node --perf-basic-prof), else
 * it cannot name it at all.
 */
export function perfCategory(dso: string, symbol: string): PerfCategory {
  if (dso === "[kernel.kallsyms]" || dso.startsWith("[kernel")) return "kernel";
  if (dso.startsWith("[JIT]") || dso === "[unknown]" || dso.startsWith("perf-") || symbol.startsWith("JS:"))
    return "JavaScript";
  if (symbol.startsWith("Builtins_")) return "V8 builtins";
  if (symbol.startsWith("v8::")) return "V8 runtime";
  if (OPENSSL.test(symbol)) return "OpenSSL";
  if (symbol.startsWith("node::")) return "Node C++";
  if (symbol.startsWith("uv_") || symbol.startsWith("uv__")) return "libuv";
  if (dso.startsWith("libc.so") || dso.startsWith("libc-")) return "libc";
  return "other";
}

// `perf report -q -F period,dso,sym` lines: the period (ns of cpu-clock), the object (which may
// hold spaces: "[JIT] tid 123"), then `[.]` (user) or `[k]` (kernel) and the symbol
const LINE = /^\s*(\d+)\s+(.+?)\s+\[([.k])\]\s+(.*?)\s*$/;

/** A `perf report -q -F period,dso,sym --sort dso,sym` text as µs per trip by category. */
export function splitOfReport(text: string, trips: number): PerfSplit {
  const split = Object.fromEntries(PERF_CATEGORIES.map((c) => [c, 0])) as PerfSplit;
  for (const line of text.split("\n")) {
    const m = LINE.exec(line);
    if (!m) continue;
    const category = m[3] === "k" ? "kernel" : perfCategory(m[2]!, m[4]!);
    split[category] += Number(m[1]) / 1000 / trips;
  }
  return split;
}

/** `split` as one line: each category's µs per trip, largest first, the small ones left out. */
export function splitLine(split: PerfSplit): string {
  const total = PERF_CATEGORIES.reduce((sum, c) => sum + split[c], 0);
  const parts = PERF_CATEGORIES.filter((c) => split[c] >= 0.05)
    .sort((a, b) => split[b] - split[a])
    .map((c) => `${c} ${split[c].toFixed(1)}`);
  return `${total.toFixed(1)} = ${parts.join(", ")}`;
}

/** Why `perf` cannot sample this machine's processes, or undefined when it can. */
export function perfUnavailable(): string | undefined {
  if (process.platform !== "linux") return "not Linux";
  const probe = spawnSync(
    "perf",
    ["record", "-q", "-e", "cpu-clock", "-o", "/dev/null", "-p", String(process.pid), "--", "sleep", "0.05"],
    { encoding: "utf8" },
  );
  if (probe.error) return "no perf (Debian: linux-perf)";
  if (probe.status !== 0)
    return `perf cannot sample here (kernel.perf_event_paranoid?): ${probe.stderr.trim().split("\n")[0]}`;
  return undefined;
}

/** A `perf record` of some processes, running until stopped. */
export interface PerfRecording {
  /** Stops sampling; then each process's split, µs per trip, by name. */
  stop(trips: Record<string, number>): Promise<Record<string, PerfSplit>>;
}

/** Starts sampling `processes` (by name) at `hz`. */
export async function recordProcesses(
  processes: Record<string, ChildProcess>,
  hz = 4000,
): Promise<PerfRecording> {
  const dir = await mkdtemp(join(tmpdir(), "moeswarm-perf-"));
  const runs = Object.entries(processes).map(([name, child]) => {
    const file = join(dir, `${name.replace(/\W+/g, "-")}.data`);
    const perf = spawn(
      "perf",
      ["record", "-q", "-F", String(hz), "-e", "cpu-clock", "-p", String(child.pid), "-o", file],
      {
        stdio: "ignore",
      },
    );
    return { name, file, perf, exited: once(perf, "exit") };
  });
  // (perf attaches in a few ms; trips before it would be counted without their samples)
  await sleep(300);
  return {
    async stop(trips) {
      const out: Record<string, PerfSplit> = {};
      try {
        for (const run of runs) run.perf.kill("SIGINT");
        for (const run of runs) await run.exited;
        for (const run of runs) {
          const report = spawnSync(
            "perf",
            [
              "report",
              "-i",
              run.file,
              "-q",
              "--no-children",
              "--sort",
              "dso,sym",
              "-g",
              "none",
              "-F",
              "period,dso,sym",
            ],
            { encoding: "utf8", maxBuffer: 64 * 1024 * 1024 },
          );
          out[run.name] = splitOfReport(report.stdout ?? "", trips[run.name] ?? 1);
        }
      } finally {
        await rm(dir, { recursive: true, force: true });
      }
      return out;
    },
  };
}

import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { frameAllocatorEnv, hasFrameAllocatorEnv, tuneHeapForFrames } from "@moeswarm/core";
import { runBenchmark } from "./harness.js";
import { benchmarks } from "./registry.js";

const resultsDir = join(dirname(fileURLToPath(import.meta.url)), "..", "results");
const wanted = process.argv.slice(2).filter((a) => !a.startsWith("-"));
const unknown = wanted.filter((w) => !benchmarks.some((b) => b.name === w));
if (unknown.length > 0) {
  process.stderr.write(
    `unknown benchmark(s): ${unknown.join(", ")}\navailable: ${benchmarks.map((b) => b.name).join(", ")}\n`,
  );
  process.exit(2);
}
// Every process of a bench starts with glibc's malloc tuned for large frames, as docs/deploy.md has
// operators start the hub, workers and dispatchers (core frame-allocator.ts): glibc reads its
// tunables only at start-up, so without them this process runs itself again with them (its
// children inherit them). MOESWARM_BENCH_ALLOCATOR=default measures glibc's defaults instead.
const allocatorDefault = process.env.MOESWARM_BENCH_ALLOCATOR === "default";
if (!allocatorDefault && !hasFrameAllocatorEnv()) {
  const again = spawnSync(process.execPath, [...process.execArgv, ...process.argv.slice(1)], {
    stdio: "inherit",
    env: frameAllocatorEnv(),
  });
  process.exit(again.status ?? 1);
}
process.stdout.write(
  `malloc: ${allocatorDefault ? "glibc's defaults" : `GLIBC_TUNABLES=${process.env.GLIBC_TUNABLES}`}\n`,
);
// This process is the backbone of every product path (and the client of every floor): sized for
// frames as moeswarm-dispatcher sizes itself. Untuned, it fell into a storm of full collections at
// 64 tokens (2.1-2.9 ms of CPU per round trip instead of 0.4-0.5; core frame-heap.ts).
tuneHeapForFrames();
for (const bench of benchmarks) {
  if (wanted.length > 0 && !wanted.includes(bench.name)) continue;
  await runBenchmark(bench, resultsDir);
}
process.stdout.write(`\nresults written to ${resultsDir}\n`);

import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { tuneHeapForFrames } from "@moeswarm/core";
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
// This process is the backbone of every product path (and the client of every floor): sized for
// frames as moeswarm-dispatcher sizes itself. Untuned, it fell into a storm of full collections at
// 64 tokens (2.1-2.9 ms of CPU per round trip instead of 0.4-0.5; core frame-heap.ts).
tuneHeapForFrames();
for (const bench of benchmarks) {
  if (wanted.length > 0 && !wanted.includes(bench.name)) continue;
  await runBenchmark(bench, resultsDir);
}
process.stdout.write(`\nresults written to ${resultsDir}\n`);

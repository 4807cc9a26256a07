// Standalone reproducer of issue #19 (the heap corruption of moeswarm-expert-worker-llama on
// node-llama-cpp's libggml-vulkan.so over Mesa's lavapipe), with no vitest: it writes the mixed-type
// slice of test/mixed-types.test.ts once, then, run after run, starts the worker child directly on
// it, sends it the test's requests (each answer checked against the f64 oracle) and reports whether
// the child survived, how it died and the tail of its stderr.
//
//   npx tsx test/vk-repro.ts [--runs 20] [--case mixed|chunk|both] [--env NAME=VALUE]...
//       [--under none|gdb|valgrind] [--binary PATH] [--max-batch-rows N] [--logs DIR] [--no-oracle]
//       [--json]
//
// --under gdb runs the child as `gdb -batch -ex run -ex bt -ex 'thread apply all bt'` (gdb's output
// in DIR/run-<i>.gdb.log, the child's stdio stays the wire); --under valgrind as memcheck
// (DIR/run-<i>.vg.log). --binary runs another build of the executable (an AddressSanitizer one).
// The exit status is 1 when any run crashed or answered wrongly.
//
// The cause (found 2026-12-02): lavapipe frees the resource of a VkBuffer that ggml-vulkan destroyed
// (a preallocated buffer that grew) twice, on its queue thread; the worker keeps such buffers alive
// on lavapipe (native/worker/vk-lavapipe-guard.cpp). `--env MOESWARM_VK_KEEP_DESTROYED_BUFFERS=0`
// turns that off, to see the crash again on the same build.

import { mkdirSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { parseArgs } from "node:util";
import { cosine } from "@moeswarm/core";
import { gpuLibraryPath } from "../src/gpu-build.js";
import {
  GPU_MAX_BATCH_ROWS,
  llamaExpertWorkerPath,
  probeVulkan,
  spawnExpertWorker,
  type WorkerProcessCompute,
} from "../src/index.js";
import { type Fixture, oracleEach } from "./fixtures.js";
import { chunkSteps, K, type MixedStep, mixedSteps, writeMixed } from "./mixed-model.js";

const { values: opt } = parseArgs({
  options: {
    runs: { type: "string", default: "20" },
    case: { type: "string", default: "mixed" },
    env: { type: "string", multiple: true, default: [] },
    under: { type: "string", default: "none" },
    binary: { type: "string" },
    "max-batch-rows": { type: "string", default: String(GPU_MAX_BATCH_ROWS) },
    logs: { type: "string" },
    "no-oracle": { type: "boolean", default: false },
    json: { type: "boolean", default: false },
  },
});

interface RunResult {
  run: number;
  outcome: "pass" | "crash" | "wrong";
  steps: number;
  ms: number;
  detail?: string;
}

function wrapper(kind: string, dir: string, i: number): string | undefined {
  if (kind === "none") return undefined;
  const path = join(dir, `run-${i}.${kind}.sh`);
  const log = join(dir, `run-${i}.${kind === "gdb" ? "gdb" : "vg"}.log`);
  const cmd =
    kind === "gdb"
      ? `exec gdb -q -nx -batch -ex 'set pagination off' -ex 'set startup-with-shell off' -ex 'set disable-randomization off' ` +
        `-ex 'set logging file ${log}' -ex 'set logging redirect on' -ex 'set logging enabled on' ` +
        `-ex 'handle SIGPIPE nostop noprint' -ex run -ex bt -ex 'info threads' -ex 'thread apply all bt' ` +
        `-ex 'info sharedlibrary' --args "$@"`
      : `exec valgrind --tool=memcheck --log-file=${log} --num-callers=40 --smc-check=all-non-file ` +
        `--error-limit=no --read-var-info=no "$@"`;
  if (kind !== "gdb" && kind !== "valgrind") throw new Error(`--under must be none, gdb or valgrind`);
  writeFileSync(path, `#!/bin/sh\n${cmd}\n`, { mode: 0o755 });
  return path;
}

async function oneRun(
  i: number,
  model: Fixture,
  binsDir: string,
  steps: MixedStep[],
  dir: string,
): Promise<RunResult> {
  const t0 = performance.now();
  const env: Record<string, string> = {
    // the Vulkan package's ggml first, then what it lacks (gpu-build.ts gpuLibraryPath)
    LD_LIBRARY_PATH: [binsDir, gpuLibraryPath(binsDir, {})].filter(Boolean).join(":"),
    MOESWARM_GGML_BACKEND_DIR: binsDir,
    GGML_VK_VISIBLE_DEVICES: "0",
  };
  for (const kv of opt.env) {
    const eq = kv.indexOf("=");
    env[kv.slice(0, eq)] = kv.slice(eq + 1);
  }
  const launcher = wrapper(opt.under, dir, i);
  let compute: WorkerProcessCompute | undefined;
  let done = 0;
  try {
    compute = await spawnExpertWorker(
      opt.binary ? resolve(opt.binary) : llamaExpertWorkerPath(),
      model.path,
      {
        device: "Vulkan0",
        threads: 1,
        maxBatchRows: Number(opt["max-batch-rows"]),
        env,
        startTimeoutMs: 1_800_000,
        restart: false,
        ...(launcher ? { launcher } : {}),
      },
    );
    for (const s of steps) {
      const y = await compute.run({ layer: s.layer, x: s.x, ids: s.ids, k: K, mode: "each" });
      await compute.run({ layer: s.layer, x: s.x, ids: s.ids, k: K, w: s.w, mode: "sum" });
      if (!opt["no-oracle"]) {
        const c = cosine(y, await oracleEach(model, s.layer, s.x, s.ids, K));
        if (!(c >= 0.9995)) {
          return {
            run: i,
            outcome: "wrong",
            steps: done,
            ms: performance.now() - t0,
            detail: `${s.label}: cosine ${c}`,
          };
        }
      }
      done++;
    }
    await compute.close();
    return { run: i, outcome: "pass", steps: done, ms: performance.now() - t0 };
  } catch (error) {
    await compute?.close().catch(() => {});
    const msg = (error as Error).message;
    return { run: i, outcome: "crash", steps: done, ms: performance.now() - t0, detail: msg.slice(-600) };
  }
}

async function main(): Promise<void> {
  const dir = opt.logs ?? join(tmpdir(), `moeswarm-vk-repro-${process.pid}`);
  mkdirSync(dir, { recursive: true });
  const model = await writeMixed(dir);
  const status = await probeVulkan({ allowCpuDevice: true });
  const steps = [
    ...(opt.case === "chunk" ? [] : mixedSteps()),
    ...(opt.case === "mixed" ? [] : chunkSteps()),
  ];
  const runs = Number(opt.runs);
  const results: RunResult[] = [];
  console.error(
    `vk-repro: ${runs} runs of ${steps.length} requests (x2 modes) on ${status.devices[0]?.description}, env ${JSON.stringify(opt.env)}, under ${opt.under}, logs ${dir}`,
  );
  for (let i = 0; i < runs; i++) {
    const r = await oneRun(i, model, status.binsDir, steps, dir);
    results.push(r);
    console.error(
      `run ${i}: ${r.outcome} after ${r.steps}/${steps.length} steps, ${(r.ms / 1000).toFixed(1)} s${r.detail ? `: ${r.detail.replace(/\s+/g, " ").slice(-300)}` : ""}`,
    );
  }
  const count = (o: string) => results.filter((r) => r.outcome === o).length;
  const summary = { runs, pass: count("pass"), crash: count("crash"), wrong: count("wrong"), env: opt.env };
  console.error(
    `vk-repro: ${summary.crash} crashed, ${summary.wrong} wrong, ${summary.pass} passed of ${runs}`,
  );
  if (opt.json) console.log(JSON.stringify({ ...summary, results }));
  process.exitCode = summary.pass === runs ? 0 : 1;
}

await main();

// `moeswarm-worker --max-batch-rows N` (issue 19): a GPU worker reserves its compute buffer for N
// (token, expert) rows at load and computes bigger batches in chunks. The flag is checked (a usage
// error names it), its default --vram offer leaves room for that buffer and no more, and it reaches
// the executable that computes (here on Mesa's lavapipe, a software Vulkan device, as in CI).
import { chmodSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { isMoeswarmError } from "@moeswarm/core";
import { type Hub, mintToken } from "@moeswarm/hub";
import type { TempDir } from "@moeswarm/testkit";
import {
  GPU_MAX_BATCH_ROWS,
  gpuComputeReserveBytes,
  gpuVramMargin,
  probeVulkan,
} from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runWorkerCli, workerOptions } from "../src/cli.js";
import { settings } from "../src/options.js";
import { startTestHub, waitPlacement } from "./fixtures.js";

const GiB = 1024 ** 3;
const base = { hub: "http://127.0.0.1:1", token: "t", cacheDir: "/tmp/moeswarm-max-batch-rows", id: "w" };

const sink = () => ({
  text: "",
  write(t: string) {
    this.text += t;
    return true;
  },
});

function refused(fn: () => unknown): string {
  try {
    fn();
  } catch (error) {
    expect(isMoeswarmError(error, "MOESWARM_INVALID_ARGUMENT")).toBe(true);
    return (error as Error).message;
  }
  throw new Error("not refused");
}

describe("maxBatchRows (runWorker) and --max-batch-rows (moeswarm-worker)", () => {
  it("runWorker takes it for a GPU backend only, as an integer in 1..65536", () => {
    const capacity = { ramBytes: GiB, vramBytes: GiB };
    for (const backend of ["vulkan", "cuda"] as const) {
      expect(settings({ ...base, backend, capacity, maxBatchRows: 64 }).maxBatchRows).toBe(64);
      expect(settings({ ...base, backend, capacity }).maxBatchRows).toBeUndefined();
    }
    for (const bad of [0, -1, 1.5, 65_537, Number.NaN, "64"]) {
      expect(
        refused(() => settings({ ...base, backend: "vulkan", capacity, maxBatchRows: bad as number })),
      ).toContain("maxBatchRows must be an integer in 1..65536");
    }
    for (const backend of ["auto", "native", "llama-cpu", "worker", "ts"] as const) {
      expect(refused(() => settings({ ...base, backend, capacity, maxBatchRows: 64 }))).toContain(
        `maxBatchRows applies to the GPU backends (vulkan, cuda), not backend "${backend}"`,
      );
    }
  });

  it("the CLI shows it in --help and refuses a bad value or a CPU backend with a usage error (exit 2)", async () => {
    const out = sink();
    const err = sink();
    const io = { stdout: out as never, stderr: err as never, env: {} };
    expect(await runWorkerCli(["--help"], io, AbortSignal.abort())).toBe(0);
    expect(out.text).toContain("--max-batch-rows N");
    const args = ["--hub", "http://127.0.0.1:1", "--token", "t", "--cache-dir", "/tmp/moeswarm-mbr"];
    for (const [value, backend, says] of [
      ["0", "vulkan", '--max-batch-rows must be an integer in 1..65536, got "0"'],
      ["65537", "cuda", "--max-batch-rows must be an integer in 1..65536"],
      ["many", "vulkan", "--max-batch-rows must be an integer in 1..65536"],
      ["1.5", "vulkan", "--max-batch-rows must be an integer in 1..65536"],
      ["64", "ts", "--max-batch-rows goes with --backend vulkan or cuda"],
      ["64", "auto", "not --backend auto"],
    ] as const) {
      err.text = "";
      expect(
        await runWorkerCli(
          [...args, "--backend", backend, "--max-batch-rows", value],
          io,
          AbortSignal.abort(),
        ),
        `${value} ${backend}`,
      ).toBe(2);
      expect(err.text).toContain(says);
      expect(err.text).toContain("usage: moeswarm-worker");
    }
    // with --vram given, no device is probed: the flag is passed on as it is
    const given = await workerOptions(
      { hub: "http://127.0.0.1:1", token: "t", backend: "cuda", vram: "8GiB", "max-batch-rows": "128" },
      {},
    );
    expect(given.maxBatchRows).toBe(128);
    expect(given.capacity.vramBytes).toBe(8 * GiB);
  });
});

// lavapipe: the default VRAM offer at a given row bound, and the bound reaching the executable
let vk: { vramBytes: number; vramOfferBytes: number } | undefined;
try {
  vk = await probeVulkan({ allowCpuDevice: true });
} catch (error) {
  if (process.env.CI && process.platform === "linux" && process.arch === "x64") {
    throw new Error(`CI must run the Vulkan tests on lavapipe: ${(error as Error).message}`);
  }
  console.warn(`skipping the --max-batch-rows Vulkan tests: ${(error as Error).message}`);
}

/** Runs `fn` with these variables in this process's environment (the probe's child and the worker read them). */
async function withEnv<T>(vars: Record<string, string>, fn: () => Promise<T>): Promise<T> {
  const saved = Object.fromEntries(Object.keys(vars).map((k) => [k, process.env[k]]));
  Object.assign(process.env, vars);
  try {
    return await fn();
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
}

describe.skipIf(!vk)("--max-batch-rows on a Vulkan device (lavapipe)", () => {
  const SECRET = "worker-max-batch-rows-secret-0123456789";
  const MODEL = "qwen3moe-tiny";
  let hub: Hub;
  let url: string;
  let work: TempDir;

  beforeAll(async () => {
    ({ hub, url, work } = await startTestHub({
      secret: SECRET,
      model: MODEL,
      preset: "tiny",
      workPrefix: "moeswarm-worker-mbr-",
    }));
  });
  afterAll(async () => {
    await hub?.close();
    work?.remove();
  });

  it("the default --vram offer leaves room for the compute buffer of that many rows", async () => {
    const total = vk!.vramBytes;
    const offer = (rows: number) => Math.max(0, total - gpuComputeReserveBytes(rows) - gpuVramMargin(total));
    await withEnv({ GGML_VK_VISIBLE_DEVICES: "0" }, async () => {
      const at = async (rows?: string) =>
        (
          await workerOptions(
            { hub: url, token: "t", backend: "vulkan", ...(rows ? { "max-batch-rows": rows } : {}) },
            process.env,
          )
        ).capacity.vramBytes;
      expect(await at()).toBe(offer(GPU_MAX_BATCH_ROWS));
      expect(await at("64")).toBe(offer(64));
      expect(await at("4096")).toBe(offer(4096));
    });
    // fewer rows, more for weights: the difference is exactly the smaller buffer
    expect(offer(64) - offer(GPU_MAX_BATCH_ROWS)).toBe(
      gpuComputeReserveBytes(GPU_MAX_BATCH_ROWS) - gpuComputeReserveBytes(64),
    );
    expect(offer(4096)).toBeLessThan(offer(GPU_MAX_BATCH_ROWS));
  }, 60_000);

  it("moeswarm-worker --backend vulkan --max-batch-rows 64 claims with that offer and starts its executable with it", async () => {
    // a launcher (worker-native's MOESWARM_WORKER_LAUNCHER) that writes down the command line
    const argsFile = join(work.dir, "launched.txt");
    const launcher = join(work.dir, "launcher.sh");
    writeFileSync(launcher, `#!/bin/sh\nprintf '%s\\n' "$*" >> '${argsFile}'\nexec "$@"\n`);
    chmodSync(launcher, 0o755);
    const out = sink();
    const err = sink();
    const stop = new AbortController();
    const id = "gpu-64";
    const token = mintToken({ role: "worker", id, ttlS: 600 }, SECRET);
    const total = vk!.vramBytes;
    const exitCode = await withEnv(
      { GGML_VK_VISIBLE_DEVICES: "0", MOESWARM_WORKER_LAUNCHER: launcher },
      async () => {
        const run = runWorkerCli(
          [
            ...["--hub", url, "--token", token, "--cache-dir", join(work.dir, "cache")],
            ...[
              "--backend",
              "vulkan",
              "--max-batch-rows",
              "64",
              "--pause-battery",
              "off",
              "--pause-temp",
              "off",
            ],
          ],
          { stdout: out as never, stderr: err as never, env: process.env },
          stop.signal,
        );
        try {
          await waitPlacement(
            url,
            MODEL,
            `${id} registered`,
            (p) => p.registrations.some((r) => r.id === id),
            {
              timeoutMs: 90_000,
            },
          );
        } catch (error) {
          stop.abort();
          await run;
          throw new Error(`${(error as Error).message}\n${out.text}${err.text}`);
        }
        const leases = hub.market.servingLeases({ worker: id });
        expect(leases.length).toBeGreaterThan(0);
        for (const l of leases) {
          expect(l.capacity).toMatchObject({
            backend: "vulkan",
            vramBytes: total - gpuComputeReserveBytes(64) - gpuVramMargin(total),
          });
        }
        stop.abort();
        return run;
      },
    );
    expect(exitCode, err.text).toBe(0);
    expect(out.text).toMatch(/loaded worker on vulkan0/i);
    const launched = readFileSync(argsFile, "utf8").trim().split("\n");
    expect(launched.length).toBeGreaterThan(0);
    for (const line of launched) {
      expect(line).toMatch(/moeswarm-expert-worker-llama /);
      expect(line).toContain("--device Vulkan0");
      expect(line).toContain("--max-batch-rows 64");
    }
  }, 150_000);
});

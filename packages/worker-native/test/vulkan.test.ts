// The "vulkan" backend: moeswarm-expert-worker-llama on node-llama-cpp's Vulkan build of ggml. In
// CI the device is Mesa's lavapipe (a software Vulkan device, "llvmpipe"), so the whole Vulkan path
// (ggml-vulkan's shaders, buffers and MUL_MAT_ID) runs on every push; the outputs are checked
// against the f64 oracle per ggml type, as the native addon's are (native.test.ts).

import { spawn } from "node:child_process";
import { cosine, sumSlots } from "@moeswarm/core";
import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { gpuLibraryPath } from "../src/gpu-build.js";
import {
  type ExpertCompute,
  GPU_MAX_BATCH_ROWS,
  gpuComputeReserveBytes,
  gpuVramMargin,
  gpuVramOffer,
  llamaExpertWorkerPath,
  loadExpertCompute,
  probeVulkan,
  spawnVulkanExpertWorker,
  VULKAN_TYPES,
  vulkanBinsDir,
} from "../src/index.js";
import {
  type Fixture,
  normals,
  oracleEach,
  randomIds,
  randomWeights,
  TYPES,
  writeModelPerType,
} from "./fixtures.js";

let missing: string | undefined;
let vram = 0;
let offer = 0;
try {
  const status = await probeVulkan({ allowCpuDevice: true });
  vram = status.vramBytes;
  offer = status.vramOfferBytes;
  console.log(
    `Vulkan devices: ${status.devices.map((d) => `${d.name} ${d.description}`).join(", ")}; ${vram} bytes`,
  );
} catch (error) {
  missing = (error as Error).message;
}
if (missing) {
  // CI installs mesa-vulkan-drivers (.ci/run) and the package (a dev dependency): it must run there
  if (process.env.CI && process.platform === "linux" && process.arch === "x64") {
    throw new Error(`CI must run the Vulkan tests on lavapipe: ${missing}`);
  }
  console.warn(`skipping the Vulkan tests: ${missing}`);
}

const N_EMBD = 256;
const N_FF = 256;
const N_EXPERT = 8;
const K = 4;

const MiB = 1024 ** 2;

describe("the VRAM a GPU worker offers for weights", () => {
  it("is the device's memory less the compute reserve and the margin, never below 0", () => {
    const GiB = 1024 * MiB;
    // 512 rows of the largest shape sized for (n_embd 8192, n_ff 16384): 4 bytes x (3 x 8192 + 5 x 16384)
    expect(gpuComputeReserveBytes()).toBe(GPU_MAX_BATCH_ROWS * 4 * (3 * 8192 + 5 * 16384) + MiB);
    expect(gpuComputeReserveBytes(64, { nEmbd: 256, nFf: 256 })).toBe(64 * 4 * 2048 + MiB);
    expect(gpuVramMargin(8 * GiB)).toBe(512 * MiB);
    expect(gpuVramMargin(80 * GiB)).toBe(2.5 * GiB);
    const o = gpuVramOffer(24 * GiB);
    expect(o.computeReserveBytes).toBe(gpuComputeReserveBytes());
    expect(o.marginBytes).toBe(768 * MiB);
    expect(o.vramOfferBytes).toBe(24 * GiB - o.computeReserveBytes - o.marginBytes);
    expect(gpuVramOffer(24 * GiB, 4096).vramOfferBytes).toBeLessThan(o.vramOfferBytes);
    expect(gpuVramOffer(256 * MiB).vramOfferBytes).toBe(0);
  });
});

/** The compute buffer the worker reserves at load on lavapipe, from the line it prints on stderr. */
function reservedBytes(slicePath: string, maxBatchRows: number): Promise<{ bytes: number; rows: number }> {
  const dir = vulkanBinsDir();
  return new Promise((resolve, reject) => {
    const child = spawn(
      llamaExpertWorkerPath(),
      ["--slice", slicePath, "--device", "Vulkan0", "--max-batch-rows", String(maxBatchRows)],
      {
        env: {
          ...process.env,
          // the Vulkan package's ggml, then what it lacks (as spawnGpuExpertWorker does)
          LD_LIBRARY_PATH: [dir, gpuLibraryPath(dir, {})].filter(Boolean).join(":"),
          MOESWARM_GGML_BACKEND_DIR: dir,
          GGML_VK_VISIBLE_DEVICES: "0",
        },
      },
    );
    let err = "";
    child.stderr.on("data", (c: Buffer) => {
      err += c.toString();
    });
    child.stdout.resume();
    child.stdin.end(); // the worker registers, reads the end of its input and exits
    child.on("error", reject);
    child.on("close", () => {
      const m = /compute buffer: (\d+) bytes reserved for (\d+) rows/.exec(err);
      if (m) resolve({ bytes: Number(m[1]), rows: Number(m[2]) });
      else reject(new Error(`no reservation line: ${err}`));
    });
  });
}

async function loadOnLavapipe(path: string): Promise<ExpertCompute> {
  // how a participant on lavapipe is run: GGML_VK_VISIBLE_DEVICES in its environment
  const env = process.env.GGML_VK_VISIBLE_DEVICES;
  process.env.GGML_VK_VISIBLE_DEVICES = "0";
  try {
    return await loadExpertCompute(path, { backend: "vulkan", threads: 1 });
  } finally {
    if (env === undefined) delete process.env.GGML_VK_VISIBLE_DEVICES;
    else process.env.GGML_VK_VISIBLE_DEVICES = env;
  }
}

// Batch 64 makes ggml-vulkan compile its large matmul pipelines for the type, which on lavapipe
// costs up to ~85 s per quantised type on a busy 2-core machine: CI checks n = 64 on f32 only (the
// matrix command's full mode covers it for every type).
const BATCHES = (type: GgmlType) => (type === GgmlType.F32 ? [1, 8, 64] : [1, 8]);

describe.skipIf(Boolean(missing))("vulkan expert compute (node-llama-cpp's ggml-vulkan)", () => {
  const tmp = tempDir("moeswarm-wn-vk-");
  let models: Map<GgmlType, Fixture>;
  const table = new Map<string, string>();

  beforeAll(async () => {
    models = await writeModelPerType(
      { nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layers: [1] },
      300,
      tmp.dir,
    );
  });
  afterAll(() => {
    if (table.size)
      console.log(`vulkan vs f64 oracle, min cosine per type: ${JSON.stringify(Object.fromEntries(table))}`);
    tmp.remove();
  });

  it("reports its device, its memory and the types it computes", async () => {
    await using compute = await loadOnLavapipe(models.get(GgmlType.F32)!.path);
    expect(compute.info.backend).toBe("worker");
    expect(compute.info.device?.toLowerCase()).toBe("vulkan0");
    expect(compute.info.vramBytes).toBe(vram);
    expect(vram).toBeGreaterThan(0);
    expect(compute.info.types).toEqual(VULKAN_TYPES);
  });

  it("offers its memory less the compute buffer it reserves at load and a margin", async () => {
    expect(offer).toBe(Math.max(0, vram - gpuComputeReserveBytes() - gpuVramMargin(vram)));
    expect(offer).toBeLessThanOrEqual(vram - 512 * MiB);
    // the reserve counted is an upper bound of what the worker really reserves, here for this shape
    for (const rows of [64, GPU_MAX_BATCH_ROWS]) {
      const r = await reservedBytes(models.get(GgmlType.Q4_K)!.path, rows);
      console.log(
        `lavapipe compute buffer for ${rows} rows (n_embd ${N_EMBD}, n_ff ${N_FF}): ${r.bytes} bytes`,
      );
      expect(r.rows).toBe(rows);
      expect(r.bytes).toBeGreaterThan(rows * 4 * N_EMBD);
      expect(r.bytes).toBeLessThanOrEqual(gpuComputeReserveBytes(rows, { nEmbd: N_EMBD, nFf: N_FF }));
    }
  }, 120_000);

  it("refuses to start without a visible device (lavapipe hidden), saying what to install", async () => {
    const env = process.env.GGML_VK_VISIBLE_DEVICES;
    delete process.env.GGML_VK_VISIBLE_DEVICES;
    try {
      await expect(
        spawnVulkanExpertWorker(models.get(GgmlType.F32)!.path, { allowCpuDevice: false }),
      ).rejects.toMatchObject({
        code: "MOESWARM_NATIVE_LOAD",
        message: expect.stringMatching(/no Vulkan device[\s\S]*possible solutions/),
      });
    } finally {
      if (env !== undefined) process.env.GGML_VK_VISIBLE_DEVICES = env;
    }
  });

  // ggml-vulkan converts the activations of quantised types to q8_1 (the CPU: q8_0/q8_K) and may
  // keep f16 intermediates; the bound is the CPU backend's K-quant bound (0.9995) for every type.
  for (const type of TYPES) {
    it(`${ggmlTypeName(type)}: matches the f64 oracle (cosine >= 0.9995 per run) at n = ${BATCHES(type).join(", ")}; "sum" is the weighted sum of "each"`, async () => {
      const model = models.get(type)!;
      expect(VULKAN_TYPES).toContain(ggmlTypeName(type));
      await using compute = await loadOnLavapipe(model.path);
      let min = 1;
      let worstRun = 1;
      for (const n of BATCHES(type)) {
        const x = normals(n * N_EMBD, 41 + n);
        const ids = randomIds(n, K, [...Array(N_EXPERT).keys()], 42 + n, 0.2);
        const w = randomWeights(n, K, 43 + n);
        const y = await compute.run({ layer: 1, x, ids, k: K, mode: "each" });
        const ref = await oracleEach(model, 1, x, ids, K);
        for (let s = 0; s < n * K; s++) {
          const got = y.subarray(s * N_EMBD, (s + 1) * N_EMBD);
          if (ids[s] === -1) {
            expect(got.every((v) => v === 0)).toBe(true);
            continue;
          }
          min = Math.min(min, cosine(got, ref.subarray(s * N_EMBD, (s + 1) * N_EMBD)));
        }
        worstRun = Math.min(worstRun, cosine(y, ref));
        const sum = await compute.run({ layer: 1, x, ids, k: K, w, mode: "sum" });
        expect(cosine(sum, sumSlots(y, w, ids, { n, k: K, embd: N_EMBD }))).toBeGreaterThan(0.99999);
      }
      table.set(ggmlTypeName(type), `${min.toFixed(6)} per slot, ${worstRun.toFixed(6)} per run`);
      expect(worstRun).toBeGreaterThanOrEqual(0.9995);
      expect(min).toBeGreaterThan(0.999);
    }, 180_000);
  }
});

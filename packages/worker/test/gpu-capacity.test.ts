// A GPU worker's slices live in device memory: its claims are sized by --vram, not by host RAM
// (the one rule, core's capacityWeightBytes, is the hub's too: hub/test/market-claims.test.ts).
import { capacityWeightBytes, GPU_CAPACITY_BACKENDS } from "@moeswarm/core";
import { gpuComputeReserveBytes, gpuVramMargin, probeVulkan } from "@moeswarm/worker-native";
import { describe, expect, it } from "vitest";
import { workerOptions } from "../src/cli.js";
import { settings } from "../src/options.js";

const GiB = 1024 ** 3;
const base = { hub: "http://127.0.0.1:1", token: "t", cacheDir: "/tmp/moeswarm-gpu-capacity", id: "w" };

describe("claims count VRAM for GPU workers", () => {
  it("a cuda or vulkan worker offers its device memory, registered with its backend", () => {
    for (const backend of ["cuda", "vulkan"] as const) {
      const s = settings({ ...base, backend, capacity: { ramBytes: 64 * GiB, vramBytes: 8 * GiB } });
      expect(s.capacityBytes).toBe(8 * GiB);
      expect(s.capacity).toEqual({ ramBytes: 64 * GiB, vramBytes: 8 * GiB, backend });
    }
  });

  it("a CPU worker offers host memory plus any device memory, as before", () => {
    for (const backend of ["auto", "native", "llama-cpu", "worker", "ts"] as const) {
      const s = settings({ ...base, backend, capacity: { ramBytes: 6 * GiB, vramBytes: 2 * GiB } });
      expect(s.capacityBytes).toBe(8 * GiB);
      expect(s.capacity.backend).toBe("cpu");
    }
  });

  it("a GPU worker that names no device memory falls back to host memory", () => {
    expect(settings({ ...base, backend: "cuda", capacity: { ramBytes: 6 * GiB } }).capacityBytes).toBe(
      6 * GiB,
    );
    expect(capacityWeightBytes({ ramBytes: 6, vramBytes: 0, backend: "vulkan" })).toBe(6);
    expect(capacityWeightBytes({ ramBytes: 6, vramBytes: 2, backend: "Metal" })).toBe(2);
    expect(capacityWeightBytes({ vramBytes: 2 })).toBe(2);
    expect(GPU_CAPACITY_BACKENDS).toEqual(expect.arrayContaining(["cuda", "hip", "vulkan"]));
  });
});

// The CLI's --vram default on a GPU backend: the probe's device memory less the compute buffer the
// worker reserves at load and a margin (worker-native's gpuVramOffer), on lavapipe here
let vk: { vramBytes: number } | undefined;
try {
  vk = await probeVulkan({ allowCpuDevice: true });
} catch (error) {
  if (process.env.CI && process.platform === "linux" && process.arch === "x64") {
    throw new Error(`CI must run the Vulkan tests on lavapipe: ${(error as Error).message}`);
  }
  console.warn(`skipping the --vram headroom test: ${(error as Error).message}`);
}

describe.skipIf(!vk)("the CLI's VRAM offer leaves headroom", () => {
  it("--backend vulkan registers the device's memory less the compute reserve and the margin", async () => {
    const total = vk!.vramBytes;
    const env = { ...process.env, GGML_VK_VISIBLE_DEVICES: "0" };
    const saved = process.env.GGML_VK_VISIBLE_DEVICES;
    process.env.GGML_VK_VISIBLE_DEVICES = "0"; // the probe's child process reads this process's env
    try {
      const o = await workerOptions({ hub: "http://127.0.0.1:1", token: "t", backend: "vulkan" }, env);
      const headroom = gpuComputeReserveBytes() + gpuVramMargin(total);
      expect(headroom).toBeGreaterThanOrEqual(512 * 1024 ** 2);
      expect(o.capacity.vramBytes).toBe(Math.max(0, total - headroom));
      expect(o.capacity.vramBytes).toBeLessThan(total);
      // an explicit --vram is taken as given
      const given = await workerOptions(
        { hub: "http://127.0.0.1:1", token: "t", backend: "vulkan", vram: "1GiB" },
        env,
      );
      expect(given.capacity.vramBytes).toBe(GiB);
    } finally {
      if (saved === undefined) delete process.env.GGML_VK_VISIBLE_DEVICES;
      else process.env.GGML_VK_VISIBLE_DEVICES = saved;
    }
  }, 60_000);
});

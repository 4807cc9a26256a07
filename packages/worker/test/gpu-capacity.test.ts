// A GPU worker's slices live in device memory: its claims are sized by --vram, not by host RAM
// (the one rule, core's capacityWeightBytes, is the hub's too: hub/test/market-claims.test.ts).
import { capacityWeightBytes, GPU_CAPACITY_BACKENDS } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
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

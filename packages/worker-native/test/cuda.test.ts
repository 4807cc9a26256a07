// The "cuda" backend: moeswarm-expert-worker-llama on node-llama-cpp's CUDA build. No CI machine
// has an NVIDIA GPU or the 143 MB package, so what runs everywhere is what a user without them
// meets: the package missing, and (through the real dlopen of the probe, on the Vulkan build's
// directory) the driver and CUDA's libraries missing, each named with what to install. With the
// package at hand (MOESWARM_GGML_CUDA_DIR) the real probe runs too: on a GPU machine it must find
// CUDA0 and its memory, elsewhere it must name the driver. The compute itself is checked against
// the f64 oracle by scripts/gpu-check.py on a GPU machine.

import { existsSync } from "node:fs";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import { CUDA_BUILD } from "../src/cuda.js";
import { gpuDriverError, probeGpuBuild } from "../src/gpu-build.js";
import {
  BACKEND_CHOICES,
  CUDA_PACKAGE,
  CUDA_TYPES,
  loadExpertCompute,
  probeCuda,
  VULKAN_TYPES,
  vulkanBinsDir,
} from "../src/index.js";

const tmp = tempDir("moeswarm-wn-cuda-");
afterAll(() => tmp.remove());

const hasDriver = ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1"].some((p) =>
  existsSync(p),
);

describe("cuda backend without its package", () => {
  it("is a backend choice, serving the types Vulkan serves", () => {
    expect(BACKEND_CHOICES).toContain("cuda");
    expect(CUDA_PACKAGE).toBe("@node-llama-cpp/linux-x64-cuda");
    expect(CUDA_TYPES).toEqual(VULKAN_TYPES);
  });

  it("refuses with MOESWARM_NATIVE_GPU_PACKAGE_MISSING naming the npm package and the variable", async () => {
    await expect(probeCuda({ binsDir: tmp.dir })).rejects.toMatchObject({
      code: "MOESWARM_NATIVE_GPU_PACKAGE_MISSING",
      message: expect.stringMatching(
        /npm install @node-llama-cpp\/linux-x64-cuda@3\.21\.1[\s\S]*MOESWARM_GGML_CUDA_DIR/,
      ),
    });
    const env = process.env.MOESWARM_GGML_CUDA_DIR;
    process.env.MOESWARM_GGML_CUDA_DIR = tmp.dir;
    try {
      await expect(loadExpertCompute(`${tmp.dir}/none.gguf`, { backend: "cuda" })).rejects.toMatchObject({
        code: "MOESWARM_NATIVE_GPU_PACKAGE_MISSING",
      });
    } finally {
      if (env === undefined) delete process.env.MOESWARM_GGML_CUDA_DIR;
      else process.env.MOESWARM_GGML_CUDA_DIR = env;
    }
  });
});

let vkDir: string | undefined;
try {
  vkDir = vulkanBinsDir();
} catch (error) {
  console.warn(`skipping the CUDA driver detection on a ggml build directory: ${(error as Error).message}`);
}

describe("cuda backend without the driver", () => {
  // The probe dlopens each of CUDA_BUILD's runtime libraries before loading anything; run on the
  // Vulkan build's directory (a real ggml build, 27 MB, a dev dependency) with CUDA's list.
  it.skipIf(vkDir === undefined || hasDriver)(
    "names libcuda.so.1 and what provides it (MOESWARM_NATIVE_GPU_DRIVER)",
    async () => {
      const build = { ...CUDA_BUILD, library: "libggml-vulkan.so" };
      const error = await probeGpuBuild(build, { binsDir: vkDir as string }).then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(error).toMatchObject({
        code: "MOESWARM_NATIVE_GPU_DRIVER",
        message: expect.stringMatching(/missing libcuda\.so\.1 \(the NVIDIA driver, version 580/),
      });
      expect((error as { details: { missing: string[] } }).details.missing).toContain("libcuda.so.1");
    },
  );

  it("the error lists every missing library with its provider, and the way out", () => {
    const e = gpuDriverError(CUDA_BUILD, [{ lib: "libcuda.so.1" }, { lib: "libcublas.so.13" }], "/x");
    expect(e.code).toBe("MOESWARM_NATIVE_GPU_DRIVER");
    expect(e.message).toContain("libcublas.so.13 (cuBLAS 13, NVIDIA's libcublas-13-0 package)");
    expect(e.message).toMatch(/possible solutions: install the NVIDIA driver[\s\S]*--backend auto/);
  });

  const realDir = process.env.MOESWARM_GGML_CUDA_DIR;
  if (!realDir)
    console.warn("skipping the real CUDA probe: set MOESWARM_GGML_CUDA_DIR to the package's bins");
  it.skipIf(!realDir)(
    "the real package: finds CUDA0 on a GPU machine, names the driver elsewhere",
    async () => {
      const result = await probeCuda().then(
        (status) => ({ status }),
        (error: unknown) => ({ error }),
      );
      if (hasDriver) {
        expect("status" in result && result.status.devices[0]?.name).toBe("CUDA0");
        if ("status" in result) expect(result.status.vramBytes).toBeGreaterThan(0);
      } else {
        expect("error" in result && result.error).toMatchObject({ code: "MOESWARM_NATIVE_GPU_DRIVER" });
      }
    },
  );
});

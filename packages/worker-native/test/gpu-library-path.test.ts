// The GPU worker's library path: node-llama-cpp's GPU packages ship `libggml.<gpu>.v0.4.0.so`, not
// the `libggml.v0.4.0.so` the executable needs, and the executable carries no run path, so the CPU
// package's directory must follow the GPU one (vulkan.test.ts runs the real thing on lavapipe).
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import { gpuLibraryPath } from "../src/gpu-build.js";
import { llamaCppBinsDir } from "../src/index.js";

let cpu: string | undefined;
try {
  cpu = llamaCppBinsDir();
} catch (error) {
  console.warn(`skipping: node-llama-cpp's CPU package is not installed (${(error as Error).message})`);
}

describe.skipIf(cpu === undefined)("gpuLibraryPath", () => {
  const tmp = tempDir("moeswarm-gpu-libpath-");
  afterAll(() => tmp.remove());

  it("adds the CPU package's directory when the GPU package lacks libggml.v*.so, before what was inherited", () => {
    const gpu = join(tmp.dir, "vulkan");
    mkdirSync(gpu);
    writeFileSync(join(gpu, "libggml.vulkan.v0.4.0.so"), "");
    expect(gpuLibraryPath(gpu, {})).toBe(cpu);
    expect(gpuLibraryPath(gpu, { LD_LIBRARY_PATH: "/opt/x" })).toBe(`${cpu}:/opt/x`);
  });

  it("adds nothing when the GPU package has its own libggml.v*.so", () => {
    const gpu = join(tmp.dir, "full");
    mkdirSync(gpu);
    writeFileSync(join(gpu, "libggml.v0.4.0.so"), "");
    expect(gpuLibraryPath(gpu, {})).toBeUndefined();
    expect(gpuLibraryPath(gpu, { LD_LIBRARY_PATH: "/opt/x" })).toBe("/opt/x");
  });
});

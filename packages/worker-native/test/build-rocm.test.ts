// scripts/build-rocm.sh --check: the ROCm build's preflight, runnable on any machine. Here (Debian 12:
// HIP 5.2 at most, no rocBLAS/hipBLAS packages) it must refuse and name each missing piece; on a
// ROCm >= 6.1 machine it says it is ready.
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { describe, expect, it } from "vitest";

describe("scripts/build-rocm.sh --check", () => {
  it("says exactly what the pinned ggml-hip lacks here, or that the machine is ready", () => {
    const r = spawnSync("sh", [join(import.meta.dirname, "..", "scripts", "build-rocm.sh"), "--check"], {
      encoding: "utf8",
    });
    if (r.status === 0) {
      expect(r.stdout).toMatch(/^build-rocm: ready \(HIP \d+\.\d+/m);
      return;
    }
    expect(r.status, r.stderr).toBe(3);
    expect(r.stderr).toMatch(/cannot build the pinned ggml-hip; missing:/);
    // every line names a piece and why ggml-hip needs it
    for (const line of r.stderr.trim().split("\n").slice(1)) {
      expect(line).toMatch(
        /^ {2}- (HIP >= 6\.1|hipconfig\/hipcc|hip's CMake|hipblas's CMake|rocblas's CMake|CMake >= 3\.21)/,
      );
    }
    expect(r.stderr).toMatch(/rocblas's CMake package/);
  });
});

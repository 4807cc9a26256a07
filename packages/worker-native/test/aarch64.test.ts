import { execFileSync, spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { cosine, relL2 } from "@moeswarm/core";
import { GgmlType, ggmlTypeName } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { expertWorkerPath, spawnExpertWorker } from "../src/index.js";
import { type Fixture, normals, randomIds, randomWeights, writeModel, writeSlice } from "./fixtures.js";

// The static aarch64 executables (android-arm64) run here under qemu-user and are compared with
// the x86-64 build on the same slices. SIMD kernels sum in another order on each architecture,
// so the bound is a relative L2 error, not bit identity.
const QEMU = "qemu-aarch64-static";
const variants = { armv8a: "", armv82: "" };
let skip: string | undefined;
if (spawnSync("sh", ["-c", `command -v ${QEMU}`]).status !== 0) {
  skip = `${QEMU} is not installed (Debian: apt-get install qemu-user-static)`;
} else {
  try {
    variants.armv8a = expertWorkerPath({ target: "android-arm64", variant: "armv8a" });
    variants.armv82 = expertWorkerPath({ target: "android-arm64", variant: "armv82" });
  } catch (error) {
    skip = `the aarch64 executables are not built (needs g++-aarch64-linux-gnu): ${(error as Error).message}`;
  }
}
let x86: string | undefined;
try {
  x86 = expertWorkerPath({ target: "linux-x64" });
} catch {
  skip ??= "the linux-x64 executable is not built";
}
if (process.platform !== "linux" || process.arch !== "x64") skip ??= "the reference build is linux-x64";
if (skip) console.warn(`skipping the aarch64 (qemu) tests: ${skip}`);

const N_EMBD = 256;
const N_FF = 256;
const K = 4;
// Measured: ~1e-7 for the quantised types (SIMD summation order). F16 weights take the activations
// as f16 too, where a 1e-7 difference flips an f16 rounding now and then (1 ulp = 1e-3): ~1e-5.
const REL_L2_BOUND = 1e-5;
const REL_L2_BOUND_F16 = 5e-5;

describe.skipIf(Boolean(skip))("android-arm64 executables under qemu-user", () => {
  const tmp = tempDir("moeswarm-wn-");
  const slices = new Map<GgmlType, string>();
  const measured: string[] = [];

  beforeAll(async () => {
    for (const type of [GgmlType.Q4_K, GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.F16, GgmlType.Q6_K]) {
      const model: Fixture = await writeModel(
        { type, nEmbd: N_EMBD, nFf: N_FF, nExpert: 6, layers: [4], seed: 300 + type },
        tmp.dir,
      );
      const path = join(tmp.dir, `slice-${type}.gguf`);
      await writeSlice(model, [1, 4, 5], [4], path);
      slices.set(type, path);
    }
  });
  afterAll(() => {
    if (measured.length) console.log(`aarch64 (qemu) vs x86-64, relative L2: ${measured.join("; ")}`);
    tmp.remove();
  });

  it("the baseline binary knows which sibling to hand over to", () => {
    expect(execFileSync(QEMU, [variants.armv8a, "--version"], { encoding: "utf8" })).not.toMatch(/dotprod/);
    expect(execFileSync(QEMU, [variants.armv82, "--version"], { encoding: "utf8" })).toMatch(/dotprod/);
    // qemu's default CPU has dotprod: the armv82 sibling is the target
    const target = execFileSync(QEMU, [variants.armv8a, "--dispatch-target"], { encoding: "utf8" }).trim();
    expect(target).toBe(variants.armv82);
    const off = execFileSync(QEMU, [variants.armv8a, "--dispatch-target"], {
      encoding: "utf8",
      env: { ...process.env, MOESWARM_NO_DISPATCH: "1" },
    }).trim();
    expect(off).toBe("self");
    expect(existsSync(variants.armv82)).toBe(true);
  });

  for (const variant of ["armv8a", "armv82"] as const) {
    it(`${variant}: matches the x86-64 build within ${REL_L2_BOUND} relative L2 (${REL_L2_BOUND_F16} for f16)`, async () => {
      for (const [type, slice] of slices) {
        await using arm = await spawnExpertWorker(variants[variant], slice, {
          launcher: QEMU,
          threads: 2,
          env: { MOESWARM_NO_DISPATCH: "1" },
        });
        await using ref = await spawnExpertWorker(x86!, slice, { threads: 2 });
        const n = 6;
        const x = normals(n * N_EMBD, 40 + type);
        const ids = randomIds(n, K, [1, 4, 5, 2, 3], 50 + type).map((id) =>
          [1, 4, 5].includes(id) ? id : -1,
        );
        const w = randomWeights(n, K, 60);
        for (const mode of ["each", "sum"] as const) {
          const req = { layer: 4, x, ids, k: K, w: w, mode };
          const [a, b] = await Promise.all([arm.run(req), ref.run(req)]);
          const rel = relL2(a, b);
          if (mode === "each") measured.push(`${variant} ${ggmlTypeName(type)} ${rel.toExponential(2)}`);
          const bound = type === GgmlType.F16 ? REL_L2_BOUND_F16 : REL_L2_BOUND;
          expect(rel, `${variant} ${ggmlTypeName(type)} ${mode}`).toBeLessThanOrEqual(bound);
          expect(cosine(a, b)).toBeGreaterThan(0.99999);
        }
      }
    });
  }
});

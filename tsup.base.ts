import type { Options } from "tsup";

/** One build shape for every package: ESM + CJS + .d.ts + sourcemaps, node20 target. */
export function packageBuild(overrides: Options = {}): Options {
  return {
    entry: ["src/index.ts"],
    format: ["esm", "cjs"],
    dts: true,
    sourcemap: true,
    clean: true,
    target: "node20",
    platform: "node",
    splitting: false,
    shims: true,
    ...overrides,
  };
}

import { defineConfig } from "tsup";
import { packageBuild } from "../../tsup.base.ts";

export default defineConfig([
  packageBuild(),
  // The `moeswarm-worker` bin: one ESM file (esbuild keeps the entry's #! line), no types.
  packageBuild({
    entry: { "worker-cli": "src/cli-main.ts" },
    format: ["esm"],
    dts: false,
    clean: false,
  }),
]);

import { defineConfig } from "tsup";
import { packageBuild } from "../../tsup.base.ts";

export default defineConfig([
  packageBuild(),
  // The `moeswarm-dispatcher` bin: one ESM file (esbuild keeps the entry's #! line), no types.
  packageBuild({ entry: { dispatcher: "src/cli/main.ts" }, format: ["esm"], dts: false, clean: false }),
]);

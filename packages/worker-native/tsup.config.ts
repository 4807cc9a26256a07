import { defineConfig } from "tsup";
import { packageBuild } from "../../tsup.base.ts";

export default defineConfig(packageBuild());

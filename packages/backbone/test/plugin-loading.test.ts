// The plugin loads into any llama.cpp of the pinned commit, whatever its libggml-base is called
// (node-llama-cpp: libggml-base.so; upstream: libggml-base.so.0): it must name no libggml library
// as a dependency, and export only the two entry points ggml_backend_load looks up.
import { spawnSync } from "node:child_process";
import { describe, expect, it } from "vitest";
import { pluginPath } from "../src/native-paths.js";
import { nativeMissing } from "./helpers.js";

const missing = nativeMissing();
const readelf = spawnSync("readelf", ["--version"]).status === 0;
if (!readelf) console.warn("skipping the plugin's ELF checks: no readelf (binutils)");

describe.skipIf(Boolean(missing) || !readelf)("libggml-moeswarm.so's dynamic section", () => {
  it("needs no libggml by name and exports only ggml_backend_init and ggml_backend_score", () => {
    const dynamic = spawnSync("readelf", ["-dW", pluginPath()], { encoding: "utf8" }).stdout;
    const needed = [...dynamic.matchAll(/\(NEEDED\)\s+Shared library: \[([^\]]+)\]/g)].map((m) => m[1]);
    expect(needed).toContain("libc.so.6");
    expect(needed.filter((n) => /ggml|llama/.test(n!))).toEqual([]);
    const symbols = spawnSync("readelf", ["--dyn-syms", "-W", pluginPath()], { encoding: "utf8" }).stdout;
    const defined = symbols
      .split("\n")
      .map((l) => l.trim().split(/\s+/))
      .filter((f) => f.length >= 8 && f[6] !== "UND" && f[4] === "GLOBAL")
      .map((f) => f[7]!.replace(/@.*/, ""));
    expect(defined.sort()).toEqual(["ggml_backend_init", "ggml_backend_score"]);
  });
});

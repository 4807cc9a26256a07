import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { NativeError } from "@moeswarm/core";

/**
 * The directory of @moeswarm/worker-native, which builds and ships every native binary of moeswarm
 * (one CMake project): the plugin and the harness are in its prebuilds, beside the addon.
 */
function workerNativeRoot(): string {
  const require = createRequire(import.meta.url);
  return dirname(require.resolve("@moeswarm/worker-native/package.json"));
}

function prebuilt(name: string): string {
  if (process.platform !== "linux" || process.arch !== "x64") {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `${name} is built for linux-x64 (node-llama-cpp's CPU binaries), this is ${process.platform}-${process.arch}`,
    );
  }
  const path = join(workerNativeRoot(), "prebuilds", "linux-x64", name);
  if (!existsSync(path)) {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `${path} does not exist\n  possible solution: pnpm --filter @moeswarm/worker-native build (needs cmake, g++ and node-llama-cpp@3.21.1)`,
    );
  }
  return path;
}

/**
 * Path of `libggml-moeswarm.so`, the ggml backend plugin: give it to llama.cpp (llama-server,
 * node-llama-cpp) as `GGML_BACKEND_PATH`.
 */
export function pluginPath(): string {
  return prebuilt("libggml-moeswarm.so");
}

/** Path of `llama-logits`, the greedy-decoding harness over node-llama-cpp's libllama. */
export function logitsHarnessPath(): string {
  return prebuilt("llama-logits");
}

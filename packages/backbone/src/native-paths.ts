import { existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { NativeError } from "@moeswarm/core";

/** The package's root directory (dist/.. or src/..). */
export function packageRoot(): string {
  return resolve(dirname(fileURLToPath(import.meta.url)), "..");
}

function prebuilt(name: string, what: string): string {
  if (process.platform !== "linux" || process.arch !== "x64") {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `${what} is built for linux-x64 (node-llama-cpp's CPU binaries), this is ${process.platform}-${process.arch}`,
    );
  }
  const path = join(packageRoot(), "prebuilds", "linux-x64", name);
  if (!existsSync(path)) {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `${path} does not exist\n  possible solution: pnpm --filter @moeswarm/backbone build (needs cmake, g++ and node-llama-cpp@3.21.1)`,
    );
  }
  return path;
}

/**
 * Path of `libggml-moeswarm.so`, the ggml backend plugin: give it to llama.cpp (llama-server,
 * node-llama-cpp) as `GGML_BACKEND_PATH`.
 */
export function pluginPath(): string {
  return prebuilt("libggml-moeswarm.so", "libggml-moeswarm.so");
}

/** Path of `llama-logits`, the greedy-decoding harness over node-llama-cpp's libllama. */
export function logitsHarnessPath(): string {
  return prebuilt("llama-logits", "llama-logits");
}

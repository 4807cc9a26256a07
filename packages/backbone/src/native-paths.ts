import { NativeError } from "@moeswarm/core";
import { prebuiltPath } from "@moeswarm/worker-native";

/**
 * The plugin and the harness ship in @moeswarm/worker-native-linux-x64, beside the addon: one CMake
 * project builds every native binary of moeswarm, and both link against node-llama-cpp's linux-x64
 * libggml-base, so they exist for that platform only (~250 kB, not worth a package of their own).
 */
function prebuilt(name: string): string {
  if (process.platform !== "linux" || process.arch !== "x64") {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `${name} is built for linux-x64 (node-llama-cpp's CPU binaries), this is ${process.platform}-${process.arch}`,
    );
  }
  return prebuiltPath("linux-x64", name);
}

/**
 * Path of `libggml-moeswarm.so`, the ggml backend plugin: give it to llama.cpp (llama-server,
 * node-llama-cpp) as `GGML_BACKEND_PATH`. NativeError MOESWARM_NATIVE_PACKAGE_MISSING names the
 * package to install when it is missing.
 */
export function pluginPath(): string {
  return prebuilt("libggml-moeswarm.so");
}

/** Path of `llama-logits`, the greedy-decoding harness over node-llama-cpp's libllama. */
export function logitsHarnessPath(): string {
  return prebuilt("llama-logits");
}

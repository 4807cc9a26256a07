import { existsSync } from "node:fs";
import { probeNative } from "./native-binding.js";
import { expertWorkerPath } from "./worker-binary.js";

/**
 * What "auto" computes with when the addon is or is not available: the addon; else the static
 * `moeswarm-expert-worker` where this platform has one (Android/Termux's bionic, musl, a host the
 * glibc addon does not load on: the executable needs no libc of the host); else TypeScript, ~50x
 * slower than either. Pure, for tests; {@link staticWorkerFallback} asks the machine.
 */
export function autoBackendFor(
  nativeAvailable: boolean,
  executable: string | undefined,
): "native" | "worker" | "ts" {
  if (nativeAvailable) return "native";
  return executable !== undefined ? "worker" : "ts";
}

/** The executable "auto" runs, or undefined when the platform has none. */
export function staticWorkerExecutable(): string | undefined {
  try {
    const path = expertWorkerPath();
    return existsSync(path) ? path : undefined;
  } catch {
    return undefined;
  }
}

/** True when "auto" should run the static executable here: the addon cannot load, the executable exists. */
export async function staticWorkerFallback(signal?: AbortSignal): Promise<boolean> {
  const status = await probeNative(signal ? { signal } : {});
  return autoBackendFor(status.available, staticWorkerExecutable()) === "worker";
}

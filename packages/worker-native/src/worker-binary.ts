import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { NativeError } from "@moeswarm/core";
import { packageRoot } from "./native-binding.js";

/** Prebuilt executables: linux-x64, and static aarch64 builds for android-arm64 and linux-arm64. */
export type WorkerTarget = "linux-x64" | "linux-arm64" | "android-arm64";

/** aarch64 builds: armv8-a runs everywhere; armv82 (armv8.2-a+dotprod) on cores with dotprod. */
export type ArmVariant = "armv8a" | "armv82";

export interface ExpertWorkerPathOptions {
  /** Default: this host's platform and architecture. */
  target?: WorkerTarget;
  /**
   * aarch64 only. "auto" (default) picks armv82 when /proc/cpuinfo lists asimddp on an aarch64
   * host, else armv8a (whose binary itself re-executes armv82 when the CPU has dotprod).
   */
  variant?: ArmVariant | "auto";
}

/** Which aarch64 build suits a CPU, from the text of its /proc/cpuinfo (the Features line). */
export function armVariantFor(cpuinfo: string): ArmVariant {
  const features = new Set(
    cpuinfo
      .split("\n")
      .filter((l) => /^features\s*:/i.test(l))
      .flatMap((l) =>
        l
          .slice(l.indexOf(":") + 1)
          .trim()
          .split(/\s+/),
      ),
  );
  return features.has("asimddp") ? "armv82" : "armv8a";
}

function hostTarget(): WorkerTarget | undefined {
  if (process.platform === "linux" && process.arch === "x64") return "linux-x64";
  if (process.platform === "linux" && process.arch === "arm64") return "linux-arm64";
  if (process.platform === "android" && process.arch === "arm64") return "android-arm64";
  return undefined;
}

/** Path of the prebuilt moeswarm-expert-worker for a target (default: this host). */
export function expertWorkerPath(options: ExpertWorkerPathOptions = {}): string {
  const target = options.target ?? hostTarget();
  if (!target) {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `no prebuilt moeswarm-expert-worker for ${process.platform}-${process.arch}: build it from source (pnpm --filter @moeswarm/worker-native build)`,
    );
  }
  let variant = options.variant ?? "auto";
  if (variant === "auto") {
    variant = "armv8a";
    if (target !== "linux-x64" && process.arch === "arm64" && existsSync("/proc/cpuinfo")) {
      variant = armVariantFor(readFileSync("/proc/cpuinfo", "utf8"));
    }
  }
  const name =
    target !== "linux-x64" && variant === "armv82"
      ? "moeswarm-expert-worker-armv82"
      : "moeswarm-expert-worker";
  const path = join(packageRoot(), "prebuilds", target, name);
  if (!existsSync(path)) {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `${path} does not exist: build it (pnpm --filter @moeswarm/worker-native build; aarch64 needs g++-aarch64-linux-gnu)`,
    );
  }
  return path;
}

import { existsSync, readFileSync } from "node:fs";
import { NativeError } from "@moeswarm/core";
import { hostTarget, NATIVE_TARGETS, type NativeTarget, prebuiltPath } from "./prebuilt.js";

/**
 * Prebuilt executables: linux-x64, and static aarch64 builds for android-arm64 and linux-arm64
 * (the same static ELF files: they need no libc, so they run under Termux's bionic too).
 */
export type WorkerTarget = NativeTarget;

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

/**
 * Path of the prebuilt moeswarm-expert-worker for a target (default: this host), from the target's
 * platform package (`@moeswarm/worker-native-<target>`); NativeError MOESWARM_NATIVE_PACKAGE_MISSING
 * with the `npm install` line when that package is not installed.
 */
export function expertWorkerPath(options: ExpertWorkerPathOptions = {}): string {
  const target = options.target ?? hostTarget();
  if (!target) {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `there is no prebuilt moeswarm-expert-worker for ${process.platform}-${process.arch} (prebuilt: ${NATIVE_TARGETS.join(", ")}); the TypeScript compute path works everywhere: loadExpertCompute(slicePath, { backend: "ts" })`,
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
  return prebuiltPath(target, name);
}

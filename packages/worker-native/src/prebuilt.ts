import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { NativeError } from "@moeswarm/core";

// Prebuilt binaries arrive as esbuild, sharp and node-llama-cpp ship theirs: one package per
// platform (@moeswarm/worker-native-<target>), an optional dependency of this one whose `os`/`cpu`/
// `libc` fields make npm and pnpm install only the user's. In the monorepo the native build writes
// the same files to this package's prebuilds/<target>/, the fallback when no platform package has
// them (and a stale copy cannot hide there: the build refreshes both).

/** The package directory, from dist/ (built) or src/ (tests). */
export function packageRoot(): string {
  return resolve(dirname(fileURLToPath(import.meta.url)), "..");
}

/** The platforms with prebuilt binaries, as `<process.platform>-<process.arch>`. */
export const NATIVE_TARGETS = ["linux-x64", "linux-arm64", "android-arm64"] as const;
export type NativeTarget = (typeof NATIVE_TARGETS)[number];

/** The npm package that carries a target's binaries. */
export function platformPackageName(target: NativeTarget): string {
  return `@moeswarm/worker-native-${target}`;
}

/** This host's target, or undefined where no prebuilt binaries exist. */
export function hostTarget(): NativeTarget | undefined {
  const t = `${process.platform}-${process.arch}`;
  return (NATIVE_TARGETS as readonly string[]).includes(t) ? (t as NativeTarget) : undefined;
}

/** The installed platform package's directory, or undefined (resolved from this package). */
export function platformPackageDir(target: NativeTarget): string | undefined {
  try {
    const require = createRequire(join(packageRoot(), "package.json"));
    return dirname(require.resolve(`${platformPackageName(target)}/package.json`));
  } catch {
    return undefined;
  }
}

/** Where a file of a target is looked for, in order: the platform package, then prebuilds/. */
export function prebuiltCandidates(target: NativeTarget, file: string): string[] {
  const dir = platformPackageDir(target);
  return [...(dir ? [join(dir, file)] : []), join(packageRoot(), "prebuilds", target, file)];
}

/**
 * The `npm install` line that brings a target's binaries; another platform's package needs npm's
 * `--os`/`--cpu` overrides (npm refuses a package whose `os`/`cpu` do not match otherwise).
 */
export function installHint(target: NativeTarget): string {
  if (target === hostTarget()) return `npm install ${platformPackageName(target)}`;
  const [os, cpu] = target.split("-");
  return `npm install --os=${os} --cpu=${cpu} ${platformPackageName(target)}`;
}

/**
 * Path of a prebuilt binary of a target (`file` relative to the platform package, e.g.
 * "moeswarm-expert-worker" or "llama-cpu/moeswarm_expert_llama.node"), or NativeError
 * MOESWARM_NATIVE_PACKAGE_MISSING naming the package to install.
 */
export function prebuiltPath(target: NativeTarget, file: string): string {
  const candidates = prebuiltCandidates(target, file);
  const found = candidates.find((p) => existsSync(p));
  if (found) return found;
  const pkg = platformPackageName(target);
  const installed = platformPackageDir(target) !== undefined;
  const why = installed
    ? `${pkg} is installed but has no ${file} (a damaged or mismatched install)`
    : `${pkg} is not installed (npm installs it with @moeswarm/worker-native on ${target}, unless optional dependencies were omitted)`;
  throw new NativeError(
    "MOESWARM_NATIVE_PACKAGE_MISSING",
    `${file} for ${target} was not found: ${why}\n  possible solution: ${installHint(target)}\n  looked in: ${candidates.join(", ")}`,
    { details: { target, file, package: pkg, candidates } },
  );
}

/** Like {@link prebuiltPath} for this host; NativeError MOESWARM_NATIVE_LOAD where no prebuilds exist. */
export function hostPrebuiltPath(file: string, what = file): string {
  const target = hostTarget();
  if (!target) {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      `there is no prebuilt ${what} for ${process.platform}-${process.arch} (prebuilt: ${NATIVE_TARGETS.join(", ")})`,
    );
  }
  return prebuiltPath(target, file);
}

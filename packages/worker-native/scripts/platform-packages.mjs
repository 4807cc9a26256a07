#!/usr/bin/env node
// The platform packages (packages/worker-native-<target>/) carry the prebuilt binaries that npm
// installs for one platform each. Their package.json is the one list of what they carry: `files`
// (the binaries), `publishConfig.executableFiles` (the executables, which pnpm otherwise packs
// without their run bit). The binaries are build outputs, git-ignored: the native build writes
// them to ../prebuilds/<target>/ and here; `stage` copies them over again and fails on any missing
// one, so that no release ships an empty platform package.
//
//   node scripts/platform-packages.mjs stage [target...]   copy prebuilds/<target>/ into the
//                                                          package (default: the one in cwd)
//   node scripts/platform-packages.mjs check [target...]   only verify (default: every target)
import {
  chmodSync,
  copyFileSync,
  existsSync,
  mkdirSync,
  readFileSync,
  renameSync,
  rmSync,
  statSync,
} from "node:fs";
import { basename, dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const pkgDir = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const PREFIX = "@moeswarm/worker-native-";

/** Every platform package of the repository: { target, dir, files, executables }. */
export function platformPackages() {
  const targets = ["linux-x64", "linux-arm64", "android-arm64"];
  return targets.map((target) => platformPackage(join(pkgDir, "..", `worker-native-${target}`)));
}

export function platformPackage(dir) {
  const pkg = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
  if (!pkg.name.startsWith(PREFIX)) throw new Error(`${dir} is not a platform package (${pkg.name})`);
  return {
    name: pkg.name,
    target: pkg.name.slice(PREFIX.length),
    dir,
    files: pkg.files,
    executables: pkg.publishConfig?.executableFiles ?? [],
    os: pkg.os,
    cpu: pkg.cpu,
  };
}

/** Copies a file by a rename over the target (a running executable cannot be overwritten). */
export function installFile(src, dst, mode) {
  mkdirSync(dirname(dst), { recursive: true });
  const tmp = join(dirname(dst), `.${basename(dst)}.${process.pid}.tmp`);
  try {
    copyFileSync(src, tmp);
    chmodSync(tmp, mode);
    renameSync(tmp, dst);
  } catch (error) {
    rmSync(tmp, { force: true });
    throw error;
  }
}

/** Missing files of a platform package, as "name: file" lines (none: it is complete). */
export function missingFiles(p) {
  return p.files.filter((f) => !existsSync(join(p.dir, f)) || statSync(join(p.dir, f)).size === 0);
}

/**
 * Copies a platform package's files from prebuilds/<target>/ (where newer or absent) and sets the
 * run bit of its executables. Returns the files still missing afterwards.
 */
export function stage(p) {
  for (const file of p.files) {
    const src = join(pkgDir, "prebuilds", p.target, file);
    const dst = join(p.dir, file);
    const mode = p.executables.includes(file) ? 0o755 : 0o644;
    if (existsSync(src) && (!existsSync(dst) || statSync(src).mtimeMs > statSync(dst).mtimeMs)) {
      installFile(src, dst, mode);
    } else if (existsSync(dst)) {
      chmodSync(dst, mode);
    }
  }
  return missingFiles(p);
}

function main() {
  const [command, ...targets] = process.argv.slice(2);
  if (command !== "stage" && command !== "check") {
    process.stderr.write("usage: platform-packages.mjs stage|check [target...]\n");
    process.exit(2);
  }
  let packages;
  if (targets.length > 0) {
    packages = platformPackages().filter((p) => targets.includes(p.target));
  } else if (command === "stage") {
    packages = [platformPackage(process.cwd())];
  } else {
    packages = platformPackages();
  }
  let failed = false;
  for (const p of packages) {
    const missing = command === "stage" ? stage(p) : missingFiles(p);
    if (missing.length > 0) {
      failed = true;
      process.stderr.write(
        `[worker-native] ${p.name} lacks ${missing.join(", ")}: build them first (node packages/worker-native/scripts/build-native.mjs with MOESWARM_NATIVE_TARGETS=${p.target}; aarch64 needs g++-aarch64-linux-gnu)\n`,
      );
    } else {
      process.stdout.write(
        `[worker-native] ${p.name}: ${p.files.length} files ${command === "stage" ? "staged" : "present"}\n`,
      );
    }
  }
  if (failed) process.exit(1);
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) main();

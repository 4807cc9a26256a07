#!/usr/bin/env node
// Builds every native binary of moeswarm (one CMake project, CMakeLists.txt) from the pinned
// llama.cpp source:
//   linux-x64      the N-API addon and moeswarm-expert-worker (x86-64-v3: AVX2, FMA, F16C, BMI2),
//                  and against node-llama-cpp's shared libggml-base/libggml: moeswarm-expert-worker-llama
//                  and its addon, computing with the libggml-cpu-<variant>.so llama.cpp picks (the
//                  "llama-cpu" backend, bit-identical to llama.cpp on this machine), the backbone's
//                  ggml backend plugin libggml-moeswarm.so and the logits harness llama-logits
//   android-arm64  moeswarm-expert-worker, static, armv8-a (+ the linux-arm64 addon from the same
//                  build) and armv8.2-a+dotprod (picked at start by the armv8-a binary)
// into prebuilds/<platform>-<arch>/ (prebuildify's layout: node-gyp-build finds the addon there).
// Build directories live in build/<variant>/ and are reused: a rebuild only compiles what changed.
//
// Environment:
//   MOESWARM_NATIVE_TARGETS  comma list of linux-x64, linux-arm64, android-arm64 (default: the host's,
//                            plus android-arm64 on x64 when aarch64-linux-gnu-g++ is installed)
//   MOESWARM_NATIVE_SKIP=1   build nothing native (the TypeScript compute path still works)
//   MOESWARM_NATIVE_JOBS     parallel compile jobs (default: number of CPUs)
//   CI                       a missing g++ or cmake is an error instead of a skip
import { execFileSync, spawnSync } from "node:child_process";
import {
  chmodSync,
  copyFileSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  realpathSync,
  renameSync,
  rmSync,
  writeFileSync,
} from "node:fs";
import { availableParallelism } from "node:os";
import { basename, dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { LLAMA_CPP_COMMIT, llamaSourceDir } from "../../../tools/llama-source.mjs";
import { platformPackages, stage } from "./platform-packages.mjs";

const pkgDir = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const strict = Boolean(process.env.CI);
const jobs = Number(process.env.MOESWARM_NATIVE_JOBS) || availableParallelism();

function log(line) {
  process.stdout.write(`[worker-native] ${line}\n`);
}

function have(cmd) {
  return spawnSync("sh", ["-c", `command -v ${cmd}`], { stdio: "ignore" }).status === 0;
}

function skipOrFail(reason, fix) {
  const text = `${reason}\n  possible solution: ${fix}`;
  if (strict) {
    process.stderr.write(`[worker-native] error: ${text}\n`);
    process.exit(1);
  }
  log(`skipping: ${text}`);
}

// x86-64-v3: GGML_NATIVE=OFF still turns these on; saying so keeps the baseline explicit
export const X86_V3 = {
  GGML_NATIVE: "OFF",
  GGML_SSE42: "ON",
  GGML_AVX: "ON",
  GGML_AVX2: "ON",
  GGML_BMI2: "ON",
  GGML_FMA: "ON",
  GGML_F16C: "ON",
  GGML_AVX_VNNI: "OFF",
  GGML_AVX512: "OFF",
};

/** node-llama-cpp's prebuilt binaries for this host (libggml-base.so, libggml-cpu-*.so...), or undefined. */
function llamaBinsDir() {
  const link = join(pkgDir, "node_modules", "node-llama-cpp");
  if (!existsSync(link) || process.platform !== "linux") return undefined;
  const plat = `linux-${process.arch}`;
  // pnpm places a package's dependencies beside it in the virtual store
  const dir = join(dirname(realpathSync(link)), "@node-llama-cpp", plat, "bins", plat);
  return existsSync(join(dir, "libggml-base.so")) ? dir : undefined;
}

/**
 * Everything built against node-llama-cpp's shared ggml (MOESWARM_GGML=shared): the "llama-cpu"
 * worker and addon, the backbone's ggml backend plugin (linked to the host's libggml-base only)
 * and, when node-llama-cpp ships a libllama, the logits harness.
 */
function llamaVariant(bins, addon) {
  const defs = {
    MOESWARM_GGML: "shared",
    MOESWARM_GGML_BASE_LIB: join(bins, "libggml-base.so"),
    MOESWARM_PLUGIN: "ON",
    ...addon,
  };
  const copy = [
    ["moeswarm-expert-worker-llama", "linux-x64/moeswarm-expert-worker-llama"],
    ["moeswarm_expert_llama.node", "linux-x64/llama-cpu/moeswarm_expert_llama.node"],
    ["libggml-moeswarm.so", "linux-x64/libggml-moeswarm.so"],
  ];
  const libllama = readdirSync(bins).find((f) => /^libllama(\.v[\d.]+)?\.so$/.test(f));
  if (libllama) {
    defs.MOESWARM_LLAMA_LIB = join(bins, libllama);
    copy.push(["llama-logits", "linux-x64/llama-logits"]);
  } else {
    skipOrFail(`no libllama*.so in ${bins}, so llama-logits is not built`, "reinstall node-llama-cpp@3.21.1");
  }
  return { name: "linux-x64-llama", defs, copy };
}

/** One CMake build directory and what to copy out of it (from its bin/). */
function variants(target, napiInclude) {
  const addon = { CMAKE_JS_INC: napiInclude };
  const toolchain = { CMAKE_TOOLCHAIN_FILE: join(pkgDir, "cmake", "toolchains", "aarch64-linux-gnu.cmake") };
  switch (target) {
    case "linux-x64": {
      const out = [
        {
          name: "linux-x64",
          // moeswarm-native-ping: the bench's native-plane client, built for the host only
          defs: { ...X86_V3, ...addon, MOESWARM_NATIVE_PING: "ON" },
          copy: [
            ["moeswarm_expert.node", "linux-x64/node.napi.glibc.node"],
            ["moeswarm-expert-worker", "linux-x64/moeswarm-expert-worker"],
            ["moeswarm-native-ping", "linux-x64/moeswarm-native-ping"],
          ],
        },
      ];
      const bins = llamaBinsDir();
      if (bins) {
        out.push(llamaVariant(bins, addon));
      } else {
        skipOrFail(
          "node-llama-cpp's prebuilt ggml was not found, so moeswarm-expert-worker-llama, libggml-moeswarm.so and llama-logits are not built",
          "pnpm install (node-llama-cpp is a devDependency)",
        );
      }
      return out;
    }
    case "linux-arm64":
      // native build on an aarch64 host: armv8-a runs on every 64-bit ARM board
      return [
        {
          name: "linux-arm64",
          defs: { GGML_NATIVE: "OFF", GGML_CPU_ARM_ARCH: "armv8-a", ...addon },
          copy: [
            ["moeswarm_expert.node", "linux-arm64/node.napi.glibc.node"],
            ["moeswarm-expert-worker", "linux-arm64/moeswarm-expert-worker"],
          ],
        },
      ];
    case "android-arm64":
      return [
        {
          name: "android-arm64-armv8a",
          defs: {
            ...toolchain,
            ...addon,
            GGML_CPU_ARM_ARCH: "armv8-a",
            MOESWARM_STATIC: "ON",
            MOESWARM_ARM_DISPATCH: "ON",
            MOESWARM_ARM_DISPATCH_SUFFIX: "-armv82",
          },
          copy: [
            ["moeswarm-expert-worker", "android-arm64/moeswarm-expert-worker"],
            // same static ELF; the addon from this build is the (untested here) linux-arm64 prebuild
            ["moeswarm-expert-worker", "linux-arm64/moeswarm-expert-worker"],
            ["moeswarm_expert.node", "linux-arm64/node.napi.glibc.node"],
          ],
        },
        {
          name: "android-arm64-armv82",
          defs: {
            ...toolchain,
            // no +fp16: ggml then accumulates f16 dot products in f16 (1e-3 off the x86 result)
            GGML_CPU_ARM_ARCH: "armv8.2-a+dotprod",
            MOESWARM_STATIC: "ON",
          },
          copy: [
            ["moeswarm-expert-worker", "android-arm64/moeswarm-expert-worker-armv82"],
            ["moeswarm-expert-worker", "linux-arm64/moeswarm-expert-worker-armv82"],
          ],
        },
      ];
    default:
      throw new Error(`unknown native target ${target} (linux-x64, linux-arm64, android-arm64)`);
  }
}

function defaultTargets() {
  const targets = [];
  if (process.platform === "linux" && process.arch === "x64") targets.push("linux-x64");
  if (process.platform === "linux" && process.arch === "arm64") targets.push("linux-arm64");
  if (process.arch === "x64") {
    // not an error even in CI: the aarch64 tests skip with the same reason printed
    if (have("aarch64-linux-gnu-g++")) targets.push("android-arm64");
    else
      log(
        "skipping android-arm64: aarch64-linux-gnu-g++ is not installed\n  possible solution: apt-get install g++-aarch64-linux-gnu (Debian/Ubuntu)",
      );
  }
  return targets;
}

export function napiIncludeString() {
  // cmake-js knows where node-api-headers and node-addon-api are (offline, `binary.napi_versions`)
  const out = execFileSync(join(pkgDir, "node_modules", ".bin", "cmake-js"), ["print-cmakejs-include"], {
    cwd: pkgDir,
    encoding: "utf8",
    stdio: ["ignore", "pipe", "ignore"],
  });
  const line = out
    .split("\n")
    .map((l) => l.trim())
    .find((l) => l.includes("node-api-headers"));
  if (!line) throw new Error("cmake-js did not report the node-api-headers include directory");
  return line;
}

function run(cmd, args, cwd) {
  const r = spawnSync(cmd, args, { cwd, stdio: "inherit" });
  if (r.status !== 0) {
    process.stderr.write(`[worker-native] failed: ${cmd} ${args.join(" ")}\n`);
    process.exit(r.status ?? 1);
  }
}

function buildVariant(v, llamaSrc) {
  const dir = join(pkgDir, "build", v.name);
  mkdirSync(dir, { recursive: true });
  const defs = { MOESWARM_LLAMA_SRC: llamaSrc, CMAKE_BUILD_TYPE: "Release", ...v.defs };
  const configureArgs = ["-S", pkgDir, "-B", dir, ...(have("ninja") ? ["-G", "Ninja"] : [])];
  for (const [k, value] of Object.entries(defs)) configureArgs.push(`-D${k}=${value}`);
  // reconfigure only when the arguments change: a configure of ggml costs seconds
  const stamp = join(dir, "moeswarm-configure.json");
  const want = JSON.stringify({ args: configureArgs, commit: LLAMA_CPP_COMMIT });
  const t0 = performance.now();
  if (
    !existsSync(join(dir, "CMakeCache.txt")) ||
    !existsSync(stamp) ||
    readFileSync(stamp, "utf8") !== want
  ) {
    // from a fresh cache: CMake keeps a cached toolchain file even when it moved. The objects stay,
    // and the build recompiles only what the new commands change.
    rmSync(join(dir, "CMakeCache.txt"), { force: true });
    rmSync(join(dir, "CMakeFiles"), { recursive: true, force: true });
    run("cmake", configureArgs, pkgDir);
    writeFileSync(stamp, want);
  }
  run("cmake", ["--build", dir, "--parallel", String(jobs)], pkgDir);
  for (const [from, to] of v.copy) {
    const src = join(dir, "bin", from);
    if (!existsSync(src)) {
      if (from.endsWith(".node") && !("CMAKE_JS_INC" in v.defs)) continue;
      throw new Error(`${v.name}: ${from} was not built`);
    }
    installBinary(src, join(pkgDir, "prebuilds", to));
  }
  log(`${v.name}: ${((performance.now() - t0) / 1000).toFixed(1)} s`);
}

/**
 * Copies a built binary over its prebuild: to a temporary file in the same directory, then a
 * rename over the target. Writing into the target itself fails with ETXTBSY while that executable
 * runs (a worker started from the prebuild), and would change a loaded addon's pages under a
 * process that has it mapped; a rename swaps the directory entry and leaves the old file to
 * whoever still runs it.
 */
function installBinary(src, dst) {
  mkdirSync(dirname(dst), { recursive: true });
  const tmp = join(dirname(dst), `.${basename(dst)}.${process.pid}.tmp`);
  try {
    copyFileSync(src, tmp);
    chmodSync(tmp, 0o755);
    renameSync(tmp, dst);
  } catch (error) {
    rmSync(tmp, { force: true });
    throw error;
  }
}

/** Copies prebuilds/<target>/ into the platform packages (packages/worker-native-<target>/). */
function stageAll() {
  for (const p of platformPackages()) {
    const missing = stage(p);
    if (missing.length > 0 && missing.length < p.files.length)
      log(`${p.name}: not built: ${missing.join(", ")}`);
  }
}

function main() {
  if (process.env.MOESWARM_NATIVE_SKIP === "1") {
    log("MOESWARM_NATIVE_SKIP=1: no native build");
    stageAll();
    return;
  }
  for (const tool of ["cmake", "g++"]) {
    if (!have(tool)) {
      skipOrFail(
        `${tool} is not installed, so the native addon and executable are not built`,
        "apt-get install cmake g++",
      );
      return;
    }
  }
  const targets = process.env.MOESWARM_NATIVE_TARGETS
    ? process.env.MOESWARM_NATIVE_TARGETS.split(",")
        .map((t) => t.trim())
        .filter(Boolean)
    : defaultTargets();
  const llamaSrc = llamaSourceDir();
  const napiInclude = napiIncludeString();
  const t0 = performance.now();
  for (const target of targets) {
    for (const v of variants(target, napiInclude)) buildVariant(v, llamaSrc);
  }
  stageAll();
  log(
    `native build done in ${((performance.now() - t0) / 1000).toFixed(1)} s (${targets.join(", ") || "nothing"})`,
  );
}

// imported by prebuildify-addon.mjs for its definitions: build only when run
if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) main();

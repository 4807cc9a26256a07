#!/usr/bin/env node
// Builds the native half of @moeswarm/backbone against node-llama-cpp's shared ggml:
//   prebuilds/linux-x64/libggml-moeswarm.so  the ggml backend plugin (GGML_BACKEND_PATH)
//   prebuilds/linux-x64/llama-logits         the logits harness over node-llama-cpp's libllama
// with worker-native's CMake tree in MOESWARM_GGML=shared mode and native/ as its plugin
// directory (the plugin compiles worker-native's msgpack/frame sources in). The build directory
// build/linux-x64 is reused: a rebuild compiles only what changed.
//
// Environment: MOESWARM_NATIVE_SKIP=1 builds nothing; MOESWARM_NATIVE_JOBS (default: CPUs);
// CI makes a missing toolchain or node-llama-cpp an error instead of a skip.
import { spawnSync } from "node:child_process";
import {
  chmodSync,
  copyFileSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  realpathSync,
  writeFileSync,
} from "node:fs";
import { availableParallelism } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { LLAMA_CPP_COMMIT, llamaSourceDir } from "../../../tools/llama-source.mjs";

const pkgDir = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const cmakeDir = resolve(pkgDir, "..", "worker-native");
const strict = Boolean(process.env.CI);
const jobs = Number(process.env.MOESWARM_NATIVE_JOBS) || availableParallelism();

function log(line) {
  process.stdout.write(`[backbone] ${line}\n`);
}

function have(cmd) {
  return spawnSync("sh", ["-c", `command -v ${cmd}`], { stdio: "ignore" }).status === 0;
}

function skipOrFail(reason, fix) {
  const text = `${reason}\n  possible solution: ${fix}`;
  if (strict) {
    process.stderr.write(`[backbone] error: ${text}\n`);
    process.exit(1);
  }
  log(`skipping: ${text}`);
}

function run(cmd, args) {
  const r = spawnSync(cmd, args, { cwd: pkgDir, stdio: "inherit" });
  if (r.status !== 0) {
    process.stderr.write(`[backbone] failed: ${cmd} ${args.join(" ")}\n`);
    process.exit(r.status ?? 1);
  }
}

/** node-llama-cpp's prebuilt binaries for linux-x64, or undefined. */
function llamaBinsDir() {
  const link = join(pkgDir, "node_modules", "node-llama-cpp");
  if (!existsSync(link)) return undefined;
  // pnpm places a package's dependencies beside it in the virtual store
  const dir = join(dirname(realpathSync(link)), "@node-llama-cpp", "linux-x64", "bins", "linux-x64");
  return existsSync(join(dir, "libggml-base.so")) ? dir : undefined;
}

function main() {
  if (process.env.MOESWARM_NATIVE_SKIP === "1") {
    log("MOESWARM_NATIVE_SKIP=1: no native build");
    return;
  }
  if (process.platform !== "linux" || process.arch !== "x64") {
    // node-llama-cpp's CPU binaries are what the plugin links against; other hosts: not built yet
    log(`skipping: the plugin is built for linux-x64, this is ${process.platform}-${process.arch}`);
    return;
  }
  for (const tool of ["cmake", "g++"]) {
    if (!have(tool)) {
      skipOrFail(
        `${tool} is not installed, so the plugin and the harness are not built`,
        "apt-get install cmake g++",
      );
      return;
    }
  }
  const bins = llamaBinsDir();
  if (!bins) {
    skipOrFail(
      "node-llama-cpp's prebuilt linux-x64 binaries were not found",
      "pnpm install (node-llama-cpp@3.21.1)",
    );
    return;
  }
  const libllama = readdirSync(bins).find((f) => /^libllama(\.v[\d.]+)?\.so$/.test(f));
  if (!libllama) {
    skipOrFail(`no libllama*.so in ${bins}`, "reinstall node-llama-cpp@3.21.1");
    return;
  }
  const dir = join(pkgDir, "build", "linux-x64");
  mkdirSync(dir, { recursive: true });
  const defs = {
    MOESWARM_LLAMA_SRC: llamaSourceDir(),
    CMAKE_BUILD_TYPE: "Release",
    MOESWARM_GGML: "shared",
    MOESWARM_WORKER: "OFF",
    MOESWARM_GGML_BASE_LIB: join(bins, "libggml-base.so"),
    MOESWARM_PLUGIN_DIR: join(pkgDir, "native"),
    MOESWARM_LLAMA_LIB: join(bins, libllama),
  };
  const configureArgs = ["-S", cmakeDir, "-B", dir, ...(have("ninja") ? ["-G", "Ninja"] : [])];
  for (const [k, v] of Object.entries(defs)) configureArgs.push(`-D${k}=${v}`);
  const stamp = join(dir, "moeswarm-configure.json");
  const want = JSON.stringify({ args: configureArgs, commit: LLAMA_CPP_COMMIT });
  const t0 = performance.now();
  if (
    !existsSync(join(dir, "CMakeCache.txt")) ||
    !existsSync(stamp) ||
    readFileSync(stamp, "utf8") !== want
  ) {
    run("cmake", configureArgs);
    writeFileSync(stamp, want);
  }
  run("cmake", ["--build", dir, "--parallel", String(jobs)]);
  for (const name of ["libggml-moeswarm.so", "llama-logits"]) {
    const src = join(dir, "plugin", name);
    if (!existsSync(src)) throw new Error(`${name} was not built`);
    const dst = join(pkgDir, "prebuilds", "linux-x64", name);
    mkdirSync(dirname(dst), { recursive: true });
    copyFileSync(src, dst);
    chmodSync(dst, 0o755);
  }
  log(`linux-x64: ${((performance.now() - t0) / 1000).toFixed(1)} s (ggml from ${bins})`);
}

main();

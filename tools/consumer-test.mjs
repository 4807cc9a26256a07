#!/usr/bin/env node
// The consumer test: moeswarm as a third party gets it. Publishes every package as `pnpm release`
// does minus the build (`changeset version --snapshot ci` and `changeset publish --tag ci`, in a
// copy of the repository) to a verdaccio on 127.0.0.1 with throwaway storage, then, in empty
// folders and with a PATH that has no cc/c++/make/cmake/python, `npm install`s them and uses them:
// an ESM and a CJS consumer of dispatchExperts with the native addon and the prebuilt executable, a
// TypeScript consumer type-checked under node16, nodenext and bundler, every bin with --help and
// --version, every README snippet marked ```js test, the executables' run bits, the loaders' errors
// for a missing platform package, peer or GPU build, the hub under Node 22 on node:sqlite, and the
// examples copied out and run (the local-swarm demo to its identical-tokens verdict, with
// node-llama-cpp's CPU build only). Prints the tarballs, and the time and size of each install.
//
//   node tools/consumer-test.mjs [--no-build] [--keep] [--exclude=@moeswarm/<name>]
//
// --exclude leaves a package out of the full install (loudly; for finding the next failure while
// one package is known not to install; CI never passes it).
//
// Needs a build (it runs `turbo run build` unless --no-build) and the npm registry (the packages'
// third-party dependencies come from there; only @moeswarm/* come from the local registry).
import { spawn, spawnSync } from "node:child_process";
import {
  cpSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { basename, dirname, join } from "node:path";
import {
  elapsed,
  fail,
  here,
  log,
  mb,
  npmInstall,
  PNPM,
  project,
  publishedPackages,
  root,
  sh,
} from "./consumer-test/common.mjs";
import { hubUnderNode22 } from "./consumer-test/node22-hub.mjs";
import { changesetPublish } from "./consumer-test/publish.mjs";

const args = new Set(process.argv.slice(2));
const excluded = process.argv
  .slice(2)
  .filter((a) => a.startsWith("--exclude="))
  .map((a) => a.slice("--exclude=".length));

/**
 * One example, copied out of the repository and run against the published packages: `run(ctx)`
 * gets `{ registry, version, env, dir }` (dir: a fresh folder whose .npmrc points @moeswarm at the
 * registry; env: the PATH without compilers). tools/run-example-copy.mjs installs it with npm at
 * the published prerelease, type-checks it and runs it; a failure fails the consumer test.
 */
function exampleRun(name) {
  return {
    name,
    run: (ctx) => {
      const out = sh(
        process.execPath,
        [
          join(root, "tools", "run-example-copy.mjs"),
          ...[name, join(ctx.dir, "app"), "--registry", ctx.registry, "--version", ctx.version],
        ],
        { env: ctx.env, cwd: ctx.dir },
      );
      // its own lines (install time and size, the builds, the verdict) and the example's verdict
      for (const line of out.split("\n")) {
        if (/^run-example-copy: |^ {2}\| (OK|MISMATCH)\b/.test(line)) log(`  ${line.trim()}`);
      }
    },
  };
}

// local-swarm needs llama.cpp's linux-x64 CPU build (node-llama-cpp without its GPU variants, as its
// package.json and .npmrc say) and must reach its identical-tokens verdict
export const exampleRuns = ["embed-dispatch", "offload-plan"]
  .concat(process.platform === "linux" && process.arch === "x64" ? ["local-swarm"] : [])
  .map(exampleRun);

function freePort() {
  return new Promise((ok, ko) => {
    const s = createServer();
    s.on("error", ko);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => ok(port));
    });
  });
}

/** verdaccio 6.8.0 (the last for Node 20), pinned by tools/consumer-test/registry's lockfile. */
function verdaccioBin() {
  const dir = join(here, "registry");
  const bin = join(dir, "node_modules", ".bin", "verdaccio");
  if (!existsSync(bin)) {
    log("installing verdaccio 6.8.0 (npm ci, once)");
    sh("npm", ["ci", "--no-audit", "--no-fund", "--ignore-scripts"], { cwd: dir });
  }
  return bin;
}

async function startRegistry(work) {
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const storage = join(work, "registry");
  mkdirSync(storage, { recursive: true });
  const config = join(storage, "config.yaml");
  writeFileSync(
    config,
    [
      `storage: ${join(storage, "storage")}`,
      "auth:",
      "  htpasswd:",
      `    file: ${join(storage, "htpasswd")}`,
      "    max_users: 10",
      "uplinks: {}",
      "packages:",
      "  '@moeswarm/*':",
      "    access: $all",
      "    publish: $authenticated",
      "  '**':",
      "    access: $all",
      "max_body_size: 200mb",
      "log: { type: stdout, format: pretty, level: warn }",
      "",
    ].join("\n"),
  );
  const child = spawn(verdaccioBin(), ["--config", config, "--listen", `127.0.0.1:${port}`], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  child.stdout.on("data", (b) => (output += b));
  child.stderr.on("data", (b) => (output += b));
  const deadline = Date.now() + 60_000;
  for (;;) {
    if (child.exitCode !== null) fail(`verdaccio exited (${child.exitCode}):\n${output}`);
    try {
      if ((await fetch(`${url}/-/ping`)).ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) fail(`verdaccio did not answer on ${url} in 60 s:\n${output}`);
    await new Promise((r) => setTimeout(r, 250));
  }
  // a user, and its token for publishing
  const res = await fetch(`${url}/-/user/org.couchdb.user:ci`, {
    method: "PUT",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ name: "ci", password: "consumer-test-password" }),
  });
  const { token } = await res.json();
  if (!token) fail(`verdaccio gave no token (${res.status})`);
  return { url, token, stop: () => child.kill("SIGTERM") };
}

/** A bin folder with everything on PATH but compilers, build tools and python. */
function compilerFreePath(work) {
  const bin = join(work, "bin");
  mkdirSync(bin, { recursive: true });
  const banned =
    /^(cc|c\+\+|cpp|gcc|g\+\+|clang|clang\+\+|c89|c99|make|gmake|cmake|ninja|python.*|.*-(gcc|g\+\+|cc|c\+\+)(-[\d.]+)?|gcc-.*|g\+\+-.*|cpp-.*)$/;
  const dirs = [dirname(process.execPath), "/usr/local/bin", "/usr/bin", "/bin"];
  for (const d of dirs) {
    if (!existsSync(d)) continue;
    for (const name of readdirSync(d)) {
      if (banned.test(name) || existsSync(join(bin, name))) continue;
      symlinkSync(join(d, name), join(bin, name));
    }
  }
  const env = { ...process.env, PATH: bin };
  for (const tool of ["cc", "c++", "gcc", "g++", "make", "cmake", "python3", "python"]) {
    if (spawnSync("sh", ["-c", `command -v ${tool}`], { env }).status === 0)
      fail(`${tool} is still on the PATH`);
  }
  return env;
}

function runConsumers(dir, env) {
  const program = readFileSync(join(here, "dispatch-consumer.js"), "utf8");
  const names = ["synthesizeMoeModel", "loadExpertCompute", "spawnExpertWorker", "expertWorkerPath"];
  const esm = [
    'import { mkdtempSync, rmSync } from "node:fs";',
    'import { tmpdir } from "node:os";',
    'import { join } from "node:path";',
    'import { mulberry32, relL2 } from "@moeswarm/core";',
    'import { dispatchExperts, InProcessTransport, Placement, route } from "@moeswarm/dispatch";',
    'import { synthesizeMoeModel } from "@moeswarm/shard";',
    `import { ${names.slice(1).join(", ")} } from "@moeswarm/worker-native";`,
  ].join("\n");
  const cjs = [
    'const { mkdtempSync, rmSync } = require("node:fs");',
    'const { tmpdir } = require("node:os");',
    'const { join } = require("node:path");',
    'const { mulberry32, relL2 } = require("@moeswarm/core");',
    'const { dispatchExperts, InProcessTransport, Placement, route } = require("@moeswarm/dispatch");',
    'const { synthesizeMoeModel } = require("@moeswarm/shard");',
    `const { ${names.slice(1).join(", ")} } = require("@moeswarm/worker-native");`,
  ].join("\n");
  writeFileSync(join(dir, "consumer.mjs"), program.replace("/* IMPORTS */", esm));
  writeFileSync(join(dir, "consumer.cjs"), program.replace("/* IMPORTS */", cjs));
  for (const file of ["consumer.mjs", "consumer.cjs"]) {
    log(`${file}: ${sh("node", [file], { cwd: dir, env }).trim()}`);
  }
}

function typecheck(dir, env) {
  cpSync(join(here, "consumer.mts"), join(dir, "consumer.mts"));
  const base = { strict: true, noEmit: true, skipLibCheck: false, types: ["node"], target: "ES2022" };
  const configs = {
    node16: { module: "node16", moduleResolution: "node16" },
    nodenext: { module: "nodenext", moduleResolution: "nodenext" },
    bundler: { module: "esnext", moduleResolution: "bundler" },
  };
  for (const [name, opts] of Object.entries(configs)) {
    const file = `tsconfig.${name}.json`;
    writeFileSync(
      join(dir, file),
      JSON.stringify({ compilerOptions: { ...base, ...opts }, files: ["consumer.mts"] }),
    );
    sh(join(dir, "node_modules", ".bin", "tsc"), ["-p", file], { cwd: dir, env });
    log(`TypeScript consumer type-checks (${name})`);
  }
}

function runBins(dir, env, version) {
  const bins = [];
  for (const scopeDir of [join(dir, "node_modules", "@moeswarm")]) {
    for (const name of readdirSync(scopeDir)) {
      const pkg = JSON.parse(readFileSync(join(scopeDir, name, "package.json"), "utf8"));
      for (const bin of Object.keys(pkg.bin ?? {})) bins.push(bin);
    }
  }
  if (bins.length === 0) fail("no bins installed");
  for (const bin of bins) {
    const path = join(dir, "node_modules", ".bin", bin);
    const help = sh(path, ["--help"], { cwd: dir, env });
    if (!/usage|options/i.test(help)) fail(`${bin} --help printed no usage:\n${help}`);
    const v = sh(path, ["--version"], { cwd: dir, env });
    if (!v.includes(version)) fail(`${bin} --version printed ${JSON.stringify(v.trim())}, not ${version}`);
  }
  log(`bins: ${bins.join(", ")} answer --help and --version (${version})`);
}

/** Every ```js test block of the installed READMEs, run as an ES module in the project. */
function runReadmeSnippets(dir, env) {
  let count = 0;
  const scopeDir = join(dir, "node_modules", "@moeswarm");
  for (const name of readdirSync(scopeDir)) {
    const readme = join(scopeDir, name, "README.md");
    if (!existsSync(readme)) fail(`@moeswarm/${name} has no README.md`);
    const text = readFileSync(readme, "utf8");
    const blocks = [...text.matchAll(/^```js test\n([\s\S]*?)^```$/gm)].map((m) => m[1]);
    if (blocks.length === 0 && !name.startsWith("worker-native-"))
      fail(`@moeswarm/${name}'s README has no \`\`\`js test snippet`);
    blocks.forEach((code, i) => {
      const file = join(dir, `readme-${name}-${i}.mjs`);
      writeFileSync(file, code);
      sh("node", [file], { cwd: dir, env, timeout: 120_000 });
      count++;
    });
  }
  log(`README snippets: ${count} ran`);
  return count;
}

/** The executables of the installed platform package have their run bit. */
function checkInstalledModes(dir) {
  const scopeDir = join(dir, "node_modules", "@moeswarm");
  const platform = readdirSync(scopeDir).filter((n) => n.startsWith("worker-native-"));
  if (platform.length !== 1)
    fail(`expected exactly this platform's package, found: ${platform.join(", ") || "none"}`);
  const pkg = JSON.parse(readFileSync(join(scopeDir, platform[0], "package.json"), "utf8"));
  for (const exe of pkg.publishConfig.executableFiles) {
    const mode = statSync(join(scopeDir, platform[0], exe)).mode;
    if ((mode & 0o111) === 0)
      fail(`${platform[0]}/${exe} is installed without its run bit (${mode.toString(8)})`);
  }
  log(
    `installed ${platform[0]} only; ${pkg.publishConfig.executableFiles.length} executables have their run bit`,
  );
}

/** node-llama-cpp is an optional peer: absent, the error names the install line. */
function checkPeerMissing(dir, env) {
  const script = [
    'import { llamaCppBinsDir } from "@moeswarm/worker-native";',
    "try { llamaCppBinsDir(); console.log('node-llama-cpp was found'); process.exit(1); }",
    "catch (e) { if (e.code !== 'MOESWARM_NATIVE_PEER_MISSING' || !e.message.includes('npm install node-llama-cpp@3.21.1')) { console.error(e); process.exit(1); } }",
  ].join("\n");
  writeFileSync(join(dir, "peer-missing.mjs"), script);
  sh("node", ["peer-missing.mjs"], { cwd: dir, env });
  log("without node-llama-cpp: MOESWARM_NATIVE_PEER_MISSING names npm install node-llama-cpp@3.21.1");
}

/**
 * The GPU builds are node-llama-cpp's (no @moeswarm GPU package): not installed, the installed
 * loader's error names the exact line that installs each (vulkanBinsDir, and cudaBinsDir where
 * this release exports it).
 */
function checkGpuMissing(dir, env) {
  cpSync(join(here, "gpu-missing.mjs"), join(dir, "gpu-missing.mjs"));
  const out = sh("node", ["gpu-missing.mjs"], { cwd: dir, env }).trim().split("\n");
  log(`without a GPU build the loader names the install line: ${out.join("; ")}`);
}

/** Without its platform package (--omit=optional), the loader names the package to install. */
function checkPlatformMissing(work, registry, version, env) {
  const dir = project(work, "omit-optional", registry);
  npmInstall(dir, [`@moeswarm/worker-native@${version}`], env, ["--omit=optional"]);
  const line = `npm install @moeswarm/worker-native-${process.platform}-${process.arch}`;
  const script = [
    'import { expertWorkerPath } from "@moeswarm/worker-native";',
    "try { expertWorkerPath(); console.log('found an executable'); process.exit(1); }",
    `catch (e) { if (e.code !== 'MOESWARM_NATIVE_PACKAGE_MISSING' || !e.message.includes(${JSON.stringify(line)})) { console.error(e); process.exit(1); } }`,
  ].join("\n");
  writeFileSync(join(dir, "platform-missing.mjs"), script);
  sh("node", ["platform-missing.mjs"], { cwd: dir, env });
  log(`without the platform package: MOESWARM_NATIVE_PACKAGE_MISSING names ${line}`);
}

/** The backbone's README recipe: node-llama-cpp's CPU build only, without its GPU variants. */
function backboneCpuOnly(work, registry, version, env) {
  const dir = project(work, "backbone-cpu", registry);
  const specs = [
    `@moeswarm/backbone@${version}`,
    `@moeswarm/worker-native-linux-x64@${version}`,
    "node-llama-cpp@3.21.1",
    "@node-llama-cpp/linux-x64@3.21.1",
  ];
  const r = npmInstall(dir, specs, env, ["--omit=optional"]);
  const variants = readdirSync(join(dir, "node_modules", "@node-llama-cpp"));
  if (variants.join() !== "linux-x64")
    fail(`--omit=optional still installed @node-llama-cpp/${variants.join(", ")}`);
  writeFileSync(
    join(dir, "bins.mjs"),
    'import { llamaCppBinsDir } from "@moeswarm/worker-native";\nimport { pluginPath } from "@moeswarm/backbone";\nconsole.log(llamaCppBinsDir(), pluginPath());\n',
  );
  sh("node", ["bins.mjs"], { cwd: dir, env });
  log(
    `backbone with node-llama-cpp's CPU build only (--omit=optional): ${r.seconds.toFixed(1)} s, ${mb(r.bytes)}`,
  );
}

async function main() {
  if (!args.has("--no-build")) {
    log("building (turbo, cached)");
    sh(
      "npx",
      [
        ...PNPM,
        "turbo",
        "run",
        "build",
        "--output-logs=errors-only",
        ...publishedPackages().map((p) => `--filter=${p.pkg.name}`),
      ],
      {
        stdio: ["ignore", "inherit", "inherit"],
      },
    );
  }
  const work = mkdtempSync(join(tmpdir(), "moeswarm-consumer-"));
  const registry = await startRegistry(work);
  try {
    const { version, tarballs } = await changesetPublish(work, registry.url, registry.token);
    log(`published ${tarballs.length} packages at ${version} to ${registry.url}`);
    for (const t of tarballs)
      log(`  ${basename(t.file).padEnd(52)} ${(t.size / 1024).toFixed(0).padStart(6)} kB`);

    const env = compilerFreePath(work);
    const all = publishedPackages()
      .map((p) => p.pkg.name)
      .filter((n) => !n.startsWith("@moeswarm/worker-native-"))
      .filter((n) => !excluded.includes(n));
    for (const n of excluded)
      log(`WARNING: ${n} is left out of the full install (--exclude): this run proves nothing about it`);

    const workerOnly = project(work, "worker-only", registry.url);
    const w = npmInstall(workerOnly, [`@moeswarm/worker@${version}`], env);
    log(`worker-only install: ${w.seconds.toFixed(1)} s, ${mb(w.bytes)}`);
    checkInstalledModes(workerOnly);

    const full = project(work, "full", registry.url);
    const f = npmInstall(
      full,
      all.map((n) => `${n}@${version}`),
      env,
    );
    log(`full install (${all.length} packages): ${f.seconds.toFixed(1)} s, ${mb(f.bytes)}`);
    checkInstalledModes(full);
    runConsumers(full, env);
    runBins(full, env, version);
    runReadmeSnippets(full, env);
    checkPeerMissing(full, env);
    checkPlatformMissing(work, registry.url, version, env);
    if (process.platform === "linux" && process.arch === "x64") checkGpuMissing(full, env);
    if (process.platform === "linux" && process.arch === "x64")
      backboneCpuOnly(work, registry.url, version, env);
    if (process.platform === "linux" && process.arch === "x64")
      await hubUnderNode22(work, registry.url, full, env);
    npmInstall(full, ["typescript@5.9.3", "@types/node@20.19.43"], env, ["--save-dev"]);
    typecheck(full, env);

    for (const example of exampleRuns) {
      log(`example ${example.name}`);
      await example.run({
        registry: registry.url,
        version,
        env,
        dir: project(work, `example-${example.name}`, registry.url),
      });
    }
    if (exampleRuns.length === 0) log("examples: none wired in exampleRuns");
    log(`passed in ${elapsed().toFixed(0)} s`);
  } finally {
    registry.stop();
    if (args.has("--keep")) log(`kept ${work}`);
    else rmSync(work, { recursive: true, force: true });
  }
}

main().catch((error) => {
  process.stderr.write(`[consumer] FAILED: ${error.message}\n`);
  process.exit(1);
});

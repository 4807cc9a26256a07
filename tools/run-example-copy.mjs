#!/usr/bin/env node
// Copies an example out of the repository, installs it with npm as a user would (from a registry,
// or from `pnpm pack` tarballs), type-checks it and runs it: the examples are templates, and this
// is the proof that one works outside the monorepo. The release's consumer test calls it against
// its loopback registry; `--tarballs` does the same from packed tarballs without a registry.
//
//   node tools/run-example-copy.mjs <example> <dir> [--registry URL | --tarballs DIR] [--no-run]
//
// In the repository the examples depend on `"@moeswarm/x": "workspace:^"` (pnpm links the
// workspace package); the copy gets, instead:
//   - default / --registry URL: the version in packages/x/package.json (`^1.2.3`, or exactly a
//     prerelease such as `0.1.0-rc.0`, which a caret range would not match), with
//     `@moeswarm:registry=URL` in the copy's .npmrc (every other package from the usual registry);
//   - --tarballs DIR: `file:` the tarball of x in DIR, and npm `overrides` pointing every
//     @moeswarm package found there at its tarball (their own dependencies on each other too).
import { spawn, spawnSync } from "node:child_process";
import { cpSync, existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const repo = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const EXAMPLES = ["local-swarm", "embed-dispatch", "offload-plan"];
const USAGE = `usage: node tools/run-example-copy.mjs <example> <dir> [--registry URL | --tarballs DIR] [--no-run]

  <example>        ${EXAMPLES.join(" | ")}
  <dir>            where to copy it (must not exist, or be empty)
  --registry URL   install @moeswarm/* from this registry (e.g. http://127.0.0.1:4873)
  --tarballs DIR   install @moeswarm/* from the tarballs of \`pnpm pack\` in DIR
  --version V      with --registry: install @moeswarm/* at exactly V (e.g. a prerelease just
                   published), not the repository's version
  --no-run         copy, install and type-check only
  --timeout S      seconds the run may take (default 600)
  -h, --help       this text

Exit status 0 when the copy installed, type-checked and ran (its verdict printed), else 1; 2 for
a usage mistake.`;

const say = (line) => process.stdout.write(`run-example-copy: ${line}\n`);

function fail(message, status = 1) {
  process.stderr.write(`run-example-copy: ${message}\n`);
  process.exit(status);
}

function parse() {
  let parsed;
  try {
    parsed = parseArgs({
      allowPositionals: true,
      options: {
        registry: { type: "string" },
        tarballs: { type: "string" },
        version: { type: "string" },
        "no-run": { type: "boolean" },
        timeout: { type: "string" },
        help: { type: "boolean", short: "h" },
      },
    });
  } catch (error) {
    fail(`${error.message}\n${USAGE}`, 2);
  }
  const { values, positionals } = parsed;
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  const [example, dir, ...rest] = positionals;
  if (!EXAMPLES.includes(example) || !dir || rest.length > 0) fail(USAGE, 2);
  if (values.registry && values.tarballs) fail("--registry and --tarballs: one or the other", 2);
  const timeout = Number(values.timeout ?? 600);
  if (!Number.isInteger(timeout) || timeout < 1) fail("--timeout must be whole seconds", 2);
  return { example, dir: resolve(dir), ...values, timeoutMs: timeout * 1000 };
}

/** @moeswarm/<x> -> the tarball of `pnpm pack` (moeswarm-x-<version>.tgz) in `dir`. */
function tarballsIn(dir) {
  const found = new Map();
  for (const f of readdirSync(dir)) {
    const m = /^moeswarm-(.+)-(\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?)\.tgz$/.exec(f);
    if (m) found.set(`@moeswarm/${m[1]}`, join(dir, f));
  }
  return found;
}

function repoVersion(name) {
  const file = join(repo, "packages", name.replace("@moeswarm/", ""), "package.json");
  if (!existsSync(file)) fail(`${name} is not a package of this repository`);
  return JSON.parse(readFileSync(file, "utf8")).version;
}

/** The example's files, without what only the monorepo uses (its tests, caches, builds). */
function copyExample(example, dir) {
  if (existsSync(dir) && readdirSync(dir).length > 0) fail(`${dir} is not empty`, 2);
  const from = join(repo, "examples", example);
  const skip = new Set(["node_modules", ".cache", "test", "vitest.config.ts", "dist", ".turbo"]);
  mkdirSync(dir, { recursive: true });
  for (const entry of readdirSync(from)) {
    if (!skip.has(entry)) cpSync(join(from, entry), join(dir, entry), { recursive: true });
  }
}

function rewritePackage(dir, options) {
  const file = join(dir, "package.json");
  const pkg = JSON.parse(readFileSync(file, "utf8"));
  const tarballs = options.tarballs ? tarballsIn(resolve(options.tarballs)) : undefined;
  for (const field of ["dependencies", "devDependencies"]) {
    for (const [name, spec] of Object.entries(pkg[field] ?? {})) {
      if (!spec.startsWith("workspace:")) continue;
      if (tarballs) {
        const tgz = tarballs.get(name);
        if (!tgz) fail(`no tarball of ${name} in ${options.tarballs} (pnpm pack it there)`);
        pkg[field][name] = `file:${tgz}`;
      } else {
        const v = options.version ?? repoVersion(name);
        pkg[field][name] = v.includes("-") ? v : `^${v}`;
      }
    }
  }
  if (tarballs) pkg.overrides = Object.fromEntries([...tarballs].map(([n, t]) => [n, `file:${t}`]));
  delete pkg.scripts?.test; // the repository's vitest setup stays behind
  writeFileSync(file, `${JSON.stringify(pkg, null, 2)}\n`);
  if (options.registry) {
    // added to the template's own .npmrc (local-swarm's `omit=optional` keeps out the GPU builds)
    const npmrc = join(dir, ".npmrc");
    const own = existsSync(npmrc) ? readFileSync(npmrc, "utf8") : "";
    writeFileSync(npmrc, `${own}@moeswarm:registry=${options.registry}\n`);
  }
  return pkg;
}

/**
 * node-llama-cpp's builds in the copy are exactly those its package.json names (a template that
 * names the CPU build must not pull the ~700 MB of GPU builds its README says it avoids).
 */
function checkLlamaBuilds(dir, pkg) {
  const scope = join(dir, "node_modules", "@node-llama-cpp");
  if (!existsSync(scope)) return;
  const installed = readdirSync(scope).map((n) => `@node-llama-cpp/${n}`);
  const named = Object.keys(pkg.dependencies ?? {}).filter((n) => n.startsWith("@node-llama-cpp/"));
  const extra = installed.filter((n) => !named.includes(n));
  if (extra.length > 0) fail(`npm install brought builds the example does not name: ${extra.join(", ")}`);
  say(`node-llama-cpp builds installed: ${installed.join(", ")} (only those package.json names)`);
}

/** Runs a command in the copy; resolves with its status and output (also echoed, indented). */
function run(command, args, { cwd, env = {}, timeoutMs, quiet = false }) {
  return new Promise((resolveRun) => {
    const child = spawn(command, args, {
      cwd,
      env: { ...process.env, ...env },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    const take = (c) => {
      out += c.toString();
      if (!quiet) process.stdout.write(c.toString().replace(/^(?=.)/gm, "  | "));
    };
    child.stdout.on("data", take);
    child.stderr.on("data", take);
    const timer = setTimeout(() => child.kill("SIGTERM"), timeoutMs);
    child.on("close", (status, signal) => {
      clearTimeout(timer);
      resolveRun({ status, signal, out, child });
    });
  });
}

async function freePort() {
  const server = createServer();
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const { port } = server.address();
  await new Promise((r) => server.close(r));
  return port;
}

/** embed-dispatch is a server: start it, ask it one MoE call, check the router's choice, stop it. */
async function runEmbedDispatch(dir, timeoutMs) {
  const port = await freePort();
  const child = spawn("npm", ["start"], {
    cwd: dir,
    env: { ...process.env, PORT: String(port) },
    stdio: ["ignore", "pipe", "pipe"],
    detached: true,
  });
  let out = "";
  child.stdout.on("data", (c) => {
    out += c.toString();
  });
  child.stderr.on("data", (c) => {
    out += c.toString();
  });
  const stop = () => {
    try {
      process.kill(-child.pid, "SIGTERM"); // npm, sh and node: the group this script started
    } catch {}
  };
  try {
    const deadline = Date.now() + timeoutMs;
    while (!out.includes("MoE service on")) {
      if (child.exitCode !== null || Date.now() > deadline) return { ok: false, detail: out };
      await new Promise((r) => setTimeout(r, 100));
    }
    const hidden = [Array.from({ length: 16 }, (_, i) => (i + 1) / 10)];
    const res = await fetch(`http://127.0.0.1:${port}/moe`, {
      method: "POST",
      body: JSON.stringify({ hidden, logits: [[0, 0, 5, 0, 0, 4, 0, 0]] }),
    });
    const body = await res.json();
    const ok =
      res.status === 200 &&
      JSON.stringify(body.ids) === "[[2,5]]" &&
      body.output?.[0]?.length === 16 &&
      body.output[0].every(Number.isFinite);
    return { ok, detail: `POST /moe -> ${res.status} ids ${JSON.stringify(body.ids)}` };
  } finally {
    stop();
  }
}

const CHECKS = {
  "offload-plan": async (dir, timeoutMs) => {
    const r = await run("npm", ["start"], { cwd: dir, timeoutMs });
    return { ok: r.status === 0 && /layers?/i.test(r.out), detail: `exit ${r.status ?? r.signal}` };
  },
  "local-swarm": async (dir, timeoutMs) => {
    const r = await run("npm", ["start", "--", "--preset", "tiny", "--tokens", "12", "--workers", "2"], {
      cwd: dir,
      timeoutMs,
    });
    const verdict = /^OK +12\/12 tokens identical to the local run/m.test(r.out);
    return {
      ok: r.status === 0 && verdict,
      detail: `exit ${r.status ?? r.signal}${verdict ? ", identical tokens" : ""}`,
    };
  },
  "embed-dispatch": runEmbedDispatch,
};

async function main() {
  const o = parse();
  const started = performance.now();
  copyExample(o.example, o.dir);
  const pkg = rewritePackage(o.dir, o);
  const moeswarm = Object.entries(pkg.dependencies).filter(([n]) => n.startsWith("@moeswarm/"));
  say(`copied examples/${o.example} to ${o.dir}; ${moeswarm.map(([n, s]) => `${n}@${s}`).join(", ")}`);

  const t0 = performance.now();
  const install = await run("npm", ["install", "--no-audit", "--no-fund", "--loglevel=error"], {
    cwd: o.dir,
    timeoutMs: o.timeoutMs,
  });
  if (install.status !== 0) fail(`npm install failed (exit ${install.status ?? install.signal})`);
  const du = spawnSync("du", ["-sk", join(o.dir, "node_modules")], { encoding: "utf8" });
  const mib = Number(du.stdout.split("\t")[0]) / 1024;
  say(`installed in ${((performance.now() - t0) / 1000).toFixed(1)} s, node_modules ${mib.toFixed(0)} MiB`);
  checkLlamaBuilds(o.dir, pkg);

  const tc = await run("npm", ["run", "typecheck"], { cwd: o.dir, timeoutMs: o.timeoutMs });
  if (tc.status !== 0) fail("the copy does not type-check (npm run typecheck)");
  say("type-checks (its own tsconfig, the installed packages' types)");

  if (o["no-run"]) return;
  const t1 = performance.now();
  const verdict = await CHECKS[o.example](o.dir, o.timeoutMs);
  const secs = ((performance.now() - t1) / 1000).toFixed(1);
  if (!verdict.ok) fail(`examples/${o.example} did not run from its copy: ${verdict.detail}`);
  say(
    `OK examples/${o.example} runs from ${o.dir}: ${verdict.detail} (${secs} s; ${((performance.now() - started) / 1000).toFixed(1)} s in all)`,
  );
}

await main();

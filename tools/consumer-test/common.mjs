// Helpers of tools/consumer-test.mjs and its parts: logging, commands that fail loudly, the
// repository's published packages, and empty npm projects with their installs.
import { spawnSync } from "node:child_process";
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const root = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const here = join(root, "tools", "consumer-test");
export const PNPM = ["-y", "pnpm@12.4.2"];
const t0 = performance.now();

/** Seconds since the consumer test started. */
export function elapsed() {
  return (performance.now() - t0) / 1000;
}

export function log(line) {
  process.stdout.write(`[consumer] ${elapsed().toFixed(0).padStart(4)} s  ${line}\n`);
}

export function fail(message) {
  throw new Error(message);
}

export function sh(cmd, argv, options = {}) {
  const r = spawnSync(cmd, argv, { encoding: "utf8", maxBuffer: 64 << 20, ...options });
  if (r.status !== 0) {
    fail(
      `${cmd} ${argv.join(" ")} failed (${r.status ?? r.signal}) in ${options.cwd ?? root}\n${(r.stdout ?? "").slice(-4000)}\n${(r.stderr ?? "").slice(-4000)}`,
    );
  }
  return r.stdout;
}

/** The published packages: every non-private package.json under packages/. */
export function publishedPackages() {
  return readdirSync(join(root, "packages"))
    .map((d) => join(root, "packages", d))
    .filter((d) => existsSync(join(d, "package.json")))
    .map((dir) => ({ dir, pkg: JSON.parse(readFileSync(join(dir, "package.json"), "utf8")) }))
    .filter(({ pkg }) => !pkg.private);
}

export function duBytes(dir) {
  return Number(sh("du", ["-sb", dir]).split("\t")[0]);
}

export const mb = (b) => `${(b / 1e6).toFixed(1)} MB`;

/** An empty project whose @moeswarm scope resolves from the local registry. */
export function project(work, name, registry, type) {
  const dir = join(work, name);
  mkdirSync(dir, { recursive: true });
  writeFileSync(
    join(dir, "package.json"),
    `${JSON.stringify({ name, private: true, ...(type ? { type } : {}) }, null, 2)}\n`,
  );
  writeFileSync(join(dir, ".npmrc"), `@moeswarm:registry=${registry}\nfund=false\naudit=false\n`);
  return dir;
}

export function npmInstall(dir, specs, env, extra = []) {
  const t = performance.now();
  sh("npm", ["install", ...extra, ...specs], { cwd: dir, env });
  return { seconds: (performance.now() - t) / 1000, bytes: duBytes(join(dir, "node_modules")) };
}

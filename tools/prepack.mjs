#!/usr/bin/env node
// `prepack` of every published package: a tarball is never packed from an unbuilt (or half-built)
// package. Outside turbo it builds the package and what it depends on (`turbo run build
// --filter=<name>...`, cached: seconds when nothing changed); inside a turbo task (the lint task's
// `attw --pack`, which depends on build) the build already ran and rebuilding there would nest
// turbo in turbo; MOESWARM_PREPACK_BUILT=1 says the caller (tools/release.mjs, the consumer test)
// has just built everything. Either way it then fails unless every entry of `files` exists and is non-empty.
import { spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const pkg = JSON.parse(readFileSync("package.json", "utf8"));

// biome-ignore lint/suspicious/noUndeclaredEnvVars: turbo sets it in its own tasks; never a cache input
if (!process.env.TURBO_HASH && process.env.MOESWARM_PREPACK_BUILT !== "1") {
  const turbo = join(root, "node_modules", ".bin", "turbo");
  const r = spawnSync(turbo, ["run", "build", `--filter=${pkg.name}...`, "--output-logs=errors-only"], {
    cwd: root,
    stdio: "inherit",
  });
  if (r.status !== 0) {
    process.stderr.write(`prepack ${pkg.name}: the build failed, nothing is packed\n`);
    process.exit(r.status ?? 1);
  }
}

const empty = (pkg.files ?? []).filter((f) => {
  if (!existsSync(f)) return true;
  const s = statSync(f);
  return s.isDirectory() ? readdirSync(f).length === 0 : s.size === 0;
});
if (empty.length > 0) {
  process.stderr.write(`prepack ${pkg.name}: ${empty.join(", ")} missing or empty: build first\n`);
  process.exit(1);
}

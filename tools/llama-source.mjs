#!/usr/bin/env node
// The pinned llama.cpp source: node-llama-cpp@3.21.1 ships its release as a git bundle. This
// extracts it once into .cache/ (ignored), checks the commit, and prints the directory. Nothing is
// ever fetched from anywhere else.
import { execFileSync } from "node:child_process";
import { existsSync, mkdirSync, renameSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const LLAMA_CPP_COMMIT = "80fb11ac73e66d89eae2c6a91d8a77428fa733ed";
export const LLAMA_CPP_TAG = "v0.4.0";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");

/** Path of gitRelease.bundle inside whichever workspace package depends on node-llama-cpp. */
export function llamaBundlePath() {
  for (const from of ["packages/worker-native", "packages/shard", "packages/backbone"]) {
    // node-llama-cpp's exports map hides its files, so look in the package's node_modules link
    const bundle = join(root, from, "node_modules", "node-llama-cpp", "llama", "gitRelease.bundle");
    if (existsSync(bundle)) return bundle;
  }
  throw new Error("node-llama-cpp@3.21.1 is not installed: run `pnpm install` first");
}

/** Extracts (once) and returns the llama.cpp source directory of the pinned commit. */
export function llamaSourceDir() {
  const dir = join(root, ".cache", `llama.cpp-${LLAMA_CPP_COMMIT.slice(0, 12)}`);
  if (existsSync(join(dir, ".complete"))) return dir;
  const bundle = llamaBundlePath();
  const tmp = `${dir}.tmp-${process.pid}`;
  rmSync(tmp, { recursive: true, force: true });
  mkdirSync(dirname(dir), { recursive: true });
  execFileSync("git", ["clone", "--quiet", "--no-checkout", bundle, tmp], { stdio: "inherit" });
  const head = execFileSync("git", ["-C", tmp, "rev-parse", "HEAD"], { encoding: "utf8" }).trim();
  if (head !== LLAMA_CPP_COMMIT) {
    rmSync(tmp, { recursive: true, force: true });
    throw new Error(`llama.cpp bundle is at ${head}, expected the pinned ${LLAMA_CPP_COMMIT}`);
  }
  execFileSync(
    "git",
    ["-C", tmp, "-c", "advice.detachedHead=false", "checkout", "--quiet", LLAMA_CPP_COMMIT],
    {
      stdio: "inherit",
    },
  );
  execFileSync("touch", [join(tmp, ".complete")]);
  rmSync(dir, { recursive: true, force: true });
  renameSync(tmp, dir);
  return dir;
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  process.stdout.write(`${llamaSourceDir()}\n`);
}

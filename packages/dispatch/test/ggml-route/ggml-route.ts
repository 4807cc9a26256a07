// Test-time reference for route(): compiles ggml-route.c against the pinned ggml headers and
// node-llama-cpp's prebuilt ggml (the workspace's node-llama-cpp, found as tools/llama-source.mjs
// finds its bundle), caches the binary by content hash and runs it on ggml's CPU backend.

import { execFileSync, spawnSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, realpathSync, renameSync, rmSync, statSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import type { RoutingConfig } from "../../src/index.js";

const here = dirname(fileURLToPath(import.meta.url));
const packageDir = resolve(here, "../..");
const repoRoot = resolve(packageDir, "../..");

/** Set to 1 to let the ggml comparisons skip (with the reason printed) where they cannot run. */
export const ALLOW_MISSING_ENV = "MOESWARM_ALLOW_NO_GGML_REF";

export function ggmlLibDir(): string {
  if (process.platform !== "linux" || (process.arch !== "x64" && process.arch !== "arm64")) {
    throw new Error(`no node-llama-cpp prebuilt ggml for ${process.platform}-${process.arch}`);
  }
  const plat = `linux-${process.arch}`;
  for (const from of ["packages/worker-native", "packages/shard", "packages/backbone"]) {
    const link = join(repoRoot, from, "node_modules", "node-llama-cpp");
    if (!existsSync(link)) continue;
    // pnpm places a package's dependencies beside it in the virtual store
    const dir = join(dirname(realpathSync(link)), "@node-llama-cpp", plat, "bins", plat);
    if (existsSync(join(dir, "libggml-base.so"))) return dir;
  }
  throw new Error("node-llama-cpp's prebuilt ggml was not found in the workspace (run pnpm install)");
}

async function llamaSourceDir(): Promise<string> {
  const url = pathToFileURL(join(repoRoot, "tools", "llama-source.mjs")).href;
  const mod = (await import(url)) as { llamaSourceDir(): string };
  return mod.llamaSourceDir();
}

export interface GgmlRoute {
  readonly binary: string;
  readonly libDir: string;
  /** The CPU variant ggml loaded (from its log line, after a run), e.g. libggml-cpu-zen4.so. */
  variant: string;
  /** Routes every case in one process (loading the backends once). */
  routeMany(
    cases: readonly { logits: Float32Array; cfg: RoutingConfig }[],
  ): { ids: Int32Array; weights: Float32Array }[];
}

async function build(): Promise<GgmlRoute> {
  const libDir = ggmlLibDir();
  const include = join(await llamaSourceDir(), "ggml", "include");
  const source = join(here, "ggml-route.c");
  const libs = ["libggml.v0.4.0.so", "libggml-base.so"];
  const hash = createHash("sha256");
  hash.update(readFileSync(source));
  for (const h of ["ggml.h", "ggml-backend.h", "ggml-alloc.h"]) hash.update(readFileSync(join(include, h)));
  for (const l of libs) hash.update(`${l}\0${statSync(join(libDir, l)).size}`);
  const key = hash.digest("hex").slice(0, 16);
  const dir = join(packageDir, "node_modules", ".cache", "moeswarm-ggml-route", key);
  const binary = join(dir, "ggml-route");
  if (!existsSync(binary)) {
    mkdirSync(dir, { recursive: true });
    const tmp = `${binary}.tmp-${process.pid}`;
    try {
      execFileSync(
        "gcc",
        ["-O2", "-std=c11", "-Wall", "-I", include, source, "-o", tmp, "-L", libDir]
          .concat(libs.map((l) => `-l:${l}`))
          .concat([`-Wl,-rpath,${libDir}`, "-lm"]),
        { stdio: ["ignore", "pipe", "pipe"] },
      );
      renameSync(tmp, binary);
    } catch (err) {
      rmSync(tmp, { force: true });
      const stderr = (err as { stderr?: Buffer }).stderr?.toString() ?? "";
      throw new Error(`compiling ggml-route.c failed: ${(err as Error).message}\n${stderr}`);
    }
  }
  const api: GgmlRoute = {
    binary,
    libDir,
    variant: "unknown",
    routeMany(cases) {
      const parts: Uint8Array[] = [];
      for (const { logits, cfg } of cases) {
        const n = logits.length / cfg.nExpert;
        const gating = { softmax: 1, sigmoid: 2, softmax_weight: 3, sqrt_softplus: 4 }[cfg.gating];
        const selectOn = { probs: 0, logits: 1, sigmoid: 2 }[cfg.selectOn ?? "probs"];
        const header = new Int32Array([
          cfg.nExpert,
          n,
          cfg.nExpertUsed,
          gating,
          cfg.normalize ? 1 : 0,
          cfg.nExpertGroups ?? 0,
          cfg.nGroupUsed ?? 0,
          cfg.selectionBias ? 1 : 0,
          cfg.logitBias ? 1 : 0,
          selectOn,
        ]);
        parts.push(new Uint8Array(header.buffer));
        parts.push(new Uint8Array(new Float32Array([cfg.scale ?? 0]).buffer));
        parts.push(new Uint8Array(logits.slice().buffer));
        if (cfg.selectionBias) parts.push(new Uint8Array(Float32Array.from(cfg.selectionBias).buffer));
        if (cfg.logitBias) parts.push(new Uint8Array(Float32Array.from(cfg.logitBias).buffer));
      }
      const r = spawnSync(binary, [libDir], { input: Buffer.concat(parts), maxBuffer: 1 << 28 });
      if (r.error) throw r.error;
      if (r.status !== 0)
        throw new Error(`ggml-route exited ${r.status ?? r.signal}: ${r.stderr.toString()}`);
      const m = /loaded CPU backend from (\S+)/.exec(r.stderr.toString());
      if (m) api.variant = m[1]!.split("/").pop()!;
      const out = Uint8Array.from(r.stdout);
      let off = 0;
      return cases.map(({ logits, cfg }) => {
        const nk = (logits.length / cfg.nExpert) * cfg.nExpertUsed;
        const ids = new Int32Array(out.buffer.slice(off, off + 4 * nk));
        const weights = new Float32Array(out.buffer.slice(off + 4 * nk, off + 8 * nk));
        off += 8 * nk;
        return { ids, weights };
      });
    },
  };
  return api;
}

let cached: Promise<GgmlRoute> | undefined;

export async function ggmlRouteOrSkipReason(): Promise<GgmlRoute | string> {
  try {
    cached ??= build();
    return await cached;
  } catch (err) {
    if (process.env[ALLOW_MISSING_ENV] !== "1") throw err;
    const reason = `ggml routing reference unavailable, comparisons skipped (${ALLOW_MISSING_ENV}=1): ${(err as Error).message}`;
    console.warn(reason);
    return reason;
  }
}

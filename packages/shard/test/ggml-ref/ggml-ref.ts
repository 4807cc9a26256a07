// Test-time oracle: compiles ggml-ref.c with the machine's gcc against the pinned ggml headers and
// node-llama-cpp's prebuilt libggml-base, caches the binary by content hash, and runs it.

import { execFileSync, spawnSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, realpathSync, renameSync, rmSync, statSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const packageDir = resolve(here, "../..");
const repoRoot = resolve(packageDir, "../..");

/** Set to 1 to let the ggml comparisons skip (with the reason printed) where they cannot run. */
export const ALLOW_MISSING_ENV = "MOESWARM_ALLOW_NO_GGML_REF";

export interface GgmlTypeInfo {
  type: number;
  name: string;
  blockSize: number;
  typeSize: number;
  quantized: boolean;
  hasToFloat: boolean;
  requiresImatrix: boolean;
}

export interface GgmlRef {
  readonly binary: string;
  readonly libDir: string;
  info(): GgmlTypeInfo[];
  /** ggml_quantize_chunk(type, values, dst, 0, nRows, nPerRow, NULL) (Q8_K: quantize_row_q8_K_ref). */
  quantize(type: number, values: Float32Array, nPerRow: number): Uint8Array;
  /** ggml_get_type_traits(type)->to_float (Q8_K: dequantize_row_q8_K). */
  dequantize(type: number, bytes: Uint8Array, n: number): Float32Array;
}

/** Directory of node-llama-cpp's prebuilt CPU binaries for this platform (libggml-base.so). */
export function ggmlLibDir(): string {
  if (process.platform !== "linux" || (process.arch !== "x64" && process.arch !== "arm64")) {
    throw new Error(`no node-llama-cpp prebuilt ggml for ${process.platform}-${process.arch}`);
  }
  const nlc = realpathSync(join(packageDir, "node_modules", "node-llama-cpp"));
  const plat = `linux-${process.arch}`;
  // pnpm places a package's dependencies beside it in the virtual store
  const dir = join(dirname(nlc), "@node-llama-cpp", plat, "bins", plat);
  if (!existsSync(join(dir, "libggml-base.so"))) throw new Error(`libggml-base.so not found in ${dir}`);
  return dir;
}

/** The pinned llama.cpp source directory (tools/llama-source.mjs, extracted on first use). */
export async function llamaSourceDir(): Promise<string> {
  const url = pathToFileURL(join(repoRoot, "tools", "llama-source.mjs")).href;
  const mod = (await import(url)) as { llamaSourceDir(): string };
  return mod.llamaSourceDir();
}

function run(binary: string, args: string[], input: Uint8Array): Buffer {
  const r = spawnSync(binary, args, { input, maxBuffer: 1 << 30 });
  if (r.error) throw r.error;
  if (r.status !== 0) {
    throw new Error(
      `ggml-ref ${args.join(" ")} exited ${r.status ?? r.signal}: ${r.stderr.toString().trim()}`,
    );
  }
  return r.stdout;
}

async function build(): Promise<GgmlRef> {
  const libDir = ggmlLibDir();
  const include = join(await llamaSourceDir(), "ggml", "include");
  const source = join(here, "ggml-ref.c");
  const lib = join(libDir, "libggml-base.so");
  const hash = createHash("sha256");
  hash.update(readFileSync(source));
  hash.update(readFileSync(join(include, "ggml.h")));
  hash.update(`${lib}\0${statSync(lib).size}\0${statSync(lib).mtimeMs}`);
  const key = hash.digest("hex").slice(0, 16);
  const dir = join(packageDir, "node_modules", ".cache", "moeswarm-ggml-ref", key);
  const binary = join(dir, "ggml-ref");
  if (!existsSync(binary)) {
    mkdirSync(dir, { recursive: true });
    const tmp = `${binary}.tmp-${process.pid}`;
    try {
      execFileSync(
        "gcc",
        [
          "-O2",
          "-std=c11",
          "-Wall",
          "-I",
          include,
          source,
          "-o",
          tmp,
          "-L",
          libDir,
          "-l:libggml-base.so",
        ].concat(`-Wl,-rpath,${libDir}`),
        { stdio: ["ignore", "pipe", "pipe"] },
      );
      renameSync(tmp, binary); // atomic: parallel test files may race to build
    } catch (err) {
      rmSync(tmp, { force: true });
      const stderr = (err as { stderr?: Buffer }).stderr?.toString() ?? "";
      throw new Error(`compiling ggml-ref.c failed: ${(err as Error).message}\n${stderr}`);
    }
  }
  return {
    binary,
    libDir,
    info() {
      return run(binary, ["info"], new Uint8Array(0))
        .toString()
        .trim()
        .split("\n")
        .map((line) => {
          const [type, name, blockSize, typeSize, quantized, hasToFloat, requiresImatrix] = line.split(" ");
          return {
            type: Number(type),
            name: name!,
            blockSize: Number(blockSize),
            typeSize: Number(typeSize),
            quantized: quantized === "1",
            hasToFloat: hasToFloat === "1",
            requiresImatrix: requiresImatrix === "1",
          };
        });
    },
    quantize(type, values, nPerRow) {
      const nRows = values.length / nPerRow;
      const input = new Uint8Array(values.buffer, values.byteOffset, values.byteLength);
      const out = run(binary, ["quantize", String(type), String(nPerRow), String(nRows)], input);
      return new Uint8Array(out.buffer, out.byteOffset, out.byteLength);
    },
    dequantize(type, bytes, n) {
      const out = run(binary, ["dequantize", String(type), String(n)], bytes);
      // copy: the Buffer may sit at an offset that is not a multiple of 4
      return new Float32Array(Uint8Array.from(out).buffer);
    },
  };
}

let cached: Promise<GgmlRef> | undefined;

/** The compiled oracle (built once per process, cached on disk across runs). */
export function loadGgmlRef(): Promise<GgmlRef> {
  cached ??= build();
  return cached;
}

/**
 * The oracle, or — only when MOESWARM_ALLOW_NO_GGML_REF=1 — the reason it is unavailable, printed,
 * so the caller can skip. Without the variable a missing gcc or library fails the tests loudly.
 */
export async function ggmlRefOrSkipReason(): Promise<GgmlRef | string> {
  try {
    return await loadGgmlRef();
  } catch (err) {
    if (process.env[ALLOW_MISSING_ENV] !== "1") throw err;
    const reason = `ggml reference unavailable, comparisons skipped (${ALLOW_MISSING_ENV}=1): ${(err as Error).message}`;
    console.warn(reason);
    return reason;
  }
}

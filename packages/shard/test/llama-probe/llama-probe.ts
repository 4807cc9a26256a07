// Test-time oracle: compiles llama-probe.cpp with the machine's g++ against the pinned llama.cpp
// headers and node-llama-cpp's prebuilt libllama/libggml, caches the binary by content hash, and
// runs it: std::regex_search as llama.cpp's loader applies -ot patterns, and the memory llama.cpp
// itself computes for a model and context (a no_alloc load: nothing is allocated or read).
import { execFileSync, spawnSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, renameSync, rmSync, statSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { ggmlLibDir, llamaSourceDir } from "../ggml-ref/ggml-ref.js";

const here = dirname(fileURLToPath(import.meta.url));
const packageDir = resolve(here, "../..");

export interface ProbeBuffer {
  name: string;
  host: boolean;
  model: number;
  context: number;
  compute: number;
}

export interface ProbeMemory {
  n_ctx: number;
  n_ctx_seq: number;
  n_batch: number;
  n_ubatch: number;
  buffers: ProbeBuffer[];
  /** Tensors llama.cpp moved for the -ot overrides, in load order. */
  overridden: string[];
}

export interface ProbeOptions {
  ctx?: number;
  batch?: number;
  ubatch?: number;
  seqs?: number;
  typeK?: string;
  typeV?: string;
  flashAttention?: boolean;
  /** The value of `-ot`. */
  overrideTensor?: string;
}

export interface LlamaProbe {
  /** The names of `names` that std::regex_search(name, std::regex(pattern)) accepts. */
  regexSearch(pattern: string, names: readonly string[]): string[];
  memory(model: string, options?: ProbeOptions): ProbeMemory;
}

function run(binary: string, args: string[], input?: string): string {
  const r = spawnSync(binary, args, { input, encoding: "utf8", maxBuffer: 1 << 28, timeout: 120_000 });
  if (r.error) throw r.error;
  if (r.status !== 0)
    throw new Error(`llama-probe ${args[0]} exited ${r.status ?? r.signal}: ${r.stderr.trim()}`);
  return r.stdout;
}

async function build(): Promise<LlamaProbe> {
  const libDir = ggmlLibDir();
  const src = await llamaSourceDir();
  const source = join(here, "llama-probe.cpp");
  const libllama = join(libDir, "libllama.v0.4.0.so");
  const hash = createHash("sha256");
  hash.update(readFileSync(source));
  hash.update(readFileSync(join(src, "include", "llama.h")));
  hash.update(readFileSync(join(src, "src", "llama-ext.h")));
  hash.update(`${libllama}\0${statSync(libllama).size}\0${statSync(libllama).mtimeMs}`);
  const key = hash.digest("hex").slice(0, 16);
  const dir = join(packageDir, "node_modules", ".cache", "moeswarm-llama-probe", key);
  const binary = join(dir, "llama-probe");
  if (!existsSync(binary)) {
    mkdirSync(dir, { recursive: true });
    const tmp = `${binary}.tmp-${process.pid}`;
    try {
      execFileSync(
        "g++",
        [
          "-O1",
          "-std=c++17",
          "-I",
          join(src, "include"),
          "-I",
          join(src, "src"),
          "-I",
          join(src, "ggml", "include"),
          source,
          "-o",
          tmp,
          "-L",
          libDir,
          "-l:libllama.v0.4.0.so",
          "-l:libggml.v0.4.0.so",
          "-l:libggml-base.so",
          `-Wl,-rpath,${libDir}`,
        ],
        { stdio: ["ignore", "pipe", "pipe"] },
      );
      renameSync(tmp, binary); // atomic: parallel test files may race to build
    } catch (err) {
      rmSync(tmp, { force: true });
      const stderr = (err as { stderr?: Buffer }).stderr?.toString() ?? "";
      throw new Error(`compiling llama-probe.cpp failed: ${(err as Error).message}\n${stderr}`);
    }
  }
  return {
    regexSearch(pattern, names) {
      const out = run(binary, ["regex", pattern], `${names.join("\n")}\n`);
      return out.split("\n").filter((l) => l.length > 0);
    },
    memory(model, o = {}) {
      const args = ["memory", model, "--libdir", libDir];
      const opt = (flag: string, v: string | number | undefined) => {
        if (v !== undefined) args.push(flag, String(v));
      };
      opt("--ctx", o.ctx);
      opt("--batch", o.batch);
      opt("--ubatch", o.ubatch);
      opt("--seqs", o.seqs);
      opt("--type-k", o.typeK);
      opt("--type-v", o.typeV);
      opt("--fa", o.flashAttention === undefined ? undefined : o.flashAttention ? 1 : 0);
      opt("--ot", o.overrideTensor);
      return JSON.parse(run(binary, args)) as ProbeMemory;
    },
  };
}

let cached: Promise<LlamaProbe> | undefined;

/** The compiled probe (built once per process, cached on disk across runs). */
export function loadLlamaProbe(): Promise<LlamaProbe> {
  cached ??= build();
  return cached;
}

/** Sum of one field over every buffer type (this machine has only host buffers). */
export function total(m: ProbeMemory, field: "model" | "context" | "compute"): bigint {
  return m.buffers.reduce((s, b) => s + BigInt(b[field]), 0n);
}

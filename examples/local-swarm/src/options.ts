import { parseArgs } from "node:util";

export interface DemoOptions {
  preset: "tiny" | "small" | "medium";
  arch: "qwen3moe" | "qwen2moe" | "mixtral";
  prompt: string;
  tokens: number;
  workers: number;
  /** "all" or a list such as "0,1,4-7". */
  remoteLayers: string;
  /** llama.cpp threads of each decode, and compute threads of each worker. */
  threads: number;
  /** Where synthetic models are cached (reused across runs). */
  cacheDir: string;
  /** Where the workers keep their verified slices (reused across runs); empty: a fresh temp dir. */
  workerCacheDir: string;
  /** Seconds to wait for the workers to cover the model. */
  coverTimeoutS: number;
  /** Copies of each expert the hub asks for (2: the backbone can compare two workers' answers). */
  replicas: number;
  /** One more worker that lies (every output x1.05): the backbone must catch and name it. */
  liar: boolean;
  /** The bridge's trust: "verify" (default: two owners' answers compared) or "own" (taken as they come). */
  trust: "verify" | "own";
  /** The workers' `--backend` (default llama-cpu: bit-identical logits). */
  backend: string;
  /** The command that runs a worker's bin instead of this Node (e.g. an arm64 Node under qemu-user). */
  workerNode: string[] | undefined;
  /** The native data plane (workers listen natively; used under --trust own). */
  native: boolean;
}

const USAGE = `usage: pnpm demo [-- options]

Starts a hub (TLS on loopback) with its relay, workers as separate processes that claim, download,
verify and serve their expert slices on their own, then decodes a prompt twice with llama.cpp:
plain, and with its MoE layers handed to the swarm through the libggml-moeswarm plugin.

  --preset P        synthetic model size: tiny | small | medium (default small)
  --arch A          qwen3moe | qwen2moe | mixtral (default qwen3moe; medium is qwen3moe only)
  --prompt TEXT     the prompt (default: a sentence)
  --tokens N        tokens to generate (default 32)
  --workers N       worker processes (default 2)
  --remote-layers L MoE layers sent to the swarm: all | 0,1,4-7 (default all)
  --threads N       llama.cpp and worker threads (default 1)
  --cache-dir DIR   model cache (default .cache/models in this example)
  --worker-cache D  worker slice caches, reused across runs (default .cache/demo-workers here)
  --fresh           workers start with empty caches (download again)
  --cover-timeout S seconds to wait for full coverage (default 120)
  --replicas N      copies of each expert the hub asks for (default 2 under verify: answers are
                    compared; 1 under --trust own: each layer then has one owner, which the
                    native data plane serves)
  --liar            start one more worker that lies (outputs x1.05); the tokens must stay identical
  --trust T         verify (default: every part answered by two workers, compared and audited;
                    with one owner the backbone computes it itself) | own (answers taken as they
                    come; the layers whose every expert has one owner go native: the plugin
                    sends them straight to the owners' native listeners, not through the bridge
                    and relay)
  --no-native       the workers do not listen natively: every layer goes plugin -> bridge -> relay
  --backend B       the workers' compute backend (default llama-cpu: llama.cpp's own kernels, logits
                    bit-identical); another (worker: the static executable) must give the same tokens
  --worker-node CMD run the workers' bin with this command instead of this Node, e.g.
                    "qemu-aarch64-static -L /usr/aarch64-linux-gnu node-arm64/bin/node"
  -h, --help        this text`;

function int(text: string | undefined, name: string, fallback: number, min: number, max: number): number {
  if (text === undefined) return fallback;
  const n = Number(text);
  if (!/^\d+$/.test(text) || n < min || n > max)
    throw new Error(`--${name} must be an integer in ${min}..${max}`);
  return n;
}

function oneOf<T extends string>(
  text: string | undefined,
  name: string,
  values: readonly T[],
  fallback: T,
): T {
  if (text === undefined) return fallback;
  if (!(values as readonly string[]).includes(text))
    throw new Error(`--${name} must be one of ${values.join(", ")}`);
  return text as T;
}

/** Parses the demo's arguments; returns undefined after printing the usage for --help. */
export function parseDemoOptions(
  argv: string[],
  defaults: { cacheDir: string; workerCacheDir: string },
): DemoOptions | undefined {
  const { values } = parseArgs({
    args: argv,
    allowPositionals: false,
    options: {
      preset: { type: "string" },
      arch: { type: "string" },
      prompt: { type: "string" },
      tokens: { type: "string" },
      workers: { type: "string" },
      "remote-layers": { type: "string" },
      threads: { type: "string" },
      "cache-dir": { type: "string" },
      "worker-cache": { type: "string" },
      fresh: { type: "boolean" },
      "cover-timeout": { type: "string" },
      replicas: { type: "string" },
      liar: { type: "boolean" },
      backend: { type: "string" },
      trust: { type: "string" },
      "worker-node": { type: "string" },
      "no-native": { type: "boolean" },
      help: { type: "boolean", short: "h" },
    },
  });
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    return undefined;
  }
  const preset = oneOf(values.preset, "preset", ["tiny", "small", "medium"] as const, "small");
  const arch = oneOf(values.arch, "arch", ["qwen3moe", "qwen2moe", "mixtral"] as const, "qwen3moe");
  if (preset === "medium" && arch !== "qwen3moe") throw new Error("--preset medium exists for qwen3moe only");
  const remoteLayers = values["remote-layers"] ?? "all";
  if (!/^(all|\d+(-\d+)?(,\d+(-\d+)?)*)$/.test(remoteLayers)) {
    throw new Error('--remote-layers must be "all" or a list such as 0,1,4-7');
  }
  return {
    preset,
    arch,
    prompt: values.prompt ?? "The swarm of experts answered together:",
    tokens: int(values.tokens, "tokens", 32, 1, 4096),
    workers: int(values.workers, "workers", 2, 1, 16),
    remoteLayers,
    threads: int(values.threads, "threads", 1, 1, 256),
    cacheDir: values["cache-dir"] ?? defaults.cacheDir,
    workerCacheDir: values.fresh ? "" : (values["worker-cache"] ?? defaults.workerCacheDir),
    coverTimeoutS: int(values["cover-timeout"], "cover-timeout", 120, 1, 3600),
    replicas: int(values.replicas, "replicas", values.trust === "own" ? 1 : 2, 1, 16),
    liar: values.liar === true,
    backend: oneOf(
      values.backend,
      "backend",
      ["llama-cpu", "native", "worker", "vulkan", "ts", "auto"] as const,
      "llama-cpu",
    ),
    trust: oneOf(values.trust, "trust", ["verify", "own"] as const, "verify"),
    workerNode: values["worker-node"]?.split(/\s+/).filter(Boolean),
    native: values["no-native"] !== true,
  };
}

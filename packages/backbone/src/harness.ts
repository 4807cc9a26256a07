import { spawn } from "node:child_process";
import { readFile } from "node:fs/promises";
import { InvalidArgumentError, NativeError, onAbort, throwIfAborted } from "@moeswarm/core";
import { llamaCppBinsDir } from "@moeswarm/worker-native";
import { formatLayerSelection, type LayerSelection, parseLayerSelection } from "./layers.js";
import { logitsHarnessPath, pluginPath } from "./native-paths.js";

/** The plugin's own counters (its `ggml_backend_moeswarm_stats`), as the harness prints them. */
export interface PluginStats {
  /** graph_compute calls: one per remote layer and ubatch. */
  splits: number;
  failures: number;
  bytesOut: number;
  bytesIn: number;
  graphCacheHits: number;
  graphCacheMisses: number;
  /** Expert weights llama.cpp handed to the plugin at load and the plugin did not keep. */
  weightsDroppedBytes: number;
  weightsDroppedTensors: number;
  /**
   * The native data plane (a plugin that has it): splits sent straight to a worker, those that
   * fell back to the bridge (and why, by code), the round trip's p50 and its overhead (the round
   * trip less the worker's reported compute), receipts sent to the bridge and deferred.
   */
  native?: {
    splits: number;
    fallbacks: number;
    /** Failures after which the split went to the layer's alt natively (phase 3). */
    failovers?: number;
    /** Primaries silent for the table's hedgeMs raced to their alt, and races the alt won. */
    hedges?: number;
    hedgeWins?: number;
    roundTripP50Us: number;
    overheadP50Us: number;
    receipts: number;
    receiptsDeferred: number;
    failures: Record<string, number>;
  };
  /** Per layer: round trips (plugin -> bridge -> plugin) in microseconds. */
  layers: Record<
    string,
    { count: number; failures: number; tokens: number; meanUs: number; p50Us: number; p99Us: number }
  >;
}

export interface LogitsHarnessPlugin {
  /** `MOESWARM_BRIDGE`: `unix:/path` or `tcp:host:port` (a bridge's `address`). */
  bridge: string;
  /**
   * `MOESWARM_LAYERS`, the node-llama-cpp way of choosing layers (the plugin claims them in the
   * load-time probe). Leave it out when `overrides` (-ot) choose them.
   */
  layers?: LayerSelection | string;
  /** `MOESWARM_MODEL` (default "moeswarm"). */
  model?: string;
  /** `MOESWARM_TIMEOUT_MS`. */
  timeoutMs?: number;
}

export interface LogitsHarnessOptions {
  modelPath: string;
  prompt?: string;
  /** Tokens to generate greedily after the prompt (default 16). */
  nPredict?: number;
  /** Writes the raw f32 logits of every step here (n_vocab floats per step, prompt step first). */
  logitsPath?: string;
  /** `--ot` tensor buffer overrides, as llama-server takes them (`<regex>=<buffer type>`). */
  overrides?: readonly string[];
  /** Load the model without mmap (default: mmap). */
  noMmap?: boolean;
  threads?: number;
  ctx?: number;
  batch?: number;
  ubatch?: number;
  /** Load the plugin and send the MoE layers to this bridge; absent: plain llama.cpp. */
  plugin?: LogitsHarnessPlugin;
  /** Extra environment for the process. */
  env?: Record<string, string>;
  /** Kill the process after this long (default 120 s). */
  timeoutMs?: number;
  signal?: AbortSignal;
}

export interface LogitsHarnessResult {
  /** Whether every decode succeeded (the process exited 0). */
  ok: boolean;
  exitCode: number | null;
  prompt: number[];
  /** The generated tokens. */
  tokens: number[];
  /** Per generated token: the top logit minus the runner-up. */
  margins: number[];
  text: string;
  nVocab: number;
  loadMs: number;
  promptMs: number;
  /** Milliseconds of the single-token decodes, summed. */
  decodeMs: number;
  plugin: PluginStats | null;
  /** The tail of the process's stderr (llama.cpp's log and the harness's messages). */
  stderr: string;
  /** Resident set after the model and the context were loaded, and its peak, KiB (Linux). */
  rssLoadKiB: number;
  maxRssKiB: number;
}

const STDERR_TAIL = 16_384;
const MOESWARM_ENV = [
  "GGML_BACKEND_PATH",
  "MOESWARM_BRIDGE",
  "MOESWARM_LAYERS",
  "MOESWARM_MODEL",
  "MOESWARM_CONFIG",
  "MOESWARM_TIMEOUT_MS",
];

function intOption(name: string, v: number | undefined, lo: number, hi: number): void {
  if (v !== undefined && (!Number.isSafeInteger(v) || v < lo || v > hi)) {
    throw new InvalidArgumentError(`${name} must be an integer in ${lo}..${hi}`);
  }
}

/**
 * Runs `llama-logits` (greedy decoding with node-llama-cpp's libllama) in a child process, plain or
 * with the plugin, and returns what it printed. A failed decode is a result with `ok: false`; a
 * process that crashed, hung or printed nothing usable is a NativeError.
 */
export async function runLogitsHarness(options: LogitsHarnessOptions): Promise<LogitsHarnessResult> {
  if (typeof options?.modelPath !== "string" || options.modelPath.length === 0) {
    throw new InvalidArgumentError("runLogitsHarness: modelPath is required");
  }
  intOption("nPredict", options.nPredict, 0, 1 << 20);
  intOption("threads", options.threads, 1, 512);
  intOption("ctx", options.ctx, 8, 1 << 20);
  intOption("batch", options.batch, 1, 1 << 20);
  intOption("ubatch", options.ubatch, 1, 1 << 20);
  intOption("timeoutMs", options.timeoutMs, 1, 2 ** 31 - 1);
  throwIfAborted(options.signal);
  const bins = llamaCppBinsDir();
  const args = ["--model", options.modelPath, "--quiet", "--bins", bins];
  if (options.prompt !== undefined) args.push("--prompt", options.prompt);
  if (options.nPredict !== undefined) args.push("--n-predict", String(options.nPredict));
  if (options.logitsPath) args.push("--logits", options.logitsPath);
  for (const ot of options.overrides ?? []) args.push("--ot", ot);
  if (options.noMmap) args.push("--no-mmap");
  if (options.threads !== undefined) args.push("--threads", String(options.threads));
  if (options.ctx !== undefined) args.push("--ctx", String(options.ctx));
  if (options.batch !== undefined) args.push("--batch", String(options.batch));
  if (options.ubatch !== undefined) args.push("--ubatch", String(options.ubatch));

  const env: Record<string, string | undefined> = { ...process.env };
  for (const k of MOESWARM_ENV) delete env[k];
  env.LD_LIBRARY_PATH = env.LD_LIBRARY_PATH ? `${bins}:${env.LD_LIBRARY_PATH}` : bins;
  const p = options.plugin;
  if (p) {
    env.GGML_BACKEND_PATH = pluginPath();
    env.MOESWARM_BRIDGE = p.bridge;
    if (p.layers !== undefined) env.MOESWARM_LAYERS = formatLayerSelection(parseLayerSelection(p.layers));
    if (p.model !== undefined) env.MOESWARM_MODEL = p.model;
    if (p.timeoutMs !== undefined) env.MOESWARM_TIMEOUT_MS = String(p.timeoutMs);
  }
  Object.assign(env, options.env);

  const binary = logitsHarnessPath();
  const child = spawn(binary, args, { env, stdio: ["ignore", "pipe", "pipe"] });
  let stdout = "";
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (d: string) => {
    stdout += d;
  });
  child.stderr.setEncoding("utf8").on("data", (d: string) => {
    stderr = (stderr + d).slice(-STDERR_TAIL);
  });
  const timeoutMs = options.timeoutMs ?? 120_000;
  let killedFor: Error | undefined;
  const kill = (why: Error) => {
    killedFor ??= why;
    child.kill("SIGKILL");
  };
  const timer = setTimeout(
    () =>
      kill(new NativeError("MOESWARM_NATIVE_COMPUTE", `llama-logits did not finish within ${timeoutMs} ms`)),
    timeoutMs,
  );
  const aborting = onAbort(options.signal, (reason) => kill(reason as Error));
  const exit = await new Promise<{ code: number | null; sig: NodeJS.Signals | null }>((resolve, reject) => {
    child.once("error", (e) =>
      reject(new NativeError("MOESWARM_NATIVE_LOAD", `cannot start ${binary}: ${e.message}`, { cause: e })),
    );
    child.once("close", (code, sig) => resolve({ code, sig }));
  }).finally(() => {
    clearTimeout(timer);
    aborting[Symbol.dispose]();
  });
  if (killedFor) throw killedFor;
  const line = stdout.trim().split("\n").pop() ?? "";
  let parsed: Omit<LogitsHarnessResult, "exitCode" | "stderr">;
  try {
    parsed = JSON.parse(line) as Omit<LogitsHarnessResult, "exitCode" | "stderr">;
  } catch {
    throw new NativeError(
      "MOESWARM_NATIVE_COMPUTE",
      `llama-logits ${exit.sig ? `died of ${exit.sig}` : `exited with ${String(exit.code)}`} without its JSON line${stderr ? `:\n${stderr.trim().split("\n").slice(-15).join("\n")}` : ""}`,
      { details: { exitCode: exit.code, signal: exit.sig } },
    );
  }
  return { ...parsed, ok: parsed.ok && exit.code === 0, exitCode: exit.code, stderr };
}

/** The raw logits file of a harness run: `steps` rows of `nVocab` f32 values. */
export async function readLogits(path: string, nVocab: number): Promise<Float32Array[]> {
  const bytes = await readFile(path);
  if (bytes.byteLength % (4 * nVocab) !== 0) {
    throw new InvalidArgumentError(`${path} is not a whole number of ${nVocab}-float rows`);
  }
  const all = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4).slice();
  const rows: Float32Array[] = [];
  for (let i = 0; i < all.length; i += nVocab) rows.push(all.subarray(i, i + nVocab));
  return rows;
}

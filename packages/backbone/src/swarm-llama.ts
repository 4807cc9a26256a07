import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  type ExpertHandler,
  type ExpertTransport,
  InvalidArgumentError,
  linkedSignal,
  NativeError,
  throwIfAborted,
} from "@moeswarm/core";
import type { Placement } from "@moeswarm/dispatch";
import { llamaCppBinsDir, NODE_LLAMA_CPP_VERSION } from "@moeswarm/worker-native";
import type { Llama, LlamaLogLevel, LlamaModel, LlamaModelOptions } from "node-llama-cpp";
import {
  type BackboneBridge,
  type BackboneBridgeOptions,
  type BackboneHubOptions,
  serveBackboneBridge,
} from "./bridge.js";
import type { BridgeMetrics } from "./bridge-metrics.js";
import { checkHubOptions } from "./hub-options.js";
import { formatLayerSelection, type LayerSelection, parseLayerSelection } from "./layers.js";
import { pluginPath } from "./native-paths.js";
import type { BridgeSocket } from "./plugin-socket.js";
import { createLocalFallback, type LocalFallback } from "./worker-handler.js";

export interface SwarmLlamaOptions {
  /** The GGUF llama.cpp loads: the backbone's model (its experts are also the local fallback's). */
  modelPath: string;
  /** MoE layers whose routed experts go to the swarm: "all", an array, or "0,1,4-7". */
  remoteLayers: LayerSelection | string;
  /** Who serves which expert (a Placement, or a function for a live one), with `transport`. Exclusive with `hub`. */
  placement?: Placement | (() => Placement);
  transport?: ExpertTransport;
  /**
   * Instead of `placement` + `transport`: the hub's URL, a backbone token and the model id. The
   * bridge follows the hub's live placement, sends over its relay and reports statistics to it.
   */
  hub?: BackboneHubOptions;
  /**
   * Serves experts no live worker can: "local" (default, with either form) computes them from
   * `modelPath` with the llama-cpu compute, started at the first need (so it costs nothing while
   * the swarm covers every expert); false: none (the decode then fails); or a compute.
   */
  fallback?: ExpertHandler | "local" | false;
  /** The model id in the plugin's requests and the placement (default `hub.model`, else `placement.model`). */
  model?: string;
  /** Where the bridge listens (default: a Unix socket in a fresh temporary directory). */
  socket?: BridgeSocket;
  /** How long each worker request may take before failover (dispatch's default 30 s). */
  deadlineMs?: number;
  /** The bridge's result spot-checking (`serveBackboneBridge`'s `spotCheck`; the fallback is its reference). */
  spotCheck?: BackboneBridgeOptions["spotCheck"];
  /** The bridge's hedged requests (`serveBackboneBridge`'s `hedgeMs`). */
  hedgeMs?: number;
  /**
   * `serveBackboneBridge`'s `trust`: default "verify" over the hub's relay (two workers per part,
   * the local fallback decides a mismatch); "own" for a swarm of your own devices.
   */
  trust?: "verify" | "own";
  /** `serveBackboneBridge`'s `onQuarantine`. */
  onQuarantine?: BackboneBridgeOptions["onQuarantine"];
  /** How long the plugin waits for one layer's result (`MOESWARM_TIMEOUT_MS`, default 30 s). */
  pluginTimeoutMs?: number;
  /**
   * The native data plane (`serveBackboneBridge`'s `native`; default on, it acts only with `hub`
   * under trust "own"): false keeps every layer on the bridge path. The plugin's deadline for a
   * native split stays within `pluginTimeoutMs`.
   */
  native?: BackboneBridgeOptions["native"];
  /**
   * node-llama-cpp's model options; `gpuLayers` is always 0 (the backbone runs on the CPU), and
   * `useMmap` defaults to false: with mmap, llama.cpp populates the file's pages, so the experts the
   * plugin drops would still be resident (as page cache); without it they are never read into memory.
   */
  loadModel?: Omit<LlamaModelOptions, "modelPath" | "gpuLayers">;
  /** llama.cpp's log (default: warnings and errors are dropped, as node-llama-cpp does at "warn"). */
  logger?: (level: LlamaLogLevel, message: string) => void;
  /** Aborts the creation (the hub's connect, the model load); the SwarmLlama it returns is closed with close(). */
  signal?: AbortSignal;
}

export interface SwarmLlama extends AsyncDisposable {
  readonly llama: Llama;
  /** The loaded model: create contexts and sequences from it as usual. */
  readonly model: LlamaModel;
  readonly bridge: BackboneBridge;
  /** The remote layers (sorted; every MoE layer for "all" is reported as "all"). */
  readonly remoteLayers: LayerSelection;
  metrics(): BridgeMetrics;
  /** Disposes the model and llama, stops the bridge and the fallback, restores the environment. */
  close(): Promise<void>;
}

const ENV = [
  "GGML_BACKEND_PATH",
  "MOESWARM_BRIDGE",
  "MOESWARM_LAYERS",
  "MOESWARM_MODEL",
  "MOESWARM_TIMEOUT_MS",
  "MOESWARM_CONFIG",
  "MOESWARM_CLAIM_FILE",
] as const;

/** Undone in reverse order at close, or when the creation fails half-way. */
class Cleanups {
  private readonly steps: (() => Promise<void> | void)[] = [];

  push(step: () => Promise<void> | void): void {
    this.steps.push(step);
  }

  async run(): Promise<void> {
    for (const f of this.steps.splice(0).reverse()) await f();
  }
}

/** Checks what can be checked before anything starts; the remote layers. */
function checkSwarmOptions(options: SwarmLlamaOptions): LayerSelection {
  if (typeof options !== "object" || options === null || typeof options.modelPath !== "string") {
    throw new InvalidArgumentError("createSwarmLlama: modelPath is required");
  }
  const remoteLayers = parseLayerSelection(options.remoteLayers);
  if (options.hub !== undefined) {
    if (options.placement !== undefined || options.transport !== undefined) {
      throw new InvalidArgumentError("createSwarmLlama: give either hub or placement + transport, not both");
    }
    checkHubOptions(options.hub);
  } else if (options.placement === undefined || options.transport === undefined) {
    throw new InvalidArgumentError("createSwarmLlama: give hub, or placement and transport");
  }
  return remoteLayers;
}

/** The bridge on its socket (a fresh temporary one by default), with the fallback asked for. */
async function startBridge(
  options: SwarmLlamaOptions,
  binsDir: string,
  signal: AbortSignal | undefined,
  cleanups: Cleanups,
): Promise<BackboneBridge> {
  let socket = options.socket;
  if (socket === undefined) {
    const dir = mkdtempSync(join(tmpdir(), "moeswarm-bridge-"));
    cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
    socket = join(dir, "bridge.sock");
  }
  let fallback: ExpertHandler | undefined;
  if (options.fallback === undefined || options.fallback === "local") {
    const local: LocalFallback = await createLocalFallback(options.modelPath, { binsDir });
    cleanups.push(() => local.close());
    fallback = local.compute;
  } else if (typeof options.fallback === "function") {
    fallback = options.fallback;
  }
  const bridge = await serveBackboneBridge({
    socket,
    ...(options.model !== undefined ? { model: options.model } : {}),
    ...(options.hub !== undefined
      ? { hub: options.hub }
      : {
          placement: options.placement as Placement | (() => Placement),
          transport: options.transport as ExpertTransport,
        }),
    ...(fallback ? { fallback } : {}),
    ...(options.deadlineMs !== undefined ? { deadlineMs: options.deadlineMs } : {}),
    ...(options.spotCheck !== undefined ? { spotCheck: options.spotCheck } : {}),
    ...(options.hedgeMs !== undefined ? { hedgeMs: options.hedgeMs } : {}),
    ...(options.trust !== undefined ? { trust: options.trust } : {}),
    ...(options.onQuarantine !== undefined ? { onQuarantine: options.onQuarantine } : {}),
    native: nativeOf(options),
    ...(signal ? { signal } : {}),
  });
  cleanups.push(() => bridge.close());
  return bridge;
}

/** The bridge's `native` option, its deadline within the plugin's timeout. */
function nativeOf(options: SwarmLlamaOptions): BackboneBridgeOptions["native"] {
  const n = options.native;
  if (n === false) return false;
  const timeout = options.pluginTimeoutMs;
  if (timeout === undefined) return n ?? true;
  return { ...(typeof n === "object" ? n : {}), pluginTimeoutMs: timeout };
}

/**
 * The plugin's environment for the next model load (restored at close); the claim file, where the
 * plugin proves it was loaded and claimed the expert weights.
 */
function pluginEnvironment(
  plugin: string,
  settings: { bridge: string; layers: LayerSelection; model: string; timeoutMs: number | undefined },
  cleanups: Cleanups,
): string {
  const saved = new Map(ENV.map((k) => [k, process.env[k]]));
  cleanups.push(() => {
    for (const [k, v] of saved) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  });
  const previousPlugin = process.env.GGML_BACKEND_PATH;
  if (previousPlugin && previousPlugin !== plugin) {
    throw new InvalidArgumentError(
      `GGML_BACKEND_PATH is already ${previousPlugin}: ggml loads one out-of-tree backend per process`,
    );
  }
  process.env.GGML_BACKEND_PATH = plugin;
  process.env.MOESWARM_BRIDGE = settings.bridge;
  process.env.MOESWARM_LAYERS = formatLayerSelection(settings.layers);
  process.env.MOESWARM_MODEL = settings.model;
  if (settings.timeoutMs !== undefined) process.env.MOESWARM_TIMEOUT_MS = String(settings.timeoutMs);
  delete process.env.MOESWARM_CONFIG;

  // Proof that the plugin was loaded and claimed: it appends to MOESWARM_CLAIM_FILE for each
  // weight buffer. (Its buffer also shows in llama.cpp's load log, but node-llama-cpp sends
  // that only to the logger of the first Llama of the process.)
  const claimDir = mkdtempSync(join(tmpdir(), "moeswarm-claim-"));
  cleanups.push(() => rmSync(claimDir, { recursive: true, force: true }));
  const claimFile = join(claimDir, "claims");
  process.env.MOESWARM_CLAIM_FILE = claimFile;
  return claimFile;
}

const LOG_RANK: Record<string, number> = {
  disabled: -1,
  fatal: 0,
  error: 1,
  warn: 2,
  info: 3,
  log: 3,
  debug: 4,
};

/** node-llama-cpp, an optional peer dependency: only createSwarmLlama and the harness need it. */
async function importNodeLlamaCpp(): Promise<typeof import("node-llama-cpp")> {
  try {
    return await import("node-llama-cpp");
  } catch (cause) {
    throw new NativeError(
      "MOESWARM_NATIVE_PEER_MISSING",
      `createSwarmLlama needs node-llama-cpp, an optional peer dependency of @moeswarm/backbone: ${(cause as Error).message.split("\n")[0]}\n  possible solution: npm install node-llama-cpp@${NODE_LLAMA_CPP_VERSION}`,
      { cause },
    );
  }
}

/** node-llama-cpp's Llama on the CPU, from its prebuilt binaries; the model loaded into it. */
async function loadLlama(
  { getLlama, LlamaLogLevel: Levels }: typeof import("node-llama-cpp"),
  options: SwarmLlamaOptions,
  cleanups: Cleanups,
): Promise<{ llama: Llama; model: LlamaModel }> {
  const userLogger = options.logger;
  const llama = await getLlama({
    gpu: false,
    build: "never",
    usePrebuiltBinaries: true,
    skipDownload: true,
    progressLogs: false,
    logLevel: Levels.info,
    logger: (level, message) => {
      if (userLogger && (LOG_RANK[level] ?? 4) <= LOG_RANK.warn!) userLogger(level, message);
    },
  });
  cleanups.push(() => llama.dispose());
  const model = await llama.loadModel({
    useMmap: false,
    ...options.loadModel,
    modelPath: options.modelPath,
    gpuLayers: 0,
  });
  cleanups.push(() => model.dispose());
  return { llama, model };
}

function checkClaimed(claimFile: string, remoteLayers: LayerSelection): void {
  const claimed = existsSync(claimFile) && readFileSync(claimFile, "utf8").includes("buffer ");
  const wantsRemote = remoteLayers === "all" || remoteLayers.length > 0;
  if (wantsRemote && !claimed) {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      "llama.cpp loaded the model without the MOESWARM device: node-llama-cpp had loaded its backends before " +
        "GGML_BACKEND_PATH was set (another getLlama without it ran first in this process), or no layer of the model matched " +
        `${formatLayerSelection(remoteLayers)}\n  possible solution: call createSwarmLlama before any other getLlama, or run it in its own process`,
    );
  }
}

/**
 * node-llama-cpp in this process with libggml-moeswarm.so loaded, its MoE layers answered by a
 * bridge on this process's event loop (node-llama-cpp decodes on its own threads, so the plugin
 * can block on the socket while the bridge answers). CPU only; nothing is built or downloaded.
 *
 * The plugin is loaded with node-llama-cpp's backends, once per process: this must run before any
 * other `getLlama` of the process, or it fails with NativeError MOESWARM_NATIVE_LOAD. Layers and
 * the bridge may differ between calls (the plugin re-reads its environment at each model load).
 */
export async function createSwarmLlama(options: SwarmLlamaOptions): Promise<SwarmLlama> {
  const remoteLayers = checkSwarmOptions(options);
  throwIfAborted(options.signal);
  const plugin = pluginPath();
  const binsDir = llamaCppBinsDir();
  const nodeLlamaCpp = await importNodeLlamaCpp();

  // the bridge sees the caller's signal only while this call runs: later, close() ends it
  const creating = options.signal ? linkedSignal([options.signal]) : undefined;
  const cleanups = new Cleanups();
  cleanups.push(() => creating?.dispose());
  try {
    const bridge = await startBridge(options, binsDir, creating?.signal, cleanups);
    const given = options.placement;
    const model =
      options.model ??
      options.hub?.model ??
      (typeof given === "function" ? given() : (given as Placement)).model;
    const claimFile = pluginEnvironment(
      plugin,
      { bridge: bridge.address, layers: remoteLayers, model, timeoutMs: options.pluginTimeoutMs },
      cleanups,
    );
    const loaded = await loadLlama(nodeLlamaCpp, options, cleanups);
    checkClaimed(claimFile, remoteLayers);
    throwIfAborted(options.signal);
    creating?.dispose();
    let closing: Promise<void> | undefined;
    const close = () => {
      closing ??= cleanups.run();
      return closing;
    };
    return {
      llama: loaded.llama,
      model: loaded.model,
      bridge,
      remoteLayers,
      metrics: () => bridge.metrics(),
      close,
      [Symbol.asyncDispose]: close,
    };
  } catch (error) {
    await cleanups.run();
    throw error;
  }
}

import { type ChildProcess, spawn } from "node:child_process";
import { createRequire } from "node:module";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";
import { frameAllocatorEnv } from "@moeswarm/core";
import { type WorkerEvent, workerCliPath } from "@moeswarm/worker";

/** What the demo learns about one worker process from its `--json` event lines. */
export interface WorkerView {
  id: string;
  process: ChildProcess;
  /** The slices it registered (layers "a:b", experts "c:d"), in order: a worker keeps claiming while it has room. */
  slices: Array<{ layers: string; experts: string }>;
  downloadedBytes: number;
  downloadMs: number;
  reusedCache: boolean;
  backend?: string;
  served: boolean;
  exitCode: number | null | undefined;
  /** The last lines of its stderr, for a failure report. */
  stderr: string[];
}

export interface SpawnWorkersOptions {
  count: number;
  /** Each worker's id (its token is bound to it). */
  ids: string[];
  hubUrl: string;
  model: string;
  tokens: string[];
  /** Each worker's capacity in bytes. */
  capacityBytes: number[];
  caFile: string;
  cacheDirs: string[];
  threads: number;
  /** These workers lie (src/liar-worker.ts: every output scaled by 1.05). */
  liar?: boolean;
  onEvent: (worker: WorkerView, event: WorkerEvent) => void;
  /** The workers' --backend (default llama-cpu). */
  backend?: string;
  /** Runs the bin with this command instead of this Node (an arm64 Node under qemu-user). */
  workerNode?: string[] | undefined;
  /**
   * Each worker also serves the native data plane on a loopback port of its own
   * (`--listen-native 127.0.0.1:0`): under `--trust own` the plugin then sends the layers a worker
   * holds whole straight to it (default true).
   */
  native?: boolean;
}

/** How to start worker `i`: the `moeswarm-worker` bin, or the demo's liar under tsx. */
function workerCommand(options: SpawnWorkersOptions): string[] {
  if (options.liar) {
    const require = createRequire(import.meta.url);
    const tsx = pathToFileURL(require.resolve("tsx/esm")).href;
    return ["--import", tsx, join(import.meta.dirname, "liar-worker.ts")];
  }
  return [workerCliPath()];
}

/**
 * Starts the workers as separate processes, each with nothing but the hub's URL, a worker token,
 * its capacity and a cache directory: they find the demand, claim, download, verify, load and
 * register by themselves. Their `--json` events drive the demo's progress display.
 */
export function spawnWorkers(options: SpawnWorkersOptions): WorkerView[] {
  const views: WorkerView[] = [];
  for (let i = 0; i < options.count; i++) {
    const id = options.ids[i]!;
    const [node, ...nodeArgs] = options.workerNode ?? [process.execPath];
    const child = spawn(
      node!,
      [
        ...nodeArgs,
        ...workerCommand(options),
        "--hub",
        options.hubUrl,
        "--token",
        options.tokens[i]!,
        "--id",
        id,
        "--model",
        options.model,
        "--capacity",
        String(options.capacityBytes[i]),
        "--cache-dir",
        options.cacheDirs[i]!,
        "--ca",
        options.caFile,
        // llama.cpp's own CPU kernels: the swarm's numbers are then plain llama.cpp's, bit for bit
        "--backend",
        options.backend ?? "llama-cpu",
        "--threads",
        String(options.threads),
        "--poll",
        "0.5",
        ...(options.native === false ? [] : ["--listen-native", "127.0.0.1:0"]),
        "--json",
      ],
      // glibc malloc tuned for large frames, as docs/deploy.md has operators start a worker
      { stdio: ["ignore", "pipe", "pipe"], env: frameAllocatorEnv() },
    );
    const view: WorkerView = {
      id,
      process: child,
      slices: [],
      downloadedBytes: 0,
      downloadMs: 0,
      reusedCache: false,
      served: false,
      exitCode: undefined,
      stderr: [],
    };
    views.push(view);
    createInterface({ input: child.stdout! }).on("line", (line) => {
      let event: WorkerEvent;
      try {
        event = JSON.parse(line) as WorkerEvent;
      } catch {
        return; // not an event line
      }
      if (event.event === "registered") {
        view.slices.push({ layers: event.layers, experts: event.experts });
      } else if (event.event === "downloaded") {
        view.downloadedBytes += event.bytes;
        view.downloadMs += event.ms;
      } else if (event.event === "verified" && event.reused) {
        view.reusedCache = true;
      } else if (event.event === "loaded") {
        view.backend = event.backend;
      } else if (event.event === "serving") {
        view.served = true;
      }
      options.onEvent(view, event);
    });
    createInterface({ input: child.stderr! }).on("line", (line) => {
      view.stderr.push(line);
      if (view.stderr.length > 40) view.stderr.shift();
    });
    child.on("exit", (code) => {
      view.exitCode = code;
    });
  }
  return views;
}

/** SIGTERM: each worker drains (finishes in-flight requests, deregisters) and exits 0. */
export async function stopWorkers(views: readonly WorkerView[], timeoutMs = 15_000): Promise<void> {
  await Promise.all(
    views.map(
      (v) =>
        new Promise<void>((resolve) => {
          if (v.process.exitCode !== null || v.process.signalCode !== null) return resolve();
          const timer = setTimeout(() => {
            v.process.kill("SIGKILL");
          }, timeoutMs);
          v.process.once("exit", () => {
            clearTimeout(timer);
            resolve();
          });
          v.process.kill("SIGTERM");
        }),
    ),
  );
}

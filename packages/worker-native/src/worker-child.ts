import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process";
import {
  decodeFrame,
  NativeError,
  onAbort,
  type RegisterFrame,
  readFrames,
  throwIfAborted,
} from "@moeswarm/core";
import { errorFromCode } from "./error-from-code.js";

// One process of the worker executable, from spawn to its register frame: what
// WorkerProcessCompute starts at first and again after a crash (worker-process.ts).

const STDERR_TAIL = 4096;

/** What starting one process needs (a subset of SpawnExpertWorkerOptions, resolved). */
export interface ChildSpec {
  cmd: string;
  args: readonly string[];
  env: Record<string, string | undefined>;
  maxFrameBytes: number;
  startTimeoutMs: number;
}

/** A started worker process that has registered. */
export interface WorkerChild {
  child: ChildProcessWithoutNullStreams;
  registration: RegisterFrame;
  frames: AsyncGenerator<Uint8Array>;
  /** Settles when the process has exited and its stdio closed. */
  exited: Promise<void>;
  /** The last 4 KiB of its stderr. */
  stderr: { text: string };
}

/** How a process ended, for messages: "code 1" / "signal SIGABRT", and the tail of its stderr. */
export function describeExit(child: ChildProcessWithoutNullStreams, stderr: { text: string }): string {
  const how = child.signalCode !== null ? `signal ${child.signalCode}` : `code ${String(child.exitCode)}`;
  const tail = stderr.text.trim();
  return `${how}${tail ? `: ${tail}` : ""}`;
}

/** Kills the process unless it has exited (SIGKILL: it may be wedged). */
export function killChild(child: ChildProcessWithoutNullStreams): void {
  if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
}

/**
 * Starts the process and waits for its register frame (an error frame before it is the load's
 * error; exit, timeout or abort reject with NativeError MOESWARM_NATIVE_LOAD or the reason). The
 * process is killed on any failure.
 */
export async function startWorkerChild(spec: ChildSpec, signal?: AbortSignal): Promise<WorkerChild> {
  throwIfAborted(signal);
  const { cmd } = spec;
  const child = spawn(cmd, [...spec.args], {
    stdio: ["pipe", "pipe", "pipe"],
    env: spec.env,
    windowsHide: true,
  });
  const stderr = { text: "" };
  child.stderr.on("data", (chunk: Buffer) => {
    stderr.text = (stderr.text + chunk.toString("utf8")).slice(-STDERR_TAIL);
  });
  // a dead stdin must not become an unhandled 'error' event; writes report it instead
  child.stdin.on("error", () => {});
  const exited = new Promise<void>((resolve) => child.once("close", () => resolve()));
  const spawnError = new Promise<never>((_, reject) =>
    child.once("error", (cause) =>
      reject(new NativeError("MOESWARM_NATIVE_LOAD", `cannot start ${cmd}: ${cause.message}`, { cause })),
    ),
  );
  spawnError.catch(() => {});
  const frames = readFrames(child.stdout, { maxFrameBytes: spec.maxFrameBytes });
  let timer: NodeJS.Timeout | undefined;
  let aborted: Disposable | undefined;
  try {
    const startup = (async (): Promise<RegisterFrame> => {
      for (;;) {
        const next = await frames.next();
        if (next.done) {
          await exited;
          throw new NativeError(
            "MOESWARM_NATIVE_LOAD",
            `the worker exited before registering (code ${String(child.exitCode)}, signal ${String(child.signalCode)})${stderr.text ? `: ${stderr.text.trim()}` : ""}`,
          );
        }
        const frame = decodeFrame(next.value, { copy: true });
        if (frame.t === "register") return frame;
        if (frame.t === "error") throw errorFromCode(frame.code, frame.msg, { stderr: stderr.text });
      }
    })();
    const limit = new Promise<never>((_, reject) => {
      timer = setTimeout(
        () =>
          reject(
            new NativeError(
              "MOESWARM_NATIVE_LOAD",
              `the worker did not register within ${spec.startTimeoutMs} ms`,
            ),
          ),
        spec.startTimeoutMs,
      );
      aborted = onAbort(signal, reject);
    });
    const registration = await Promise.race([startup, limit, spawnError]);
    return { child, registration, frames, exited, stderr };
  } catch (error) {
    killChild(child);
    void frames.return(undefined);
    throw error;
  } finally {
    clearTimeout(timer);
    aborted?.[Symbol.dispose]();
  }
}

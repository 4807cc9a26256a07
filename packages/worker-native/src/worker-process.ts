import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process";
import {
  abortReason,
  DEFAULT_MAX_FRAME_BYTES,
  decodeFrame,
  dispatchFrame,
  drainFrame,
  type Frame,
  InvalidArgumentError,
  isMoeswarmError,
  NativeError,
  onAbort,
  type RegisterFrame,
  readFrames,
  TransportError,
  throwIfAborted,
  traceHop,
  writeFrame,
} from "@moeswarm/core";
import { readGguf } from "@moeswarm/shard";
import { errorFromCode } from "./error-from-code.js";
import {
  ACTIVATIONS,
  type Activation,
  checkRunRequest,
  type ExpertCompute,
  type ExpertComputeInfo,
  type RunOptions,
  type RunRequest,
} from "./expert-compute.js";
import { layoutInfo, sliceLayout } from "./slice-layout.js";

export interface SpawnExpertWorkerOptions {
  /** Compute threads (default: all CPUs). */
  threads?: number;
  /** Override the activation chosen from `general.architecture`. */
  act?: Activation | "auto";
  /** Keep llama.cpp's default CPU_REPACK weight layout (default true). */
  repack?: boolean;
  /** Model id the worker registers (default: the slice's general.name). */
  model?: string;
  /** ggml device: "cpu" (default), "gpu" or a device name (GPU builds of the executable only). */
  device?: string;
  /** Largest frame either side accepts (default 64 MiB). */
  maxFrameBytes?: number;
  /**
   * Most (token, expert) rows per compute graph; a request with more is computed in chunks of at most
   * this many. On a GPU device the compute buffer is reserved at load for this many and never grows
   * (default 512 there, `GPU_MAX_BATCH_ROWS`); on the CPU the default is no limit.
   */
  maxBatchRows?: number;
  /** Time allowed for loading the slice, until the worker registers (default 120 s). */
  startTimeoutMs?: number;
  /** Time allowed after `drain` before the process is killed (default 10 s). */
  closeTimeoutMs?: number;
  /** Extra environment for the process. */
  env?: Record<string, string>;
  /**
   * Runs the executable through this program, e.g. "qemu-aarch64-static" for an aarch64 build
   * (default: the environment's MOESWARM_WORKER_LAUNCHER, so that an emulated participant, an
   * arm64 Node under qemu-user without binfmt, can start its aarch64 executable).
   */
  launcher?: string;
  /** More command-line arguments for the executable (after the ones these options make). */
  extraArgs?: readonly string[];
  signal?: AbortSignal;
}

interface Pending {
  resolve(y: Float32Array): void;
  reject(error: unknown): void;
  n: number;
  k: number;
  mode: "each" | "sum";
  cleanup(): void;
}

const STDERR_TAIL = 4096;

function checkOptions(o: SpawnExpertWorkerOptions): void {
  const int = (name: string, v: number | undefined, lo: number, hi: number) => {
    if (v !== undefined && (!Number.isSafeInteger(v) || v < lo || v > hi)) {
      throw new InvalidArgumentError(`${name} must be an integer in ${lo}..${hi}, got ${String(v)}`);
    }
  };
  int("threads", o.threads, 0, 512);
  int("maxFrameBytes", o.maxFrameBytes, 64, 0xffff_ffff);
  int("maxBatchRows", o.maxBatchRows, 1, 65536);
  int("startTimeoutMs", o.startTimeoutMs, 1, 2 ** 31 - 1);
  int("closeTimeoutMs", o.closeTimeoutMs, 1, 2 ** 31 - 1);
  if (o.act !== undefined && o.act !== "auto" && !ACTIVATIONS.includes(o.act)) {
    throw new InvalidArgumentError(`unknown activation ${String(o.act)}`);
  }
  if (
    o.extraArgs !== undefined &&
    (!Array.isArray(o.extraArgs) || o.extraArgs.some((a: unknown) => typeof a !== "string"))
  ) {
    throw new InvalidArgumentError("extraArgs must be an array of strings");
  }
  if (o.model !== undefined && (typeof o.model !== "string" || o.model.length === 0)) {
    throw new InvalidArgumentError("model must be a non-empty string");
  }
}

/**
 * The standalone executable behind the ExpertCompute interface: a child process speaking the
 * wire protocol on its stdin/stdout. Runs are sent as `dispatch` frames and may be in flight
 * together (the worker answers them in order).
 */
export class WorkerProcessCompute implements ExpertCompute {
  readonly info: ExpertComputeInfo;
  /** The worker's register frame. */
  readonly registration: RegisterFrame;
  readonly #child: ChildProcessWithoutNullStreams;
  readonly #pending = new Map<number, Pending>();
  readonly #experts: ReadonlySet<number>;
  readonly #maxFrameBytes: number;
  readonly #closeTimeoutMs: number;
  readonly #exited: Promise<void>;
  readonly #stderr: { text: string };
  #nextId = 0;
  #computeMs = 0;
  #answered = 0;
  #failure: Error | undefined;
  #closing: Promise<void> | undefined;

  private constructor(
    child: ChildProcessWithoutNullStreams,
    info: ExpertComputeInfo,
    registration: RegisterFrame,
    frames: AsyncGenerator<Uint8Array>,
    exited: Promise<void>,
    stderr: { text: string },
    options: SpawnExpertWorkerOptions,
  ) {
    this.#child = child;
    this.info = info;
    this.registration = registration;
    this.#experts = new Set(info.experts);
    this.#maxFrameBytes = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
    this.#closeTimeoutMs = options.closeTimeoutMs ?? 10_000;
    this.#exited = exited;
    this.#stderr = stderr;
    void this.#readLoop(frames);
    exited.then(() => this.#fail(this.#exitError()));
  }

  static async spawn(
    binaryPath: string,
    slicePath: string,
    options: SpawnExpertWorkerOptions = {},
  ): Promise<WorkerProcessCompute> {
    checkOptions(options);
    throwIfAborted(options.signal);
    const args = ["--slice", slicePath];
    if (options.threads !== undefined) args.push("--threads", String(options.threads));
    if (options.act !== undefined) args.push("--act", options.act);
    if (options.repack === false) args.push("--no-repack");
    if (options.model !== undefined) args.push("--model", options.model);
    if (options.device !== undefined) args.push("--device", options.device);
    if (options.maxFrameBytes !== undefined) args.push("--max-frame", String(options.maxFrameBytes));
    if (options.maxBatchRows !== undefined) args.push("--max-batch-rows", String(options.maxBatchRows));
    if (options.extraArgs) args.push(...options.extraArgs);
    const launcher = options.launcher ?? (process.env.MOESWARM_WORKER_LAUNCHER || undefined);
    const [cmd, cmdArgs] = launcher ? [launcher, [binaryPath, ...args]] : [binaryPath, args];
    const child = spawn(cmd, cmdArgs, {
      stdio: ["pipe", "pipe", "pipe"],
      env: { ...process.env, ...options.env },
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

    const frames = readFrames(child.stdout, {
      maxFrameBytes: options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES,
    });
    const kill = () => {
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
    };
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
                `the worker did not register within ${options.startTimeoutMs ?? 120_000} ms`,
              ),
            ),
          options.startTimeoutMs ?? 120_000,
        );
        aborted = onAbort(options.signal, reject);
      });
      const registration = await Promise.race([startup, limit, spawnError]);
      const header = await readGguf(slicePath, options.signal ? { signal: options.signal } : {});
      const layout = sliceLayout(header, options.act ? { act: options.act } : {});
      const info: ExpertComputeInfo = {
        backend: "worker",
        ...layoutInfo(layout),
        ...(options.threads ? { threads: options.threads } : {}),
        ...(registration.backend ? { device: registration.backend } : {}),
      };
      const sameLayers = registration.layers.join() === info.layers.join();
      const sameExperts = registration.experts.join() === [...info.experts].sort((a, b) => a - b).join();
      if (!sameLayers || !sameExperts) {
        throw new NativeError(
          "MOESWARM_NATIVE_LOAD",
          "the worker registered other layers or experts than the slice holds",
        );
      }
      return new WorkerProcessCompute(child, info, registration, frames, exited, stderr, options);
    } catch (error) {
      kill();
      void frames.return(undefined);
      throw error;
    } finally {
      clearTimeout(timer);
      aborted?.[Symbol.dispose]();
    }
  }

  /** Runs answered, and the compute milliseconds the worker reported for them (`ms` of its results). */
  get computeStats(): { runs: number; computeMs: number } {
    return { runs: this.#answered, computeMs: this.#computeMs };
  }

  /** The process id of the worker (undefined once it could not start). */
  get pid(): number | undefined {
    return this.#child.pid;
  }

  #exitError(): Error {
    const { exitCode, signalCode } = this.#child;
    const tail = this.#stderr.text.trim();
    return new TransportError(
      "MOESWARM_TRANSPORT_CLOSED",
      `the worker process exited (code ${String(exitCode)}, signal ${String(signalCode)})${tail ? `: ${tail}` : ""}`,
    );
  }

  /** Fails every request in flight and every later one with `error`. */
  #fail(error: Error): void {
    this.#failure ??= error;
    for (const p of this.#pending.values()) {
      p.cleanup();
      p.reject(error);
    }
    this.#pending.clear();
  }

  async #readLoop(frames: AsyncGenerator<Uint8Array>): Promise<void> {
    try {
      for await (const payload of frames) {
        let frame: Frame;
        try {
          frame = decodeFrame(payload, { copy: true });
        } catch (error) {
          // a worker that sends garbage cannot be trusted with the requests it holds
          this.#fail(error as Error);
          this.#child.kill("SIGKILL");
          return;
        }
        this.#onFrame(frame);
      }
    } catch (error) {
      this.#fail(isMoeswarmError(error) ? error : this.#exitError());
    }
  }

  #onFrame(frame: Frame): void {
    traceHop("wp.read", frame.t === "result" ? frame.id : undefined);
    if (frame.t === "result") {
      const p = this.#pending.get(frame.id);
      if (!p) return; // aborted by the caller: the late answer is dropped
      this.#pending.delete(frame.id);
      p.cleanup();
      if (frame.n !== p.n || frame.k !== p.k || frame.mode !== p.mode || frame.embd !== this.info.nEmbd) {
        p.reject(
          new NativeError("MOESWARM_NATIVE_COMPUTE", "the worker answered with a result of another shape"),
        );
        return;
      }
      this.#answered++;
      if (frame.ms !== undefined) this.#computeMs += frame.ms;
      p.resolve(frame.y);
    } else if (frame.t === "error") {
      if (frame.id === undefined) {
        this.#fail(errorFromCode(frame.code, frame.msg));
        return;
      }
      const p = this.#pending.get(frame.id);
      if (!p) return;
      this.#pending.delete(frame.id);
      p.cleanup();
      p.reject(errorFromCode(frame.code, frame.msg, { id: frame.id }));
    }
  }

  run(request: RunRequest, options: RunOptions = {}): Promise<Float32Array> {
    if (this.#closing)
      return Promise.reject(new NativeError("MOESWARM_NATIVE_CLOSED", "the expert compute was closed"));
    if (this.#failure) return Promise.reject(this.#failure);
    let n: number;
    try {
      // q8 rows go to the executable, whose core takes them (CPU) or refuses them (a GPU)
      n = checkRunRequest(request, this.info, this.#experts, { quantized: true });
    } catch (error) {
      return Promise.reject(error);
    }
    const { signal } = options;
    if (signal?.aborted) return Promise.reject(abortReason(signal));
    const id = this.#nextId;
    this.#nextId = (this.#nextId + 1) % 0x1_0000_0000;
    const frame = dispatchFrame({
      id,
      model: this.registration.model,
      layer: request.layer,
      n,
      embd: this.info.nEmbd,
      ...(request.xType !== undefined
        ? { dtype: request.xType, x: request.x as Uint8Array }
        : { dtype: "f32" as const, x: request.x as Float32Array }),
      k: request.k,
      ids: request.ids,
      ...(request.w ? { w: request.w } : {}),
      mode: request.mode,
    });
    return new Promise<Float32Array>((resolve, reject) => {
      const registration = onAbort(signal, (reason) => {
        this.#pending.delete(id);
        reject(reason);
      });
      const cleanup = () => registration[Symbol.dispose]();
      this.#pending.set(id, { resolve, reject, n, k: request.k, mode: request.mode, cleanup });
      traceHop("wp.write", id);
      writeFrame(this.#child.stdin, frame, { maxFrameBytes: this.#maxFrameBytes }).catch((error: unknown) => {
        if (this.#pending.delete(id)) {
          cleanup();
          reject(error);
        }
      });
    });
  }

  /** Sends `drain`: the worker answers what it holds, then exits; killed after closeTimeoutMs. */
  close(): Promise<void> {
    this.#closing ??= (async () => {
      const child = this.#child;
      if (child.exitCode === null && child.signalCode === null) {
        try {
          await writeFrame(child.stdin, drainFrame({ reason: "close" }));
          child.stdin.end();
        } catch {
          // already gone: the exit below settles it
        }
        const timer = setTimeout(() => child.kill("SIGKILL"), this.#closeTimeoutMs);
        await this.#exited;
        clearTimeout(timer);
      }
      this.#fail(new NativeError("MOESWARM_NATIVE_CLOSED", "the expert compute was closed"));
    })();
    return this.#closing;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

/** Starts the executable on a slice and returns it as an ExpertCompute (backend "worker"). */
export function spawnExpertWorker(
  binaryPath: string,
  slicePath: string,
  options: SpawnExpertWorkerOptions = {},
): Promise<WorkerProcessCompute> {
  return WorkerProcessCompute.spawn(binaryPath, slicePath, options);
}

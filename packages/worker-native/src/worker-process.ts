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
  sleep,
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
import {
  type ChildSpec,
  describeExit,
  killChild,
  startWorkerChild,
  type WorkerChild,
} from "./worker-child.js";

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
  /** What to do when the process dies while the compute is open (default: restart, see {@link RestartPolicy}). */
  restart?: RestartPolicy | false;
  signal?: AbortSignal;
}

/**
 * What happens when the process dies while the compute is open (a crash, a kill): it is started
 * again on the same slice, after `backoffMs` (doubled for each other restart in the window, at
 * most 30 s), at most `max` times within `windowMs`; past that the compute refuses every request
 * with NativeError MOESWARM_NATIVE_WORKER_RESTARTS_EXHAUSTED. Requests the dead process held are
 * rejected at once with MOESWARM_NATIVE_WORKER_CRASHED (never re-sent: the request may be what
 * killed it, and a dispatcher serves it on a replica meanwhile); requests made during the restart
 * wait for the new process (or their signal). `false`: no restart, every later request fails
 * with TransportError MOESWARM_TRANSPORT_CLOSED.
 */
export interface RestartPolicy {
  /** Restarts allowed within `windowMs` (default 3). */
  max?: number;
  /** The window the restarts are counted in (default 10 minutes). */
  windowMs?: number;
  /** Wait before the first restart in the window (default 1000 ms). */
  backoffMs?: number;
  /** Told of each restart: the number in the window and why (the dead process's exit). */
  onRestart?: (event: { restarts: number; error: Error }) => void;
}

interface Pending {
  resolve(y: Float32Array): void;
  reject(error: unknown): void;
  n: number;
  k: number;
  mode: "each" | "sum";
  cleanup(): void;
}

const MAX_BACKOFF_MS = 30_000;

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
  if (o.restart !== undefined && o.restart !== false) {
    if (typeof o.restart !== "object" || o.restart === null) {
      throw new InvalidArgumentError("restart must be false or an object");
    }
    int("restart.max", o.restart.max, 0, 1_000_000);
    int("restart.windowMs", o.restart.windowMs, 1, 2 ** 31 - 1);
    int("restart.backoffMs", o.restart.backoffMs, 0, MAX_BACKOFF_MS);
  }
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

/** The command line and environment of the executable for these options. */
function childSpec(binaryPath: string, slicePath: string, options: SpawnExpertWorkerOptions): ChildSpec {
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
  return {
    cmd,
    args: cmdArgs,
    env: { ...process.env, ...options.env },
    maxFrameBytes: options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES,
    startTimeoutMs: options.startTimeoutMs ?? 120_000,
  };
}

/** Whether a process registered the slice it was given (the same layers and experts). */
function sameSlice(registration: RegisterFrame, info: ExpertComputeInfo): boolean {
  return (
    registration.layers.join() === info.layers.join() &&
    registration.experts.join() === [...info.experts].sort((a, b) => a - b).join()
  );
}

/**
 * The standalone executable behind the ExpertCompute interface: a child process speaking the
 * wire protocol on its stdin/stdout. Runs are sent as `dispatch` frames and may be in flight
 * together (the worker answers them in order). A process that dies is started again
 * ({@link RestartPolicy}).
 */
export class WorkerProcessCompute implements ExpertCompute {
  readonly info: ExpertComputeInfo;
  /** The worker's register frame. */
  readonly registration: RegisterFrame;
  readonly #spec: ChildSpec;
  readonly #pending = new Map<number, Pending>();
  readonly #experts: ReadonlySet<number>;
  readonly #maxFrameBytes: number;
  readonly #closeTimeoutMs: number;
  readonly #restart: Required<Omit<RestartPolicy, "onRestart">> & Pick<RestartPolicy, "onRestart">;
  readonly #stop = new AbortController();
  #proc: WorkerChild;
  #restartTimes: number[] = [];
  #restartCount = 0;
  #restarting: Promise<void> | undefined;
  #nextId = 0;
  #computeMs = 0;
  #answered = 0;
  #failure: Error | undefined;
  #closing: Promise<void> | undefined;

  private constructor(
    proc: WorkerChild,
    spec: ChildSpec,
    info: ExpertComputeInfo,
    options: SpawnExpertWorkerOptions,
  ) {
    this.#proc = proc;
    this.#spec = spec;
    this.info = info;
    this.registration = proc.registration;
    this.#experts = new Set(info.experts);
    this.#maxFrameBytes = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
    this.#closeTimeoutMs = options.closeTimeoutMs ?? 10_000;
    const r = options.restart === false ? { max: 0 } : (options.restart ?? {});
    this.#restart = {
      max: r.max ?? 3,
      windowMs: r.windowMs ?? 600_000,
      backoffMs: r.backoffMs ?? 1000,
      ...(r.onRestart ? { onRestart: r.onRestart } : {}),
    };
    this.#attach(proc);
  }

  static async spawn(
    binaryPath: string,
    slicePath: string,
    options: SpawnExpertWorkerOptions = {},
  ): Promise<WorkerProcessCompute> {
    checkOptions(options);
    throwIfAborted(options.signal);
    const spec = childSpec(binaryPath, slicePath, options);
    const proc = await startWorkerChild(spec, options.signal);
    try {
      const { registration } = proc;
      const header = await readGguf(slicePath, options.signal ? { signal: options.signal } : {});
      const layout = sliceLayout(header, options.act ? { act: options.act } : {});
      const info: ExpertComputeInfo = {
        backend: "worker",
        ...layoutInfo(layout),
        ...(options.threads ? { threads: options.threads } : {}),
        ...(registration.backend ? { device: registration.backend } : {}),
      };
      if (!sameSlice(registration, info)) {
        throw new NativeError(
          "MOESWARM_NATIVE_LOAD",
          "the worker registered other layers or experts than the slice holds",
        );
      }
      return new WorkerProcessCompute(proc, spec, info, options);
    } catch (error) {
      killChild(proc.child);
      void proc.frames.return(undefined);
      throw error;
    }
  }

  /** Runs answered, and the compute milliseconds the worker reported for them (`ms` of its results). */
  get computeStats(): { runs: number; computeMs: number } {
    return { runs: this.#answered, computeMs: this.#computeMs };
  }

  /** The process id of the worker now (undefined once it could not start). */
  get pid(): number | undefined {
    return this.#proc.child.pid;
  }

  /** Times the process was started again after dying. */
  get restarts(): number {
    return this.#restartCount;
  }

  #attach(proc: WorkerChild): void {
    void this.#readLoop(proc);
    proc.exited.then(() => this.#onExit(proc));
  }

  #exitError(proc: WorkerChild): Error {
    return new TransportError(
      "MOESWARM_TRANSPORT_CLOSED",
      `the worker process exited (code ${String(proc.child.exitCode)}, signal ${String(proc.child.signalCode)})${proc.stderr.text.trim() ? `: ${proc.stderr.text.trim()}` : ""}`,
    );
  }

  /** Rejects every request in flight with `error`. */
  #rejectPending(error: Error): void {
    for (const p of this.#pending.values()) {
      p.cleanup();
      p.reject(error);
    }
    this.#pending.clear();
  }

  /** Fails every request in flight and every later one with `error`. */
  #fail(error: Error): void {
    this.#failure ??= error;
    this.#rejectPending(error);
  }

  #onExit(proc: WorkerChild): void {
    if (this.#closing || this.#failure || this.#restart.max === 0) {
      this.#fail(this.#failure ?? this.#exitError(proc));
      return;
    }
    const now = Date.now();
    this.#restartTimes = this.#restartTimes.filter((t) => now - t < this.#restart.windowMs);
    const how = describeExit(proc.child, proc.stderr);
    if (this.#restartTimes.length >= this.#restart.max) {
      this.#fail(
        new NativeError(
          "MOESWARM_NATIVE_WORKER_RESTARTS_EXHAUSTED",
          `the worker process died ${this.#restartTimes.length + 1} times within ${this.#restart.windowMs} ms (restart budget ${this.#restart.max}); the last time with ${how}`,
        ),
      );
      return;
    }
    const crashed = new NativeError(
      "MOESWARM_NATIVE_WORKER_CRASHED",
      `the worker process died with ${how}; it is being restarted`,
      { details: { exitCode: proc.child.exitCode, signal: proc.child.signalCode } },
    );
    this.#rejectPending(crashed);
    this.#restartTimes.push(now);
    this.#restartCount++;
    this.#restart.onRestart?.({ restarts: this.#restartTimes.length, error: crashed });
    const delay = Math.min(MAX_BACKOFF_MS, this.#restart.backoffMs * 2 ** (this.#restartTimes.length - 1));
    this.#restarting = this.#startAgain(delay).finally(() => {
      this.#restarting = undefined;
    });
    this.#restarting.catch(() => {});
  }

  /** Starts a new process after `delay` ms; a start that fails counts as another death. */
  async #startAgain(delay: number): Promise<void> {
    try {
      await sleep(delay, this.#stop.signal);
      const proc = await startWorkerChild(this.#spec, this.#stop.signal);
      if (this.#closing) {
        killChild(proc.child);
        return;
      }
      if (!sameSlice(proc.registration, this.info)) {
        killChild(proc.child);
        throw new NativeError("MOESWARM_NATIVE_LOAD", "the restarted worker registered another slice");
      }
      this.#proc = proc;
      this.#attach(proc);
    } catch (error) {
      if (this.#closing) return;
      this.#fail(
        new NativeError(
          "MOESWARM_NATIVE_WORKER_RESTARTS_EXHAUSTED",
          `the worker process could not be started again: ${(error as Error).message}`,
          { cause: error },
        ),
      );
    }
  }

  async #readLoop(proc: WorkerChild): Promise<void> {
    try {
      for await (const payload of proc.frames) {
        let frame: Frame;
        try {
          frame = decodeFrame(payload, { copy: true });
        } catch (error) {
          // a worker that sends garbage cannot be trusted with the requests it holds
          this.#fail(error as Error);
          proc.child.kill("SIGKILL");
          return;
        }
        this.#onFrame(frame);
      }
    } catch (error) {
      // the stream broke (a frame cut by the process's death, an oversized frame): the requests it
      // held are lost; the exit handler starts a new process where the policy allows
      if (isMoeswarmError(error) && this.#restart.max === 0) this.#fail(error);
      killChild(proc.child);
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
    const restarting = this.#restarting;
    if (restarting) {
      // the new process is on its way: wait for it (or the caller's signal), then ask it
      const { signal } = options;
      return new Promise<void>((resolve, reject) => {
        const registration = onAbort(signal, reject);
        void restarting.then(() => {
          registration[Symbol.dispose]();
          resolve();
        });
      }).then(() => this.run(request, options));
    }
    return this.#send(request, options);
  }

  #send(request: RunRequest, options: RunOptions): Promise<Float32Array> {
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
      const proc = this.#proc;
      writeFrame(proc.child.stdin, frame, { maxFrameBytes: this.#maxFrameBytes }).catch((error: unknown) => {
        if (!isMoeswarmError(error, "MOESWARM_TRANSPORT_CLOSED")) {
          if (this.#pending.delete(id)) {
            cleanup();
            reject(error);
          }
          return;
        }
        // a closed stdin means the process is dead or dying: the exit handler rejects the
        // request with the crash (and restarts the process), as it does those already sent
        killChild(proc.child);
      });
    });
  }

  /** Sends `drain`: the worker answers what it holds, then exits; killed after closeTimeoutMs. */
  close(): Promise<void> {
    this.#closing ??= (async () => {
      this.#stop.abort(new NativeError("MOESWARM_NATIVE_CLOSED", "the expert compute was closed"));
      await this.#restarting;
      const { child, exited } = this.#proc;
      if (child.exitCode === null && child.signalCode === null) {
        try {
          await writeFrame(child.stdin, drainFrame({ reason: "close" }));
          child.stdin.end();
        } catch {
          // already gone: the exit below settles it
        }
        const timer = setTimeout(() => child.kill("SIGKILL"), this.#closeTimeoutMs);
        await exited;
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

import { abortReason, InvalidArgumentError, NativeError, throwIfAborted } from "@moeswarm/core";
import {
  ACTIVATIONS,
  type Activation,
  checkRunRequest,
  type ExpertCompute,
  type ExpertComputeInfo,
  type RunOptions,
  type RunRequest,
} from "./expert-compute.js";
import {
  type NativeAddon,
  type NativeSliceHandle,
  type NativeSliceInfo,
  nativeError,
  requireNative,
} from "./native-binding.js";
import { RunQueue } from "./run-queue.js";

export interface NativeLoadOptions {
  /** Compute threads (default: all CPUs). */
  threads?: number;
  /** Keep llama.cpp's default CPU_REPACK weight layout for the types it repacks (default true). */
  repack?: boolean;
  /** Override the activation chosen from `general.architecture`. */
  act?: Activation | "auto";
  /**
   * ggml device: "cpu" (default), "gpu" (the first GPU), or a device name ("CUDA0", "ROCm0") of an
   * addon built with that backend (scripts/build-gpu.sh, loaded through MOESWARM_NATIVE_ADDON).
   */
  device?: string;
  /**
   * Requests of at most this many tokens are computed on the calling thread when no run is queued
   * (default: 8 on the CPU, 0 on other devices; 0 turns it off): for them the hop to libuv's
   * thread pool and back costs more than the arithmetic. Larger requests always run on the pool,
   * so that a long prefill never holds up the event loop.
   */
  syncMaxTokens?: number;
  signal?: AbortSignal;
}

/**
 * The default bound of the synchronous path. The hop it saves (RunQueue, then an AsyncWorker on
 * libuv's pool and back) costs 0.1-0.3 ms on a quiet machine and several ms on a loaded one
 * (`pnpm bench compute-call`), a large share of a small request. Inline, a run holds the event
 * loop for its arithmetic: up to 8 tokens read at most 8*k experts' weights (a few ms for a
 * 122B-shaped layer on a multi-core machine), and since a slice's runs are serialised anyway
 * that delays only I/O (the next frame's decoding, heartbeats every few seconds) by one run. A
 * prefill batch (64 tokens and more) reads most of the slice and takes many times longer: it
 * goes to the pool.
 */
export const SYNC_MAX_TOKENS = 8;

function toInfo(n: NativeSliceInfo): ExpertComputeInfo {
  return {
    backend: "native",
    layers: n.layers,
    experts: n.experts,
    nEmbd: n.nEmbd,
    nFf: n.tensors[0]?.nFf ?? 0,
    tensors: n.tensors.map(({ layer, nFf, gate, up, down, merged }) => ({
      layer,
      nFf,
      gate,
      up,
      down,
      merged,
    })),
    act: n.act as Activation,
    arch: n.arch,
    threads: n.threads,
    cpu: n.cpu,
    device: n.device,
  };
}

/** The expert compute of the N-API addon: ggml's CPU kernels, off the event loop. */
export class NativeExpertCompute implements ExpertCompute {
  readonly info: ExpertComputeInfo;
  /** What the addon reports, with which tensors were repacked. */
  readonly native: NativeSliceInfo;
  readonly #handle: NativeSliceHandle;
  /** The build of the addon that loaded the slice (the native listener of that build can serve it). */
  readonly #addon: NativeAddon | undefined;
  readonly #queue = new RunQueue();
  readonly #experts: ReadonlySet<number>;
  /** Token bound of the synchronous path; 0 when off or the addon has no runSync. */
  readonly #syncMaxTokens: number;
  #closed = false;

  private constructor(
    handle: NativeSliceHandle,
    device: string | undefined,
    syncMaxTokens: number | undefined,
    addon?: NativeAddon,
  ) {
    this.#handle = handle;
    this.#addon = addon;
    this.native = handle.info();
    this.info = toInfo(this.native);
    if (device !== undefined) this.info.device = device;
    this.#experts = new Set(this.info.experts);
    // a GPU's first run of a shape may take long (kernels, buffers): only the CPU runs inline by default
    const cpu = this.native.device === "CPU";
    this.#syncMaxTokens =
      typeof handle.runSync !== "function" ? 0 : (syncMaxTokens ?? (cpu ? SYNC_MAX_TOKENS : 0));
  }

  /** Requests of at most this many tokens run on the calling thread when nothing is queued (0: none). */
  get syncMaxTokens(): number {
    return this.#syncMaxTokens;
  }

  /** Loads a slice GGUF into ggml CPU buffers (off the event loop). */
  static async load(slicePath: string, options: NativeLoadOptions = {}): Promise<NativeExpertCompute> {
    throwIfAborted(options.signal);
    if (options.act !== undefined && options.act !== "auto" && !ACTIVATIONS.includes(options.act)) {
      throw new NativeError("MOESWARM_NATIVE_LOAD", `unknown activation ${String(options.act)}`);
    }
    const addon = await requireNative(options.signal ? { signal: options.signal } : {});
    return NativeExpertCompute.loadWith(addon, slicePath, options);
  }

  /**
   * Loads with a given build of the addon: the llama-cpu one (llama-cpu.ts) reports `device`
   * "llama-cpu", as the llama-cpu executable registers.
   * @internal
   */
  static async loadWith(
    addon: NativeAddon,
    slicePath: string,
    options: NativeLoadOptions,
    device?: string,
  ): Promise<NativeExpertCompute> {
    throwIfAborted(options.signal);
    const { threads, repack, act, syncMaxTokens } = options;
    if (act !== undefined && act !== "auto" && !ACTIVATIONS.includes(act)) {
      throw new NativeError("MOESWARM_NATIVE_LOAD", `unknown activation ${String(act)}`);
    }
    if (syncMaxTokens !== undefined && !(Number.isInteger(syncMaxTokens) && syncMaxTokens >= 0)) {
      throw new InvalidArgumentError(`syncMaxTokens must be an integer >= 0, got ${String(syncMaxTokens)}`);
    }
    const dev = device === undefined ? options.device : undefined;
    let loaded: { handle: NativeSliceHandle };
    try {
      loaded = await addon.loadSlice(slicePath, {
        ...(threads !== undefined ? { threads } : {}),
        ...(repack !== undefined ? { repack } : {}),
        ...(act !== undefined ? { act } : {}),
        ...(dev !== undefined ? { device: dev } : {}),
      });
    } catch (cause) {
      throw nativeError(cause);
    }
    const compute = new NativeExpertCompute(loaded.handle, device, syncMaxTokens, addon);
    if (options.signal?.aborted) {
      await compute.close();
      throwIfAborted(options.signal);
    }
    return compute;
  }

  /**
   * The addon's slice and the addon that loaded it, for the native listener (native-server.ts),
   * which computes on it from its own threads; undefined once closed.
   * @internal
   */
  nativeSlice(): { addon: NativeAddon; handle: NativeSliceHandle } | undefined {
    return this.#closed || this.#addon === undefined
      ? undefined
      : { addon: this.#addon, handle: this.#handle };
  }

  run(request: RunRequest, options: RunOptions = {}): Promise<Float32Array> {
    return this.#exec(request, options, false);
  }

  /**
   * The same tokens through one graph built exactly like llama.cpp's `build_moe_ffn` over the
   * whole tensors (mode "sum" ends with its ggml_mul and ggml_add nodes). Every slot must hold an
   * expert of the file. The monolithic baseline the sliced path is checked and benchmarked against.
   */
  runReference(request: RunRequest, options: RunOptions = {}): Promise<Float32Array> {
    return this.#exec(request, options, true);
  }

  /** Compute threads for the next runs. */
  setThreads(threads: number): void {
    if (this.#closed) throw new NativeError("MOESWARM_NATIVE_CLOSED", "the expert compute was closed");
    try {
      this.#handle.setThreads(threads);
    } catch (cause) {
      throw nativeError(cause);
    }
    this.info.threads = threads;
  }

  /**
   * True when `run(request)` would compute on the calling thread now: at most `syncMaxTokens`
   * tokens and nothing queued (a request that fails its checks counts as inline: `runSyncInto`
   * then throws its error). Cheap: the token count is read off `ids`, nothing is checked here.
   */
  runsInline(request: RunRequest): boolean {
    const { ids, k } = request;
    return (
      !this.#closed &&
      this.#queue.pending === 0 &&
      Number.isInteger(k) &&
      k > 0 &&
      ids.length / k <= this.#syncMaxTokens
    );
  }

  /**
   * `run(request)` computed on the calling thread, its answer written into `y` (a result frame's
   * memory, see ExpertCompute.runSyncInto). Meant for a request `runsInline` accepted; if a run
   * was queued since (two dispatches decoded in one read), this waits for the pool's run in flight
   * rather than answer out of order with nothing to write into: correct, at worst one run late.
   */
  runSyncInto(request: RunRequest, y: Float32Array): void {
    if (this.#closed) throw new NativeError("MOESWARM_NATIVE_CLOSED", "the expert compute was closed");
    const n = checkRunRequest(request, this.info, this.#experts, { quantized: true });
    const values = (request.mode === "each" ? n * request.k : n) * this.info.nEmbd;
    if (!(y instanceof Float32Array) || y.length !== values) {
      throw new NativeError(
        "MOESWARM_NATIVE_OUTPUT",
        `the answer has ${values} values, the array given ${y instanceof Float32Array ? y.length : String(y)}`,
      );
    }
    const runSync = this.#handle.runSync;
    if (this.#syncMaxTokens === 0 || runSync === undefined) {
      throw new NativeError("MOESWARM_NATIVE_COMPUTE", "this compute has no inline path (syncMaxTokens 0)");
    }
    let out: Float32Array;
    try {
      out = runSync.call(this.#handle, ...this.#args(request, false), y);
    } catch (cause) {
      throw nativeError(cause);
    }
    // an addon built before `out` ignores it and returns an array of its own
    if (out !== y) y.set(out);
  }

  /** The addon's argument list of `run` and `runSync` (without runSync's `out`), written once. */
  #args(request: RunRequest, reference: boolean): Parameters<NativeSliceHandle["run"]> {
    const { layer, x, ids, k, w, mode, xType } = request;
    return [layer, x, ids, k, w ?? null, mode === "sum" ? 1 : 0, reference, xType];
  }

  #exec(request: RunRequest, options: RunOptions, reference: boolean): Promise<Float32Array> {
    if (this.#closed)
      return Promise.reject(new NativeError("MOESWARM_NATIVE_CLOSED", "the expert compute was closed"));
    let n: number;
    try {
      // q8 rows: the core checks them against the layer (CPU only; repacked layers round-trip)
      n = checkRunRequest(request, this.info, this.#experts, { quantized: true });
    } catch (error) {
      return Promise.reject(error);
    }
    const args = this.#args(request, reference);
    // with nothing queued, a small request computes right here: still in call order, since every
    // earlier call has either finished or is in the queue (which then takes this one too)
    // (#syncMaxTokens is 0 without runSync)
    const runSync = this.#handle.runSync;
    if (n <= this.#syncMaxTokens && this.#queue.pending === 0 && runSync !== undefined) {
      if (options.signal?.aborted) return Promise.reject(abortReason(options.signal));
      try {
        return Promise.resolve(runSync.apply(this.#handle, args));
      } catch (cause) {
        return Promise.reject(nativeError(cause));
      }
    }
    return this.#queue.enqueue(
      async () => {
        try {
          return await this.#handle.run(...args);
        } catch (cause) {
          throw nativeError(cause);
        }
      },
      options.signal,
      () => this.#handle.abort(),
    );
  }

  /** Waits for the runs submitted so far, then frees the weights. Idempotent. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#queue.idle();
    await this.#handle.close();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

import {
  type ExpertHandler,
  type ExpertRequest,
  type ExpertResult,
  InvalidArgumentError,
  isQuantizedActivationDtype,
  type QuantizedActivationDtype,
  throwIfAborted,
} from "@moeswarm/core";
import {
  type LoadExpertComputeOptions,
  loadExpertCompute,
  type ExpertCompute as WorkerCompute,
} from "@moeswarm/worker-native";

/**
 * A worker-native compute (addon, worker process, llama-cpu) as a dispatch worker: the function
 * an `InProcessTransport` or a dispatch `fallback` calls. `ms` in the result is the time `run`
 * took as seen here (for a worker process: its compute and the stdio hop).
 */
export function expertComputeHandler(compute: WorkerCompute): ExpertHandler {
  return async (request: ExpertRequest, { signal }): Promise<ExpertResult> => {
    // q8_0/q8_K rows go to the compute as they are (it takes or refuses them)
    const quantized = isQuantizedActivationDtype(request.dtype) && request.x instanceof Uint8Array;
    if (!quantized && (request.dtype !== "f32" || !(request.x instanceof Float32Array))) {
      throw new InvalidArgumentError(
        "expert computes take f32 activations (the f64 oracle path is not for them)",
      );
    }
    const t0 = performance.now();
    const y = await compute.run(
      {
        layer: request.layer,
        ...(quantized
          ? { x: request.x as Uint8Array, xType: request.dtype as QuantizedActivationDtype }
          : { x: request.x as Float32Array }),
        ids: request.ids,
        k: request.k,
        ...(request.w ? { w: request.w } : {}),
        mode: request.mode,
      },
      { signal },
    );
    return {
      mode: request.mode,
      n: request.n,
      k: request.k,
      embd: request.embd,
      y,
      ms: performance.now() - t0,
    };
  };
}

export interface LocalFallbackOptions {
  /** Compute threads (default 1: the backbone's own threads keep the CPU). */
  threads?: number;
  /** node-llama-cpp's bins directory (default: found from the installed package). */
  binsDir?: string;
  /** Start the compute now rather than at the first request that needs it (default false). */
  eager?: boolean;
  signal?: AbortSignal;
}

/** The bridge's last resort: the model's own experts, computed here. */
export interface LocalFallback extends AsyncDisposable {
  /** Pass as `fallback` to the bridge or to `dispatchExperts`. */
  readonly compute: ExpertHandler;
  /** Whether the compute has been started (it starts at the first request by default). */
  readonly started: boolean;
  close(): Promise<void>;
}

/**
 * Computes experts nobody else serves from the backbone's own GGUF (a full model file works as a
 * slice: without `moeswarm.slice.*` keys its expert ids are the global ids), with the llama-cpu
 * compute: the CPU backend llama.cpp itself uses here, so a fallback answer is bit-identical to
 * what the worker would have returned.
 */
export async function createLocalFallback(
  modelPath: string,
  options: LocalFallbackOptions = {},
): Promise<LocalFallback> {
  if (typeof modelPath !== "string" || modelPath.length === 0) {
    throw new InvalidArgumentError("createLocalFallback: modelPath is required");
  }
  throwIfAborted(options.signal);
  const load: LoadExpertComputeOptions = {
    backend: "llama-cpu",
    threads: options.threads ?? 1,
    ...(options.binsDir !== undefined ? { binsDir: options.binsDir } : {}),
  };
  let starting: Promise<WorkerCompute> | undefined;
  let closed = false;
  const start = (): Promise<WorkerCompute> => {
    if (closed) return Promise.reject(new InvalidArgumentError("the local fallback is closed"));
    if (!starting) {
      starting = loadExpertCompute(modelPath, load);
      // a failed start is retried by the next request
      starting.catch(() => {
        starting = undefined;
      });
    }
    return starting;
  };
  if (options.eager) await start();
  const compute: ExpertHandler = async (request, opts) => expertComputeHandler(await start())(request, opts);
  const close = async () => {
    closed = true;
    const pending = starting;
    starting = undefined;
    if (pending) await (await pending.catch(() => undefined))?.close();
  };
  return {
    compute,
    get started() {
      return starting !== undefined;
    },
    close,
    [Symbol.asyncDispose]: close,
  };
}

import {
  type ExpertRequest,
  InvalidArgumentError,
  isQuantizedActivationDtype,
  NativeError,
  type QuantizedActivationDtype,
  quantizedActivationBytes,
} from "@moeswarm/core";

/**
 * Which implementation computes: "native" the N-API addon, "llama-cpu" the compute core built
 * against node-llama-cpp's ggml (llama.cpp's own CPU kernels), "worker" the standalone executable in
 * a child process, "ts" TypeScript. A compute's `info.backend` says where it runs: a llama-cpu
 * compute reports "native" (in this process) or "worker" (child process) with `info.device`
 * "llama-cpu".
 */
export type ComputeBackend = "native" | "llama-cpu" | "worker" | "ts";

/**
 * What a caller asks for: a backend; "vulkan" or "cuda" (`moeswarm-expert-worker-llama` on
 * node-llama-cpp's Vulkan or CUDA build of ggml, in a child process: `info.backend` "worker",
 * `info.device` the GPU device); or "auto": native when it loads, else the standalone executable where this platform has
 * one (Android/Termux, musl, any host the glibc addon does not load on), else TypeScript.
 */
export type BackendChoice = ComputeBackend | "vulkan" | "cuda" | "auto";

/** Every `BackendChoice`, for validating options and command lines. */
export const BACKEND_CHOICES: readonly BackendChoice[] = Object.freeze([
  "auto",
  "native",
  "llama-cpu",
  "worker",
  "vulkan",
  "cuda",
  "ts",
]);

/** The choices that compute on a GPU (their weights live in device memory: claims count VRAM). */
export const GPU_BACKEND_CHOICES: readonly BackendChoice[] = Object.freeze(["vulkan", "cuda"]);

/** True when `value` is a `BackendChoice`. */
export function isBackendChoice(value: unknown): value is BackendChoice {
  return (BACKEND_CHOICES as readonly unknown[]).includes(value);
}

/** The activation between the gate/up and down projections, as llama.cpp's llm_ffn_op_type. */
export type Activation = "silu" | "gelu" | "relu" | "swiglu_oai" | "relu_sqr";

export const ACTIVATIONS: readonly Activation[] = Object.freeze([
  "silu",
  "gelu",
  "relu",
  "swiglu_oai",
  "relu_sqr",
]);

/** `each`: one output row per slot (zero for empty slots); `sum`: the router-weighted sum per token. */
export type RunMode = "each" | "sum";

/**
 * One layer's routed-expert computation for a batch of tokens: core's `ExpertRequest` (same field
 * names and meanings) without what the slice already knows (model, n and embd follow from `ids`,
 * `k` and the slice, activations are f32). `layer` must be one of `info.layers`, `k` is 1..256,
 * `w` is required for mode "sum" and ignored for "each".
 */
export interface RunRequest extends Pick<ExpertRequest, "layer" | "ids" | "k" | "w" | "mode"> {
  /** Activations, n tokens x n_embd, token-major (with `xType`: n rows of its ggml blocks). */
  readonly x: Float32Array | Uint8Array;
  /**
   * The rows come already converted to the layer's vec_dot_type (core's `QuantizedActivationDtype`):
   * only CPU computes of the native core take them, for layers whose gate and up weights convert
   * to exactly that type; every other compute refuses with MOESWARM_NATIVE_WIRE_DTYPE (send f32).
   */
  readonly xType?: QuantizedActivationDtype;
}

export interface RunOptions {
  signal?: AbortSignal;
}

/** The expert tensors of one layer: ggml type names, `gate` null without a gate tensor. */
export interface LayerTensors {
  layer: number;
  nFf: number;
  gate: string | null;
  /** The merged gate+up tensor's type when `merged`. */
  up: string;
  down: string;
  merged: boolean;
}

export interface ExpertComputeInfo {
  backend: ComputeBackend;
  /** Global layer indices, ascending. */
  layers: number[];
  /** Global expert ids in slice order (the order of the tensors' `ne[2]` slabs). */
  experts: number[];
  nEmbd: number;
  /** n_ff of the first layer (see `tensors` for each layer's). */
  nFf: number;
  tensors: LayerTensors[];
  act: Activation;
  /** `general.architecture` of the slice, "" when absent. */
  arch: string;
  /** Compute threads (native and worker backends). */
  threads?: number;
  /** CPU features ggml was compiled with (native backend). */
  cpu?: string;
  /** ggml device that computes ("CPU", "CUDA0"...; native and worker backends). */
  device?: string;
  /** Memory of that device in bytes, when it is not the host's (GPU backends that can tell). */
  vramBytes?: number;
  /** ggml weight types this backend is checked to compute (GPU backends; the CPU ones compute every type). */
  types?: readonly string[];
}

/**
 * Routed-expert FFNs over one slice, computed as llama.cpp's `build_moe_ffn` computes them.
 * Runs of one instance are executed one after the other, in call order.
 */
export interface ExpertCompute extends AsyncDisposable {
  readonly info: ExpertComputeInfo;
  /**
   * Mode "each": n*k*n_embd floats, slot (i, j) at ((i*k)+j)*n_embd, zero for empty slots.
   * Mode "sum": n*n_embd floats, sum_j w_ij*y_ij rounded as protocol v1 defines it.
   */
  run(request: RunRequest, options?: RunOptions): Promise<Float32Array>;
  /**
   * True when `run(request)` would compute on the calling thread now (a small request and nothing
   * queued): then `runSyncInto` may answer it instead. Absent from computes without that path.
   */
  runsInline?(request: RunRequest): boolean;
  /**
   * `run`'s answer written into `y` (exactly its length: n*k*n_embd for mode "each", n*n_embd for
   * "sum") on the calling thread, for a request `runsInline` accepted: the caller's memory (a result
   * frame's) instead of an array of the compute's own. Throws what `run` rejects with.
   */
  runSyncInto?(request: RunRequest, y: Float32Array): void;
  /** Releases the weights; runs already started finish first, later ones reject with MOESWARM_NATIVE_CLOSED. */
  close(): Promise<void>;
}

/**
 * Whether the architecture multiplies the expert *input* by the router weight and sums the outputs
 * unweighted (llama4: build_moe_ffn's weight_before_ffn). Its workers take the weighted rows with
 * weight 1 (the dispatcher expands them, the plugin reads them from llama.cpp's graph) and refuse
 * any other weight rather than apply it after the FFN.
 */
export function weightsBeforeFfn(arch: string): boolean {
  return arch === "llama4";
}

/** Number of tokens of a request that fits the slice; throws InvalidArgumentError otherwise. */
export function checkRunRequest(
  request: RunRequest,
  info: Pick<ExpertComputeInfo, "layers" | "nEmbd"> & { arch?: string },
  expertSet: ReadonlySet<number>,
  options: { quantized?: boolean } = {},
): number {
  if (typeof request !== "object" || request === null)
    throw new InvalidArgumentError("run needs a request object");
  const { layer, x, ids, k, w, mode } = request;
  if (!Number.isInteger(layer) || !info.layers.includes(layer)) {
    throw new InvalidArgumentError(
      `layer ${String(layer)} is not in this slice (layers ${info.layers.join(", ")})`,
      {
        details: {
          layer,
        },
      },
    );
  }
  if (mode !== "each" && mode !== "sum")
    throw new InvalidArgumentError(`mode must be "each" or "sum", got ${String(mode)}`);
  if (!Number.isInteger(k) || k < 1 || k > 256)
    throw new InvalidArgumentError(`k must be an integer in 1..256, got ${String(k)}`);
  if (!(ids instanceof Int32Array)) throw new InvalidArgumentError("ids must be an Int32Array");
  const xType = request.xType;
  if (xType !== undefined) {
    if (!isQuantizedActivationDtype(xType))
      throw new InvalidArgumentError(`xType must be "q8_0" or "q8_K", got ${String(xType)}`);
    if (options.quantized !== true)
      throw new NativeError("MOESWARM_NATIVE_WIRE_DTYPE", `this compute takes f32 activations, not ${xType}`);
    if (!(x instanceof Uint8Array)) throw new InvalidArgumentError(`${xType} rows must be a Uint8Array`);
  } else if (!(x instanceof Float32Array)) throw new InvalidArgumentError("x must be a Float32Array");
  const n = ids.length / k;
  if (!Number.isInteger(n) || n < 1 || n > 65536) {
    throw new InvalidArgumentError(
      `ids holds ${ids.length} values: expected n*k with k=${k} and 1 <= n <= 65536`,
    );
  }
  if (xType !== undefined) {
    const bytes = quantizedActivationBytes(xType, n, info.nEmbd);
    if (bytes === 0 || x.length !== bytes)
      throw new InvalidArgumentError(
        `x holds ${x.length} bytes, expected ${n} rows of ${info.nEmbd} values as ${xType}`,
      );
  } else if (x.length !== n * info.nEmbd) {
    throw new InvalidArgumentError(`x holds ${x.length} values, expected n*n_embd = ${n}*${info.nEmbd}`, {
      details: {
        n,
        nEmbd: info.nEmbd,
      },
    });
  }
  for (let i = 0; i < ids.length; i++) {
    const id = ids[i]!;
    if (id !== -1 && !expertSet.has(id)) {
      throw new InvalidArgumentError(
        `expert ${id} (token ${Math.floor(i / k)}, slot ${i % k}) is not in this slice`,
        {
          details: {
            expert: id,
            token: Math.floor(i / k),
            slot: i % k,
          },
        },
      );
    }
  }
  if (w !== undefined) {
    if (!(w instanceof Float32Array)) throw new InvalidArgumentError("w must be a Float32Array");
    if (w.length !== ids.length)
      throw new InvalidArgumentError(`w holds ${w.length} values, expected n*k = ${ids.length}`);
    for (let i = 0; i < w.length; i++) {
      if (!Number.isFinite(w[i]!))
        throw new InvalidArgumentError(`weight ${i} is not finite`, { details: { index: i } });
      if (info.arch !== undefined && weightsBeforeFfn(info.arch) && w[i] !== 1) {
        throw new InvalidArgumentError(
          `weight ${i} is ${w[i]}: ${info.arch} weights the expert input, so each row comes weighted with weight 1`,
          { details: { index: i } },
        );
      }
    }
  } else if (mode === "sum") {
    throw new InvalidArgumentError('mode "sum" needs the router weights');
  }
  return n;
}

/** Output length of a run. */
export function outputLength(n: number, k: number, nEmbd: number, mode: RunMode): number {
  return n * (mode === "each" ? k : 1) * nEmbd;
}

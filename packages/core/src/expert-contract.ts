import type { DispatchMode, QuantizedActivationDtype } from "./frames.js";

// The one definition of "a worker's share of a layer's expert work" and its answer. The dispatcher
// builds ExpertRequests, transports carry them (in process, over worker threads, over the relay,
// where they become the wire protocol's `dispatch` frame), and workers answer ExpertResults.
// Every package speaks these types; none declares its own copy.

/** What goes to a worker: the fields of the wire protocol's `dispatch` frame (v1) as typed arrays. */
export interface ExpertRequest {
  readonly model: string;
  readonly layer: number;
  /** Tokens in this request (1..65536). */
  readonly n: number;
  readonly embd: number;
  /**
   * "f32" on the wire. "f64" exists only between in-process peers (the f64 oracle path); the wire
   * codec has no f64 activations. "q8_0" / "q8_K": the rows already converted to a CPU worker's
   * `vec_dot_type` by the sender (`x` the raw ggml blocks, see `QuantizedActivationDtype`); only
   * computes that say they take them accept these, the others refuse with
   * MOESWARM_NATIVE_WIRE_DTYPE.
   */
  readonly dtype: "f32" | "f64" | QuantizedActivationDtype;
  /** `[n x embd]`, token-major (q8_0 / q8_K: n rows of ggml blocks, as bytes). */
  readonly x: Float32Array | Float64Array | Uint8Array;
  /** Expert slots per token. */
  readonly k: number;
  /** `[n x k]` global expert ids, -1 = slot not for this worker. */
  readonly ids: Int32Array;
  /** `[n x k]` router weights; present when mode is "sum". */
  readonly w?: Float32Array;
  readonly mode: DispatchMode;
  /** Milliseconds the sender will wait, relative to sending. */
  readonly deadline?: number;
  /**
   * Mode "each": the dispatcher accepts a compact result (the filled slots' rows only, protocol
   * section 5); a worker or transport may ignore it and answer in full.
   */
  readonly compact?: boolean;
}

/** What comes back: the fields of the `result` frame. */
export interface ExpertResult {
  readonly mode: DispatchMode;
  readonly n: number;
  readonly k: number;
  readonly embd: number;
  /**
   * mode "each": `[n x k x embd]`, slot (i, j) at `(i*k + j) * embd`, zero for empty slots;
   * mode "sum": `[n x embd]`, per token `sum_j w_ij * y_ij`, each product rounded to f32 and added
   * in f32 in slot order. Float64Array only for "f64" requests.
   */
  readonly y: Float32Array | Float64Array;
  /** Compute milliseconds reported by the worker. */
  readonly ms?: number;
  /** `y` holds only the rows of the request's filled slots, in slot order (f x embd). */
  readonly compact?: boolean;
}

export interface ExpertCallOptions {
  /** Aborted when the dispatcher stops waiting (deadline, failover, caller abort). */
  readonly signal: AbortSignal;
  /** The deadline the dispatcher applies, for transports that forward it. */
  readonly deadlineMs?: number;
}

/**
 * Carries requests to workers by id. A transport may transfer (detach) the request's buffers; the
 * caller must not rely on them after `request` returns. It rejects on failure (any error, ideally a
 * MoeswarmError whose code tells failover cases from bad requests); it should settle promptly after
 * `signal` aborts, but a dispatcher never waits for it past its own deadline.
 */
export interface ExpertTransport {
  /**
   * The workers behind it run code the caller controls (in its own process or threads): their
   * answers need no verification. Absent or false: the owners may be strangers, and a dispatcher
   * verifies their answers unless told the swarm is the caller's own (dispatch's `trust: "own"`).
   */
  readonly trusted?: boolean;
  request(owner: string, request: ExpertRequest, options: ExpertCallOptions): Promise<ExpertResult>;
}

/**
 * Answers one request where it is: a worker's handler behind a transport, a dispatcher's local
 * fallback or reference. (Compute engines that load slices are worker-native's `ExpertCompute`.)
 */
export type ExpertHandler = (
  request: ExpertRequest,
  options: { readonly signal: AbortSignal },
) => ExpertResult | Promise<ExpertResult>;

/**
 * Converts f32 activations to a CPU worker's vec_dot_type the way the backbone machine's ggml-cpu
 * does (worker-native's `loadActivationQuantizer`), for dispatch's `quantizingTransport`.
 */
export interface ActivationQuantizer {
  /** The dtype a layer's activations may travel in, undefined: f32 only. */
  wireDtype(layer: number): QuantizedActivationDtype | undefined;
  /** `n` rows of `embd` f32 values as `dtype` blocks (ggml-cpu's from_float). */
  quantize(dtype: QuantizedActivationDtype, x: Float32Array, embd: number): Uint8Array;
  /** Whether every row comes back byte for byte from f32 (what a worker with repacked weights checks). */
  roundTrips(dtype: QuantizedActivationDtype, rows: Uint8Array, embd: number): boolean;
}

// The frames of wire protocol v1 (docs/protocol.md is the normative description; this file and
// that document must agree, and the tests hold them to it).

/** The protocol version every frame carries in `v`. */
export const PROTOCOL_VERSION = 1;

/** Default bound on one frame's msgpack payload (64 MiB); configurable per connection. */
export const DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024;

/** Bounds on field values; a frame outside them is rejected by `decodeFrame` and `encodeFrame`. */
export const PROTOCOL_LIMITS = Object.freeze({
  /** `hello.id`, `to`, `from`: bytes of UTF-8. */
  peerIdBytes: 128,
  tokenBytes: 8192,
  modelBytes: 256,
  /** `register.backend` and each entry of `caps.backends` / `caps.dtypes`. */
  nameBytes: 64,
  capsItems: 64,
  /** `caps.maxFrame`, `id`, `deadline`: at most 2^32 - 1. */
  u32: 0xffff_ffff,
  maxLayer: 65535,
  layersItems: 4096,
  expertsItems: 65536,
  /** Largest expert id (ids travel as int32). */
  maxExpertId: 0x7fff_ffff,
  maxTokens: 65536,
  maxEmbd: 65536,
  maxSlots: 256,
  codeBytes: 64,
  msgBytes: 16384,
  reasonBytes: 1024,
});

export type FrameType = "hello" | "register" | "dispatch" | "result" | "error" | "ping" | "pong" | "drain";
export const FRAME_TYPES: readonly FrameType[] = Object.freeze([
  "hello",
  "register",
  "dispatch",
  "result",
  "error",
  "ping",
  "pong",
  "drain",
]);

export type PeerRole = "worker" | "backbone";
/** Activation dtypes a dispatch may carry (f16 and bf16 travel as their raw 16-bit patterns). */
export type ActivationDtype = "f32" | "f16" | "bf16";
/**
 * Activations already in a CPU worker's `vec_dot_type`: ggml's `block_q8_0` / `block_q8_K` rows,
 * `x` their raw bytes. ggml converts f32 activations to that type before the expert matmul anyway,
 * so a sender that converts them with the same ggml-cpu `from_float` gets the same result bits.
 */
export type QuantizedActivationDtype = "q8_0" | "q8_K";
/** Values and bytes per block of each quantized activation dtype (ggml's QK8_0 and QK_K blocks). */
export const QUANTIZED_ACTIVATION_BLOCKS: Readonly<
  Record<QuantizedActivationDtype, { readonly values: number; readonly bytes: number }>
> = Object.freeze({ q8_0: { values: 32, bytes: 34 }, q8_K: { values: 256, bytes: 292 } });

/** Whether `dtype` is one of the quantized activation dtypes. */
export function isQuantizedActivationDtype(dtype: unknown): dtype is QuantizedActivationDtype {
  return dtype === "q8_0" || dtype === "q8_K";
}

/** Every activation dtype a `dispatch` may carry (its `dtype`), one of ActivationDtype or QuantizedActivationDtype. */
export type WireActivationDtype = ActivationDtype | QuantizedActivationDtype;
/**
 * The one list of activation dtypes on the wire: the values `dispatch.dtype` takes, and the names a
 * worker lists in `hello.caps.dtypes` for those its compute accepts.
 */
export const WIRE_ACTIVATION_DTYPES: readonly WireActivationDtype[] = Object.freeze([
  "f32",
  "f16",
  "bf16",
  "q8_0",
  "q8_K",
]);

/** Bytes of `n` rows of `embd` activations in a quantized dtype; 0 when embd is not whole blocks. */
export function quantizedActivationBytes(dtype: QuantizedActivationDtype, n: number, embd: number): number {
  const b = QUANTIZED_ACTIVATION_BLOCKS[dtype];
  return embd % b.values === 0 ? n * (embd / b.values) * b.bytes : 0;
}

/** `each`: one output row per slot; `sum`: the router-weighted sum per token. */
export type DispatchMode = "each" | "sum";

/** Optional relay addressing: `to` names the destination peer, the relay fills `from`. */
export interface Routed {
  to?: string;
  from?: string;
}

export interface HelloCaps {
  backends?: string[];
  /**
   * The activation dtypes (WIRE_ACTIVATION_DTYPES names) a worker's compute takes in `dispatch`.
   * Absent: the worker did not say (an older one), and a sender learns from its refusals.
   */
  dtypes?: string[];
  /** Largest frame payload (bytes) this peer accepts. */
  maxFrame?: number;
}

export interface HelloFrame {
  t: "hello";
  v: 1;
  role: PeerRole;
  id: string;
  token: string;
  caps?: HelloCaps;
}

export interface RegisterFrame {
  t: "register";
  v: 1;
  model: string;
  layers: number[];
  /** Global expert ids, strictly ascending. */
  experts: number[];
  /** Bytes of expert weights this worker can hold. */
  capacity?: number;
  backend?: string;
}

interface DispatchCommon extends Routed {
  t: "dispatch";
  v: 1;
  /** Request id (< 2^32), echoed by the result or error. */
  id: number;
  model: string;
  layer: number;
  /** Tokens. */
  n: number;
  embd: number;
  /** Expert slots per token. */
  k: number;
  /** n*k global expert ids, token-major; -1 marks an empty slot. */
  ids: Int32Array;
  /** n*k router weights; required for mode "sum". */
  w?: Float32Array;
  mode: DispatchMode;
  /** Milliseconds the sender will wait, counted from sending. */
  deadline?: number;
  /**
   * Mode "each" only: the sender accepts a compact result, the filled slots' rows alone (a worker
   * may still answer in full).
   */
  compact?: boolean;
}

/**
 * Activations are `n*embd` values, token-major: f32 as `Float32Array`, f16/bf16 as raw bits, q8_0 /
 * q8_K as `n` rows of ggml blocks (`quantizedActivationBytes`).
 */
export type DispatchFrame = DispatchCommon &
  (
    | { dtype: "f32"; x: Float32Array }
    | { dtype: "f16" | "bf16"; x: Uint16Array }
    | { dtype: QuantizedActivationDtype; x: Uint8Array }
  );

export interface ResultFrame extends Routed {
  t: "result";
  v: 1;
  id: number;
  mode: DispatchMode;
  n: number;
  k: number;
  embd: number;
  /**
   * mode "each": n*k*embd (slot (i,j) at ((i*k)+j)*embd), or with `compact` only the rows of the
   * dispatch's filled slots (ids >= 0) in slot order; mode "sum": n*embd.
   */
  y: Float32Array;
  /** Compute time in milliseconds. */
  ms?: number;
  /** `y` holds the filled slots' rows only (the dispatch asked for `compact`). */
  compact?: boolean;
}

export interface ErrorFrame extends Routed {
  t: "error";
  v: 1;
  /** The failed request; absent for a connection-level error. */
  id?: number;
  /** A `MOESWARM_*` code (possibly one this version does not know). */
  code: string;
  msg: string;
}

export interface PingFrame {
  t: "ping";
  v: 1;
  seq: number;
  /** Sender clock, milliseconds. */
  ts: number;
}

export interface PongFrame {
  t: "pong";
  v: 1;
  seq: number;
  ts: number;
}

export interface DrainFrame {
  t: "drain";
  v: 1;
  reason?: string;
}

export type Frame =
  | HelloFrame
  | RegisterFrame
  | DispatchFrame
  | ResultFrame
  | ErrorFrame
  | PingFrame
  | PongFrame
  | DrainFrame;

/** The frame of a given type. */
export type FrameOf<T extends FrameType> = Extract<Frame, { t: T }>;

// ---- field table ----------------------------------------------------------------------------
// One row per field, in canonical key order (after `t` and `v`). Encoding walks this order;
// decoding accepts any order. Cross-field rules (tensor lengths, ids, `w` for "sum") live in
// codec.ts.

export type FieldRule =
  | { type: "uint"; min?: number; max: number }
  | { type: "float"; min?: number }
  | { type: "str"; min: number; max: number; oneOf?: readonly string[]; pattern?: RegExp }
  | { type: "bin" }
  | { type: "uints"; maxItems: number; max: number; ascending?: boolean }
  | { type: "strs"; maxItems: number; min: number; max: number }
  | { type: "caps" }
  | { type: "bool" };

export interface FieldSpec {
  readonly key: string;
  readonly rule: FieldRule;
  readonly required: boolean;
}

const L = PROTOCOL_LIMITS;
const f = (key: string, rule: FieldRule, required = true): FieldSpec =>
  Object.freeze({ key, rule, required });
const peer = (key: string) => f(key, { type: "str", min: 1, max: L.peerIdBytes }, false);
const u32 = (key: string, required = true) => f(key, { type: "uint", max: L.u32 }, required);
const mode = f("mode", { type: "str", min: 1, max: 8, oneOf: ["each", "sum"] });

/** The fields of every frame type, in canonical order. */
export const FRAME_FIELDS: Readonly<Record<FrameType, readonly FieldSpec[]>> = Object.freeze({
  hello: [
    f("role", { type: "str", min: 1, max: 16, oneOf: ["worker", "backbone"] }),
    f("id", { type: "str", min: 1, max: L.peerIdBytes }),
    f("token", { type: "str", min: 0, max: L.tokenBytes }),
    f("caps", { type: "caps" }, false),
  ],
  register: [
    f("model", { type: "str", min: 1, max: L.modelBytes }),
    f("layers", { type: "uints", maxItems: L.layersItems, max: L.maxLayer }),
    f("experts", { type: "uints", maxItems: L.expertsItems, max: L.maxExpertId, ascending: true }),
    f("capacity", { type: "uint", max: Number.MAX_SAFE_INTEGER }, false),
    f("backend", { type: "str", min: 1, max: L.nameBytes }, false),
  ],
  dispatch: [
    u32("id"),
    peer("to"),
    peer("from"),
    f("model", { type: "str", min: 1, max: L.modelBytes }),
    f("layer", { type: "uint", max: L.maxLayer }),
    f("n", { type: "uint", min: 1, max: L.maxTokens }),
    f("embd", { type: "uint", min: 1, max: L.maxEmbd }),
    f("dtype", { type: "str", min: 1, max: 8, oneOf: WIRE_ACTIVATION_DTYPES }),
    f("x", { type: "bin" }),
    f("k", { type: "uint", min: 1, max: L.maxSlots }),
    f("ids", { type: "bin" }),
    f("w", { type: "bin" }, false),
    mode,
    u32("deadline", false),
    f("compact", { type: "bool" }, false),
  ],
  result: [
    u32("id"),
    peer("to"),
    peer("from"),
    mode,
    f("n", { type: "uint", min: 1, max: L.maxTokens }),
    f("k", { type: "uint", min: 1, max: L.maxSlots }),
    f("embd", { type: "uint", min: 1, max: L.maxEmbd }),
    f("y", { type: "bin" }),
    f("ms", { type: "float", min: 0 }, false),
    f("compact", { type: "bool" }, false),
  ],
  error: [
    u32("id", false),
    peer("to"),
    peer("from"),
    f("code", { type: "str", min: 1, max: L.codeBytes, pattern: /^MOESWARM_[A-Z0-9_]+$/ }),
    f("msg", { type: "str", min: 0, max: L.msgBytes }),
  ],
  ping: [f("seq", { type: "uint", max: Number.MAX_SAFE_INTEGER }), f("ts", { type: "float" })],
  pong: [f("seq", { type: "uint", max: Number.MAX_SAFE_INTEGER }), f("ts", { type: "float" })],
  drain: [f("reason", { type: "str", min: 0, max: L.reasonBytes }, false)],
});

/**
 * The padding entry (docs/protocol.md section 8): a `bin` of 0..7 zero bytes, keyed `_`, written
 * right before the main tensor of a `dispatch` (`x`) or `result` (`y`) so that the tensor's data
 * starts at a multiple of 8 from the payload's first byte. It is not a field: decoders skip it as
 * they skip any unknown key, and a relay writes it anew when it reroutes a frame.
 */
export const PAD_KEY = "_";
/** The frame types that carry a main tensor, and its key: the padding entry comes before it. */
export const MAIN_TENSOR_KEY: Readonly<Partial<Record<FrameType, string>>> = Object.freeze({
  dispatch: "x",
  result: "y",
});
/** The alignment (bytes, from the payload's first byte) the padding gives the main tensor's data. */
export const MAIN_TENSOR_ALIGN = 8;
/**
 * The most padding bytes a sender may add for a relay (EncodeOptions `headroom`): the padding is a
 * bin8 of at most 255 bytes, 7 of which alignment may take.
 */
export const MAX_HEADROOM = 248;

/** Fields of the `caps` map of `hello`, in canonical order; all optional. */
export const CAPS_FIELDS: readonly FieldSpec[] = Object.freeze([
  f("backends", { type: "strs", maxItems: L.capsItems, min: 1, max: L.nameBytes }, false),
  f("dtypes", { type: "strs", maxItems: L.capsItems, min: 1, max: L.nameBytes }, false),
  f("maxFrame", { type: "uint", max: L.u32 }, false),
]);

export function isFrameType(value: unknown): value is FrameType {
  return typeof value === "string" && (FRAME_TYPES as readonly string[]).includes(value);
}

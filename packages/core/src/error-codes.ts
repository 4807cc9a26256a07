/**
 * Every stable error code of moeswarm, with the area (error class) it belongs to and what it
 * means. The table is the single source: docs/errors.md is checked against it by a test, and
 * services answer with these codes on the wire. Codes never change meaning once published;
 * a removed code stays here as a comment.
 *
 * Add a code in its area's section, keep the `MOESWARM_` prefix, and document it in docs/errors.md.
 */
export const ERROR_CODES = {
  // --- core: arguments and ranges -----------------------------------------------------------
  MOESWARM_INVALID_ARGUMENT: {
    area: "InvalidArgumentError",
    text: "An option or argument is missing, of the wrong type or out of range.",
  },
  MOESWARM_INVALID_RANGE: {
    area: "InvalidArgumentError",
    text: "A half-open range `a:b` is malformed, empty, reversed, negative or too large.",
  },
  MOESWARM_ABORTED: { area: "AbortError", text: "The operation was aborted through its AbortSignal." },
  MOESWARM_NUMERIC: {
    area: "InvalidArgumentError",
    text: "Numeric inputs disagree in length or contain values the operation cannot take.",
  },

  // --- local I/O (files, disks) ------------------------------------------------------------------
  MOESWARM_IO_NO_SPACE: {
    area: "IoError",
    text: "The disk or the user's quota is full (ENOSPC, EDQUOT): free space, or write elsewhere.",
  },
  MOESWARM_IO_ACCESS: {
    area: "IoError",
    text: "The file system refused the access (EACCES, EPERM, EROFS): check permissions and mounts.",
  },
  MOESWARM_IO_NOT_FOUND: {
    area: "IoError",
    text: "A path does not name what was expected (ENOENT, ENOTDIR, EISDIR).",
  },
  MOESWARM_IO_TOO_MANY_FILES: {
    area: "IoError",
    text: "The process or the system has too many open files (EMFILE, ENFILE).",
  },
  MOESWARM_IO_FAILED: {
    area: "IoError",
    text: "A local file operation failed for another reason (EIO and the rest; the cause names it).",
  },

  // --- gguf (shard) ----------------------------------------------------------------------------
  MOESWARM_GGUF_BAD_MAGIC: { area: "GgufError", text: "The bytes do not start with the GGUF magic." },
  MOESWARM_GGUF_UNSUPPORTED_VERSION: {
    area: "GgufError",
    text: "GGUF version 1 or an unknown version; only v2 and v3 are read.",
  },
  MOESWARM_GGUF_TRUNCATED: {
    area: "GgufError",
    text: "The file ends before a structure it announces (header, metadata, tensor info or data).",
  },
  MOESWARM_GGUF_LIMIT: {
    area: "GgufError",
    text: "A count, length or size exceeds the reader's bound (string length, array length, tensor count, dims).",
  },
  MOESWARM_GGUF_BAD_VALUE_TYPE: {
    area: "GgufError",
    text: "A metadata value type is not one of GGUF's types.",
  },
  MOESWARM_GGUF_BAD_TENSOR: {
    area: "GgufError",
    text: "A tensor info is invalid: unknown ggml type, bad dims, shape not a multiple of the block size, duplicate name.",
  },
  MOESWARM_GGUF_BAD_ALIGNMENT: {
    area: "GgufError",
    text: "general.alignment is not a power of two, or a tensor offset is not aligned.",
  },
  MOESWARM_GGUF_BAD_OFFSET: {
    area: "GgufError",
    text: "Tensor data lies outside the file or overlaps another tensor.",
  },
  MOESWARM_GGUF_DUPLICATE_KEY: { area: "GgufError", text: "A metadata key appears twice." },
  MOESWARM_GGUF_MISSING_KEY: {
    area: "GgufError",
    text: "A metadata key required for the operation is absent or has the wrong type.",
  },
  MOESWARM_GGUF_UNSUPPORTED_TYPE: {
    area: "GgufError",
    text: "The operation does not support this ggml tensor type (e.g. no dequantiser for it).",
  },
  MOESWARM_GGUF_IO: {
    area: "GgufError",
    text: "Reading the source failed (file system or HTTP error, Range not honoured).",
  },
  MOESWARM_GGUF_NOT_MOE: {
    area: "GgufError",
    text: "The model has no routed-expert tensors where the operation needs them.",
  },
  MOESWARM_SLICE_MISMATCH: {
    area: "GgufError",
    text: "A slice's bytes do not match its manifest (sha256 of a slab, size or shape).",
  },
  MOESWARM_PLAN_NO_FIT: {
    area: "InvalidArgumentError",
    text: "The model does not fit the memory given to the offload planner (VRAM, RAM and swarm workers).",
  },

  // --- protocol (core) ---------------------------------------------------------------------------
  MOESWARM_PROTOCOL_MALFORMED: {
    area: "ProtocolError",
    text: "The bytes are not a single well-formed msgpack map.",
  },
  MOESWARM_PROTOCOL_UNKNOWN_TYPE: {
    area: "ProtocolError",
    text: "The frame's `t` is not a known frame type.",
  },
  MOESWARM_PROTOCOL_VERSION: {
    area: "ProtocolError",
    text: "The frame's `v` is a protocol version this peer does not speak.",
  },
  MOESWARM_PROTOCOL_MISSING_FIELD: { area: "ProtocolError", text: "A required field is absent." },
  MOESWARM_PROTOCOL_BAD_FIELD: {
    area: "ProtocolError",
    text: "A field has the wrong msgpack type or a value out of its range.",
  },
  MOESWARM_PROTOCOL_BAD_LENGTH: {
    area: "ProtocolError",
    text: "A tensor's byte length does not match its declared shape and dtype.",
  },
  MOESWARM_PROTOCOL_FRAME_TOO_LARGE: {
    area: "ProtocolError",
    text: "A frame exceeds the configured maximum size.",
  },
  MOESWARM_PROTOCOL_TRUNCATED: {
    area: "ProtocolError",
    text: "A byte stream ended inside a length-prefixed frame.",
  },

  // --- dispatch --------------------------------------------------------------------------------
  MOESWARM_DISPATCH_NO_OWNER: {
    area: "DispatchError",
    text: "An expert that routing can select has no owner in the placement.",
  },
  MOESWARM_DISPATCH_FAILED: {
    area: "DispatchError",
    text: "A worker's request failed and neither a replica nor a fallback could serve it.",
  },
  MOESWARM_DISPATCH_BAD_RESULT: {
    area: "DispatchError",
    text: "A worker answered with a result of the wrong shape or with non-finite values.",
  },
  MOESWARM_WORKER_TIMEOUT: {
    area: "DispatchError",
    text: "A worker did not answer before the request's deadline.",
  },
  MOESWARM_VERIFY_FAILED: {
    area: "DispatchError",
    text: "Two owners of a part disagreed and no third opinion could decide which is right (never a guess).",
  },
  MOESWARM_VERIFY_UNAVAILABLE: {
    area: "DispatchError",
    text: "Trust verify: a part has one untrusted owner and no local fallback (hub --replicas 2, or trust own).",
  },
  MOESWARM_ROUTING_CONFIG: {
    area: "DispatchError",
    text: "The routing configuration is invalid or cannot be derived from the model's metadata.",
  },

  // --- transport (relay-client, hub relay) -------------------------------------------------------
  MOESWARM_TRANSPORT_CLOSED: {
    area: "TransportError",
    text: "The connection closed before the request was answered.",
  },
  MOESWARM_TRANSPORT_CONNECT: {
    area: "TransportError",
    text: "The connection could not be established (DNS, TCP, TLS or WebSocket upgrade).",
  },
  MOESWARM_TRANSPORT_TIMEOUT: {
    area: "TransportError",
    text: "The peer stopped answering heartbeats or a request outlived its deadline.",
  },
  MOESWARM_TRANSPORT_BACKPRESSURE: {
    area: "TransportError",
    text: "The bounded send queue is full: the peer is slower than the sender.",
  },
  MOESWARM_TRANSPORT_UNKNOWN_PEER: {
    area: "TransportError",
    text: "The relay has no live peer with the requested id.",
  },
  MOESWARM_TRANSPORT_LIMIT: {
    area: "TransportError",
    text: "A per-connection limit was hit (in-flight requests, rate).",
  },
  MOESWARM_TRANSPORT_DRAINING: {
    area: "TransportError",
    text: "The peer is draining: it finishes the requests it holds but takes no new ones.",
  },
  MOESWARM_TRANSPORT_PIN_MISMATCH: {
    area: "TransportError",
    text: "A worker's direct endpoint presented a TLS certificate whose SHA-256 fingerprint is not the one the hub published for it: the backbone hung up before sending anything and uses the relay.",
  },

  // --- auth --------------------------------------------------------------------------------------
  MOESWARM_AUTH_MISSING: { area: "AuthError", text: "No token was presented where one is required." },
  MOESWARM_AUTH_INVALID: { area: "AuthError", text: "The token's signature or format is invalid." },
  MOESWARM_AUTH_EXPIRED: { area: "AuthError", text: "The token has expired." },
  MOESWARM_AUTH_ROLE: {
    area: "AuthError",
    text: "The token's role does not allow this action (e.g. a worker token used as a backbone).",
  },
  MOESWARM_AUTH_TICKET_INVALID: {
    area: "AuthError",
    text: "A direct-link ticket is malformed, not signed by the hub's key, or names another worker or backbone.",
  },
  MOESWARM_AUTH_TICKET_EXPIRED: {
    area: "AuthError",
    text: "A direct-link ticket has expired: the backbone asks the hub for a new one (POST /api/direct/tickets).",
  },

  // --- native compute (worker-native) -------------------------------------------------------------
  MOESWARM_NATIVE_LOAD: {
    area: "NativeError",
    text: "The native binary could not be loaded or failed its probe.",
  },
  MOESWARM_NATIVE_COMPUTE: {
    area: "NativeError",
    text: "The native compute rejected its input or failed while computing.",
  },
  MOESWARM_NATIVE_CLOSED: { area: "NativeError", text: "The compute was used after close()." },
  MOESWARM_NATIVE_PACKAGE_MISSING: {
    area: "NativeError",
    text: "The platform package with this platform's prebuilt binaries (@moeswarm/worker-native-<platform>) is not installed, or lacks the file.",
  },
  MOESWARM_NATIVE_PEER_MISSING: {
    area: "NativeError",
    text: "node-llama-cpp, an optional peer dependency needed by this feature, is not installed.",
  },
  MOESWARM_NATIVE_GPU_PACKAGE_MISSING: {
    area: "NativeError",
    text: "The GPU build a GPU backend computes with (@node-llama-cpp/linux-x64-vulkan or -cuda, an optional peer) is not installed: `npm install` the package the message names next to the worker.",
  },
  MOESWARM_NATIVE_GPU_DRIVER: {
    area: "NativeError",
    text: "The GPU build is installed but a library it needs from the machine is missing (the NVIDIA driver's libcuda.so.1, CUDA's runtime or cuBLAS, the Vulkan loader): install what the message names.",
  },
  MOESWARM_NATIVE_WIRE_DTYPE: {
    area: "NativeError",
    text: "The compute cannot take this dispatch's activations as q8_0/q8_K blocks (a GPU or TypeScript compute, or a layer whose gate and up weights convert activations to another type): the sender sends them again in f32.",
  },
  MOESWARM_NATIVE_WIRE_INEXACT: {
    area: "NativeError",
    text: "The layer's weights are repacked (they take f32 activations) and a q8_0/q8_K row of the dispatch does not come back byte for byte from f32, so computing from it would not give the sender's bits: the sender sends that dispatch again in f32.",
  },
  MOESWARM_NATIVE_OUTPUT: {
    area: "NativeError",
    text: "The array given to the compute for its answer (a result frame's memory) does not hold exactly the answer's values: a bug in the caller, not in the request.",
  },
  MOESWARM_NATIVE_WORKER_CRASHED: {
    area: "NativeError",
    text: "The compute process (the worker executable) died while it held this request; it is being restarted with the slice reloaded: the dispatcher serves the request elsewhere, later requests wait for the restart.",
  },
  MOESWARM_NATIVE_WORKER_RESTARTS_EXHAUSTED: {
    area: "NativeError",
    text: "The compute process died more often than its restart budget allows (restart.max within restart.windowMs): the compute gives up and refuses every request; look at the crash in the message (its signal and stderr).",
  },
  MOESWARM_NATIVE_TLS_UNAVAILABLE: {
    area: "NativeError",
    text: "The native listener (moeswarm-worker --listen-native) needs OpenSSL 3 and none was found in the process or as libssl.so.3: the worker carries on without it, and backbones reach it over the relay (or --listen).",
  },
  MOESWARM_NATIVE_LISTEN: {
    area: "NativeError",
    text: "The native listener could not listen on its host:port (in use, not an address of this machine, or not permitted): pick another --listen-native.",
  },

  // --- hub ---------------------------------------------------------------------------------------
  MOESWARM_HUB_NOT_FOUND: { area: "HubError", text: "The model, worker or resource does not exist." },
  MOESWARM_HUB_BAD_REQUEST: { area: "HubError", text: "The request's query or body is invalid." },
  MOESWARM_HUB_CONFLICT: {
    area: "HubError",
    text: "The claim cannot be granted (already covered, over capacity, lease held by another).",
  },
  MOESWARM_HUB_STORE: { area: "HubError", text: "The hub's persistent store failed." },
  MOESWARM_HUB_NO_SQLITE: {
    area: "HubError",
    text: "No SQLite driver loads (better-sqlite3, node:sqlite, node-sqlite3-wasm) and the hub was asked to keep its state on disk: `npm install node-sqlite3-wasm`, or run with `--db :memory:`.",
  },
  MOESWARM_HUB_METHOD_NOT_ALLOWED: {
    area: "HubError",
    text: "The HTTP method is not allowed on this resource (the `Allow` header lists those that are).",
  },
  MOESWARM_HUB_RANGE_NOT_SATISFIABLE: {
    area: "HubError",
    text: "The HTTP `Range` header asks for bytes outside the resource (answered 416).",
  },
  MOESWARM_HUB_PAYLOAD_TOO_LARGE: { area: "HubError", text: "The request body is larger than allowed." },
  MOESWARM_HUB_INTERNAL: {
    area: "HubError",
    text: "The hub failed while answering (a bug or an I/O error); the request may be retried.",
  },
  MOESWARM_HUB_NO_LEASE: {
    area: "HubError",
    text: "A worker registered a slice that no live lease of its own covers: claim it first (POST /api/claims).",
  },
  MOESWARM_HUB_BANNED: {
    area: "HubError",
    text: "The worker id is quarantined on this hub (a backbone reported wrong answers); an admin may reinstate it.",
  },
  MOESWARM_HUB_TLS: {
    area: "HubError",
    text: "Self-signed TLS certificates could not be made: the openssl CLI is missing or failed.",
  },
  MOESWARM_HUB_ENROL_INVALID: {
    area: "HubError",
    text: "The enrolment code is not one this hub issued: ask the hub's operator for a code (`moeswarm-hub enrol-code`).",
  },
  MOESWARM_HUB_ENROL_EXPIRED: {
    area: "HubError",
    text: "The enrolment code has expired: ask the hub's operator for a new one.",
  },
  MOESWARM_HUB_ENROL_USED: {
    area: "HubError",
    text: "The enrolment code has been used as many times as the operator allowed: ask for a new one.",
  },
  MOESWARM_HUB_ENROL_REVOKED: {
    area: "HubError",
    text: "The enrolment code was revoked (a worker of its owner was quarantined): only the operator can enrol this owner again.",
  },
  MOESWARM_HUB_ENROL_RATE: {
    area: "HubError",
    text: "Too many enrolment attempts from this address (codes are guessed only by trying): wait a minute and try again.",
  },
  MOESWARM_HUB_NOT_OWNER: {
    area: "HubError",
    text: "Only the worker's owner (a worker token of the same owner) or the hub's operator may pause or resume it.",
  },
  MOESWARM_HUB_PAUSED: {
    area: "HubError",
    text: "A notice, not a failure: the hub paused this worker (its owner or the operator); placements leave it out until it is resumed.",
  },
  MOESWARM_HUB_RESUMED: {
    area: "HubError",
    text: "A notice, not a failure: the hub lifted its pause of this worker; placements list it again.",
  },
} as const satisfies Record<string, { area: string; text: string }>;

export type ErrorCode = keyof typeof ERROR_CODES;

export function isErrorCode(value: unknown): value is ErrorCode {
  return typeof value === "string" && Object.hasOwn(ERROR_CODES, value);
}

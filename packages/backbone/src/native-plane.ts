import { type CodeOf, isErrorCode, ProtocolError } from "@moeswarm/core";
import { DecodeError, decode, encode } from "@msgpack/msgpack";

// The native plane's frames on the plugin socket (docs/protocol.md section 10.10): msgpack maps in
// the section-7 framing, on this local socket only (never on a relay or worker link). The plugin
// (C++) reads and writes them with its own codec; these are their one TypeScript definition, with
// the checks of what comes in. core's Frame types stay the wire's: these never cross a network.

/** plugin -> bridge, first on a connection of a plugin that has the native plane. */
export interface NativeHelloFrame {
  v: 1;
  t: "native-hello";
  /** The plugin's process id (for logs). */
  pid: number;
}

/** One remote layer the plugin may send straight to a worker. */
export interface NativeTableEntry {
  layer: number;
  /** The worker's relay id (the ticket names it). */
  worker: string;
  /** Its native listener, `host:port` (IPv6 as `[::1]:port`). */
  addr: string;
  /** SHA-256 of its certificate's DER, 32 uppercase hex pairs joined by `:` (pinned, no CA). */
  fp: string;
  /** A direct-link ticket (`mswt1...`) admitting this backbone to that worker. */
  ticket: string;
  /** The ticket's expiry, unix ms. */
  exp: number;
  /**
   * The half-open range [lo, hi) of expert ids this worker serves for the layer: a layer split over
   * several workers has one entry per worker, with disjoint ranges (the plugin sends each a mode
   * "each" dispatch and combines). Absent: the worker holds the whole layer (the layer's only entry).
   */
  experts?: [number, number];
  /**
   * Another worker holding the entry's whole range (or the whole layer), primary of no range of
   * this layer (phase 3): the plugin sends it the same frame when the primary fails (failover) or
   * has not answered within the table's `hedgeMs` (hedge). Absent: no replica is usable.
   */
  alt?: NativeAltEntry;
}

/** A table entry's replica: where to reach it and the ticket admitting this backbone. */
export interface NativeAltEntry {
  worker: string;
  addr: string;
  fp: string;
  ticket: string;
  exp: number;
}

/** bridge -> plugin, after a native-hello and whenever it changes; each replaces the last. */
export interface NativeTableFrame {
  v: 1;
  t: "native-table";
  /** Rises with every table this bridge builds. */
  seq: number;
  /** The backbone's relay id: the hello's id on the native link. */
  backbone: string;
  /** How long a native split may take before the plugin takes the bridge path, ms. */
  deadlineMs: number;
  /**
   * A primary silent for this long gets the same frame sent to its entry's `alt`, the first valid
   * answer wins (the bridge's own `hedgeMs`). Absent: no hedge (failover only).
   */
  hedgeMs?: number;
  /**
   * Instead of `hedgeMs`, dispatch's adaptive hedge (the bridge's default): a primary silent for
   * max(`hedgeMinMs`, `hedgeFactor` x the p50 of its latest round trips the plugin timed) races
   * its alt; a primary with fewer than 4 of them is not hedged. Both or neither.
   */
  hedgeFactor?: number;
  hedgeMinMs?: number;
  /** One entry per layer, or per owner of a split layer (`experts`); empty: the native plane is off. */
  layers: NativeTableEntry[];
}

/** What the plugin sent one worker for one layer since its last receipts. */
export interface NativeReceiptCount {
  worker: string;
  layer: number;
  /** Splits the worker answered (each a dispatch in mode "sum"). */
  splits: number;
  /** Token rows of those splits. */
  tokens: number;
  /** Filled ids (!= -1) of those splits: what the worker is credited with. */
  expertTokens: number;
}

/** A native split that failed (and went down the bridge path instead). */
export interface NativeReceiptFailure {
  worker: string;
  /** A MOESWARM_* code (the worker's error frame's, or the plugin's own: connect, pin, deadline). */
  code: string;
  msg: string;
  /**
   * True when the split did not go to the bridge after this failure: the entry's alt was asked
   * natively (failover), or was already racing it (hedge). Absent or false: a fallback.
   */
  failover?: boolean;
}

/** plugin -> bridge, at most once a second while native splits happen. */
export interface NativeReceiptsFrame {
  v: 1;
  t: "native-receipts";
  seq: number;
  counts: NativeReceiptCount[];
  /**
   * Layers split over several workers: their native splits and tokens, counted once per split
   * (each owner's count has the tokens that had a slot of its own). Absent: none.
   */
  layers?: NativeReceiptLayer[];
  failures: NativeReceiptFailure[];
  /** Hedges sent since the last receipts (a primary silent for `hedgeMs`), and those the alt won. */
  hedges?: number;
  hedgeWins?: number;
  /**
   * The router's choices in the native splits, per layer: how many filled slots named each expert
   * (what the bridge counts of its own requests for the hub's coverage market). Absent: none.
   */
  routing?: NativeReceiptRouting[];
}

/** One layer's routing counts in receipts: `counts[i]` slots chose expert `experts[i]`. */
export interface NativeReceiptRouting {
  layer: number;
  experts: number[];
  counts: number[];
}

/** A split layer's native splits since the last receipts. */
export interface NativeReceiptLayer {
  layer: number;
  splits: number;
  /** Token rows through the layer. */
  tokens: number;
}

/** What the bridge reads from the plugin. */
export type NativeInFrame = NativeHelloFrame | NativeReceiptsFrame;

/** The frame types of the native plane (all start with "native-"). */
export const NATIVE_FRAME_TYPES = ["native-hello", "native-table", "native-receipts"] as const;

/** Bounds of what the bridge reads: one receipt per (worker, layer), at most this many. */
export const NATIVE_LIMITS = {
  counts: 65_536,
  failures: 4096,
  idBytes: 128,
  msgChars: 16_000,
  /** A receipt's counters: u32 each, as the hub's reports take them. */
  count: 0xffff_ffff,
} as const;

/** Whether core's decoder refused this payload only because of a native-plane frame type. */
export function isNativeFrameType(t: unknown): t is (typeof NATIVE_FRAME_TYPES)[number] {
  return typeof t === "string" && (NATIVE_FRAME_TYPES as readonly string[]).includes(t);
}

/** A native-table's msgpack payload (the caller adds the length prefix). */
export function encodeNativeTable(frame: Omit<NativeTableFrame, "v" | "t">): Uint8Array {
  const body: NativeTableFrame = {
    v: 1,
    t: "native-table",
    seq: frame.seq,
    backbone: frame.backbone,
    deadlineMs: frame.deadlineMs,
    layers: frame.layers.map((e) => ({
      layer: e.layer,
      worker: e.worker,
      addr: e.addr,
      fp: e.fp,
      ticket: e.ticket,
      exp: e.exp,
      ...(e.experts ? { experts: [e.experts[0], e.experts[1]] as [number, number] } : {}),
      ...(e.alt
        ? {
            alt: {
              worker: e.alt.worker,
              addr: e.alt.addr,
              fp: e.alt.fp,
              ticket: e.alt.ticket,
              exp: e.alt.exp,
            },
          }
        : {}),
    })),
    ...(frame.hedgeMs !== undefined ? { hedgeMs: frame.hedgeMs } : {}),
    ...(frame.hedgeFactor !== undefined
      ? { hedgeFactor: frame.hedgeFactor, hedgeMinMs: frame.hedgeMinMs }
      : {}),
  };
  return encode(body);
}

function bad(code: CodeOf<"ProtocolError">, field: string, message: string): ProtocolError {
  return new ProtocolError(code, `native frame: ${field} ${message}`, { details: { field } });
}

function isMap(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v) && !(v instanceof Uint8Array);
}

function uint(o: Record<string, unknown>, key: string, where: string, max: number): number {
  const v = o[key];
  if (v === undefined) throw bad("MOESWARM_PROTOCOL_MISSING_FIELD", `${where}${key}`, "is missing");
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0 || v > max) {
    throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `${where}${key}`, `must be an integer in 0..${max}`);
  }
  return v;
}

function id(o: Record<string, unknown>, key: string, where: string): string {
  const v = o[key];
  if (v === undefined) throw bad("MOESWARM_PROTOCOL_MISSING_FIELD", `${where}${key}`, "is missing");
  if (typeof v !== "string" || v.length === 0 || Buffer.byteLength(v) > NATIVE_LIMITS.idBytes) {
    throw bad(
      "MOESWARM_PROTOCOL_BAD_FIELD",
      `${where}${key}`,
      `must be a string of 1..${NATIVE_LIMITS.idBytes} bytes`,
    );
  }
  return v;
}

function list(o: Record<string, unknown>, key: string, max: number): unknown[] {
  const v = o[key] ?? [];
  if (!Array.isArray(v)) throw bad("MOESWARM_PROTOCOL_BAD_FIELD", key, "must be an array");
  if (v.length > max)
    throw bad("MOESWARM_PROTOCOL_BAD_LENGTH", key, `has ${v.length} entries, at most ${max}`);
  return v;
}

function receiptCount(v: unknown, i: number): NativeReceiptCount {
  const where = `counts[${i}].`;
  if (!isMap(v)) throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `counts[${i}]`, "must be a map");
  const c = NATIVE_LIMITS.count;
  const count: NativeReceiptCount = {
    worker: id(v, "worker", where),
    layer: uint(v, "layer", where, 0x7fff_ffff),
    splits: uint(v, "splits", where, c),
    tokens: uint(v, "tokens", where, c),
    expertTokens: uint(v, "expertTokens", where, c),
  };
  // a split has at least one token row; more filled ids than rows x 65536 experts is a lie or a bug
  if (count.tokens < count.splits || count.expertTokens > count.tokens * 65_536) {
    throw bad(
      "MOESWARM_PROTOCOL_BAD_FIELD",
      `counts[${i}]`,
      "has more splits than tokens, or ids than slots",
    );
  }
  return count;
}

function receiptRouting(v: unknown, i: number): NativeReceiptRouting {
  const where = `routing[${i}].`;
  if (!isMap(v)) throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `routing[${i}]`, "must be a map");
  // each element checked as a field of its own (uint's rules: a safe integer in 0..max)
  const uints = (key: string, max: number) =>
    list(v, key, NATIVE_LIMITS.counts).map((x, j) =>
      uint({ [`${key}[${j}]`]: x }, `${key}[${j}]`, where, max),
    );
  const experts = uints("experts", 0xffff);
  const counts = uints("counts", NATIVE_LIMITS.count);
  if (experts.length !== counts.length)
    throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `routing[${i}]`, "has experts and counts of different lengths");
  return { layer: uint(v, "layer", where, 0x7fff_ffff), experts, counts };
}

function receiptLayer(v: unknown, i: number): NativeReceiptLayer {
  const where = `layers[${i}].`;
  if (!isMap(v)) throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `layers[${i}]`, "must be a map");
  const c = NATIVE_LIMITS.count;
  const l = {
    layer: uint(v, "layer", where, 0x7fff_ffff),
    splits: uint(v, "splits", where, c),
    tokens: uint(v, "tokens", where, c),
  };
  if (l.tokens < l.splits)
    throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `layers[${i}]`, "has more splits than tokens");
  return l;
}

function receiptFailure(v: unknown, i: number): NativeReceiptFailure {
  const where = `failures[${i}].`;
  if (!isMap(v)) throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `failures[${i}]`, "must be a map");
  const code = v.code;
  if (typeof code !== "string" || !/^MOESWARM_[A-Z0-9_]{1,64}$/.test(code)) {
    throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `${where}code`, "must be a MOESWARM_* code");
  }
  const msg = v.msg ?? "";
  if (typeof msg !== "string") throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `${where}msg`, "must be a string");
  const failover = v.failover ?? false;
  if (typeof failover !== "boolean")
    throw bad("MOESWARM_PROTOCOL_BAD_FIELD", `${where}failover`, "must be a boolean");
  return {
    worker: id(v, "worker", where),
    code,
    msg: msg.slice(0, NATIVE_LIMITS.msgChars),
    ...(failover ? { failover: true } : {}),
  };
}

/**
 * Decodes and checks a native-plane frame from the plugin. Unknown keys are ignored (a newer
 * plugin may add some); anything else malformed is a ProtocolError with the field named.
 */
export function decodeNativeFrame(payload: Uint8Array): NativeInFrame {
  let v: unknown;
  try {
    v = decode(payload, { maxStrLength: 1 << 20, maxArrayLength: NATIVE_LIMITS.counts, maxMapLength: 64 });
  } catch (cause) {
    const what = cause instanceof DecodeError || cause instanceof RangeError ? cause.message : String(cause);
    throw new ProtocolError("MOESWARM_PROTOCOL_MALFORMED", `native frame: not a msgpack map (${what})`, {
      cause,
    });
  }
  if (!isMap(v)) throw bad("MOESWARM_PROTOCOL_MALFORMED", "(frame)", "is not a msgpack map");
  if (v.v !== 1) {
    throw new ProtocolError(
      "MOESWARM_PROTOCOL_VERSION",
      `native frame: version ${String(v.v)} is not supported (1)`,
    );
  }
  if (v.t === "native-hello") return { v: 1, t: "native-hello", pid: uint(v, "pid", "", 0xffff_ffff) };
  if (v.t === "native-receipts") {
    return {
      v: 1,
      t: "native-receipts",
      seq: uint(v, "seq", "", Number.MAX_SAFE_INTEGER),
      counts: list(v, "counts", NATIVE_LIMITS.counts).map(receiptCount),
      ...(v.layers !== undefined
        ? { layers: list(v, "layers", NATIVE_LIMITS.counts).map(receiptLayer) }
        : {}),
      failures: list(v, "failures", NATIVE_LIMITS.failures).map(receiptFailure),
      ...(v.hedges !== undefined ? { hedges: uint(v, "hedges", "", NATIVE_LIMITS.count) } : {}),
      ...(v.hedgeWins !== undefined ? { hedgeWins: uint(v, "hedgeWins", "", NATIVE_LIMITS.count) } : {}),
      ...(v.routing !== undefined
        ? { routing: list(v, "routing", NATIVE_LIMITS.counts).map(receiptRouting) }
        : {}),
    };
  }
  throw new ProtocolError(
    "MOESWARM_PROTOCOL_UNKNOWN_TYPE",
    `native frame: the bridge does not read ${JSON.stringify(v.t)}`,
  );
}

/** A failure's code as the bridge counts it: a known code, else "other" (the counters stay bounded). */
export function failureCode(code: string): string {
  return isErrorCode(code) ? code : "other";
}

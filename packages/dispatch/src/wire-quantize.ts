import {
  type ActivationQuantizer,
  type ExpertCallOptions,
  type ExpertRequest,
  type ExpertResult,
  type ExpertTransport,
  InvalidArgumentError,
  type QuantizedActivationDtype,
} from "@moeswarm/core";

// Activations in a CPU worker's vec_dot_type (q8_0 / q8_K, ~3.7x fewer bytes out): ggml's CPU
// mul_mat_id converts f32 activations to that type before any dot product, so rows converted by the
// sender with the same ggml-cpu from_float give the same result bits. A transport wrapper, so the
// dispatcher's local fallback, audits and f64 oracle keep f32: only requests to owners leave as q8.
// Workers say which dtypes their compute takes (hello caps.dtypes, carried by the hub's placement):
// an owner that lists the layer's dtype gets q8 from its first request, one that lists others gets
// f32 without a try, and one that said nothing (an older worker) is tried once and learnt from.

/** What the wrapper did, for the bridge's metrics and `pnpm bench throughput`. */
export interface WireQuantizeMetrics {
  /** Requests that went through the wrapper, whatever they travelled as. */
  requests: number;
  /** Requests answered from q8_0 / q8_K rows. */
  quantized: number;
  /** Of those, per dtype. */
  quantizedByDtype: Record<QuantizedActivationDtype, number>;
  /** Bytes of `x` those requests carried, and what they would have carried as f32. */
  bytesQuantized: number;
  bytesF32: number;
  /** Refused by the owner (MOESWARM_NATIVE_WIRE_DTYPE, or an older codec) and sent again in f32. */
  refusedDtype: number;
  /** Refused because a row would not round-trip on the owner's repacked weights, sent again in f32. */
  refusedInexact: number;
  /** Sent in f32 at once because the local round-trip check failed for an owner that repacks. */
  sentF32Inexact: number;
  /** Sent in f32 at once because the owner's advertised dtypes do not list the layer's. */
  sentF32Unadvertised: number;
  /**
   * Refusals (WIRE_DTYPE) by owners that had advertised the dtype: each cost one resend, and the
   * owner gets f32 from then on (its word is not taken again).
   */
  refusedAdvertised: number;
}

export interface QuantizingTransportOptions {
  /** Owners that may take q8 rows (default all: one that cannot refuses once and is remembered). */
  eligible?: (owner: string) => boolean;
  /**
   * The activation dtypes an owner advertised (its hello's `caps.dtypes`, e.g. the placement's
   * `dtypes(id)`), undefined when it did not say. Default: nobody said, every owner is tried once.
   */
  dtypes?: (owner: string) => readonly string[] | undefined;
}

// an owner whose codec predates the q8 dtypes refuses the frame itself
const OLD_CODEC = new Set(["MOESWARM_PROTOCOL_BAD_FIELD", "MOESWARM_PROTOCOL_BAD_LENGTH"]);

function codeOf(error: unknown): string | undefined {
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" ? code : undefined;
}

/**
 * Sends f32 requests to the owners as q8_0 / q8_K rows where the layer allows it (the quantizer
 * says), resending in f32 when an owner refuses them; what it learns from a refusal is kept per
 * owner and layer: MOESWARM_NATIVE_WIRE_DTYPE (a GPU or TypeScript compute, another type) means
 * f32 from then on, MOESWARM_NATIVE_WIRE_INEXACT (repacked weights, a row that does not
 * round-trip) means "check each request here first". With `dtypes`, an owner's advertised list
 * decides before any try: the layer's dtype listed, q8 at once; not listed, f32 at once; and a
 * WIRE_DTYPE refusal of a listed dtype makes that owner f32 on every layer.
 */
export class QuantizingTransport implements ExpertTransport {
  readonly trusted?: boolean;
  readonly inner: ExpertTransport;
  readonly #q: ActivationQuantizer;
  readonly #eligible: (owner: string) => boolean;
  readonly #dtypes: (owner: string) => readonly string[] | undefined;
  /** owner -> layers that refused q8 ("all": the owner's codec predates it). */
  readonly #refused = new Map<string, Set<number> | "all">();
  /** owner -> layers whose weights the owner repacks. */
  readonly #repacked = new Map<string, Set<number>>();
  readonly #m: WireQuantizeMetrics = {
    requests: 0,
    quantized: 0,
    quantizedByDtype: { q8_0: 0, q8_K: 0 },
    bytesQuantized: 0,
    bytesF32: 0,
    refusedDtype: 0,
    refusedInexact: 0,
    sentF32Inexact: 0,
    sentF32Unadvertised: 0,
    refusedAdvertised: 0,
  };

  constructor(
    inner: ExpertTransport,
    quantizer: ActivationQuantizer,
    options: QuantizingTransportOptions = {},
  ) {
    if (!inner || typeof inner.request !== "function")
      throw new InvalidArgumentError("quantizingTransport needs a transport with request()");
    if (!quantizer || typeof quantizer.quantize !== "function" || typeof quantizer.wireDtype !== "function")
      throw new InvalidArgumentError("quantizingTransport needs an ActivationQuantizer");
    this.inner = inner;
    if (inner.trusted !== undefined) this.trusted = inner.trusted;
    this.#q = quantizer;
    this.#eligible = options.eligible ?? (() => true);
    this.#dtypes = options.dtypes ?? (() => undefined);
  }

  metrics(): WireQuantizeMetrics {
    return { ...this.#m, quantizedByDtype: { ...this.#m.quantizedByDtype } };
  }

  async request(owner: string, req: ExpertRequest, options: ExpertCallOptions): Promise<ExpertResult> {
    this.#m.requests++;
    const q = this.#quantized(owner, req);
    if (q === undefined) return this.inner.request(owner, req, options);
    try {
      const result = await this.inner.request(owner, q, options);
      this.#m.quantized++;
      this.#m.quantizedByDtype[q.dtype as QuantizedActivationDtype]++;
      this.#m.bytesQuantized += q.x.byteLength;
      this.#m.bytesF32 += req.x.byteLength;
      return result;
    } catch (error) {
      const code = codeOf(error);
      if (code === "MOESWARM_NATIVE_WIRE_INEXACT") {
        this.#m.refusedInexact++;
        this.#mark(this.#repacked, owner, req.layer);
      } else if (code === "MOESWARM_NATIVE_WIRE_DTYPE") {
        this.#m.refusedDtype++;
        if (this.#dtypes(owner)?.includes(q.dtype)) {
          // it said it takes this dtype and does not: its word is not taken again
          this.#m.refusedAdvertised++;
          this.#refused.set(owner, "all");
        } else this.#markRefused(owner, req.layer);
      } else if (code !== undefined && OLD_CODEC.has(code)) {
        this.#m.refusedDtype++;
        this.#refused.set(owner, "all");
      } else throw error;
      options.signal.throwIfAborted();
      return this.inner.request(owner, req, options);
    }
  }

  /** The request as q8 rows, or undefined when it goes as it is. */
  #quantized(owner: string, req: ExpertRequest): ExpertRequest | undefined {
    if (req.dtype !== "f32" || !(req.x instanceof Float32Array)) return undefined;
    const refused = this.#refused.get(owner);
    if (refused === "all" || refused?.has(req.layer) || !this.#eligible(owner)) return undefined;
    const dtype = this.#q.wireDtype(req.layer);
    if (dtype === undefined) return undefined;
    const said = this.#dtypes(owner);
    if (said !== undefined && !said.includes(dtype)) {
      this.#m.sentF32Unadvertised++;
      return undefined;
    }
    let x: Uint8Array;
    try {
      x = this.#q.quantize(dtype, req.x, req.embd);
    } catch {
      return undefined; // non-finite activations and the like: f32 says it as it is
    }
    if (this.#repacked.get(owner)?.has(req.layer) && !this.#q.roundTrips(dtype, x, req.embd)) {
      this.#m.sentF32Inexact++;
      return undefined;
    }
    return { ...req, dtype, x };
  }

  #markRefused(owner: string, layer: number): void {
    const r = this.#refused.get(owner);
    if (r === "all") return;
    this.#mark(this.#refused as Map<string, Set<number>>, owner, layer);
  }

  #mark(map: Map<string, Set<number>>, owner: string, layer: number): void {
    let set = map.get(owner);
    if (!set) {
      set = new Set();
      map.set(owner, set);
    }
    set.add(layer);
  }
}

/** `new QuantizingTransport(inner, quantizer, options)`. */
export function quantizingTransport(
  inner: ExpertTransport,
  quantizer: ActivationQuantizer,
  options?: QuantizingTransportOptions,
): QuantizingTransport {
  return new QuantizingTransport(inner, quantizer, options);
}

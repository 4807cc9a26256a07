import {
  type ExpertCallOptions,
  type ExpertRequest,
  type ExpertResult,
  type ExpertTransport,
  InvalidArgumentError,
  isQuantizedActivationDtype,
} from "@moeswarm/core";
import type { RelayConnection } from "./connection-types.js";
import type { WireDtype } from "./wire.js";

export interface RelayTransportOptions {
  /**
   * How f32 activations travel (default "f32"). "f16"/"bf16" halve the bytes but round the
   * activations, so results are no longer bit-identical to a local run.
   */
  wireDtype?: WireDtype;
}

/**
 * The dispatcher's transport over a backbone's relay connection: `owner` is the worker id.
 * Failures keep their codes (TRANSPORT_CLOSED, TRANSPORT_TIMEOUT, TRANSPORT_UNKNOWN_PEER,
 * TRANSPORT_DRAINING, TRANSPORT_LIMIT, TRANSPORT_BACKPRESSURE, or the worker's own code), so the
 * dispatcher can tell failover cases from bad requests. Its results are always f32.
 */
export class RelayTransport implements ExpertTransport {
  /** Relay peers are strangers' devices: a dispatcher verifies their answers by default. */
  readonly trusted = false;
  readonly connection: RelayConnection;
  readonly #wireDtype: WireDtype;

  constructor(connection: RelayConnection, options: RelayTransportOptions = {}) {
    if (connection?.role !== "backbone") {
      throw new InvalidArgumentError("RelayTransport needs a backbone connection");
    }
    const wireDtype = options.wireDtype ?? "f32";
    if (wireDtype !== "f32" && wireDtype !== "f16" && wireDtype !== "bf16") {
      throw new InvalidArgumentError("wireDtype must be f32, f16 or bf16");
    }
    this.connection = connection;
    this.#wireDtype = wireDtype;
  }

  async request(
    owner: string,
    req: ExpertRequest,
    options?: Partial<ExpertCallOptions>,
  ): Promise<ExpertResult & { readonly y: Float32Array }> {
    // q8_0/q8_K rows (dispatch's quantizingTransport converted them) travel as they are
    const quantized = isQuantizedActivationDtype(req?.dtype) && req.x instanceof Uint8Array;
    if (!quantized && (req?.dtype !== "f32" || !(req.x instanceof Float32Array))) {
      throw new InvalidArgumentError(
        "the relay carries f32 (or q8_0/q8_K block) activations only (f64 requests are for in-process workers)",
      );
    }
    const reply = await this.connection.request(
      owner,
      {
        model: req.model,
        layer: req.layer,
        n: req.n,
        embd: req.embd,
        ...(quantized
          ? { dtype: req.dtype, x: req.x }
          : { dtype: this.#wireDtype, x: req.x as Float32Array }),
        k: req.k,
        ids: req.ids,
        w: req.w,
        mode: req.mode,
        ...(req.compact === true && req.mode === "each" ? { compact: true } : {}),
      },
      { signal: options?.signal, deadlineMs: options?.deadlineMs ?? req.deadline },
    );
    const result = {
      mode: req.mode,
      n: req.n,
      k: req.k,
      embd: req.embd,
      y: reply.y,
      ...(reply.compact === true ? { compact: true } : {}),
    };
    return reply.ms === undefined ? result : { ...result, ms: reply.ms };
  }
}

import { InvalidArgumentError } from "@moeswarm/core";
import type { RelayConnection } from "./connection.js";
import type { DispatchMode, WireDtype } from "./wire.js";

// These three mirror @moeswarm/dispatch's ExpertRequest / ExpertResult / ExpertCallOptions
// structurally (a test holds RelayTransport to dispatch's ExpertTransport), so relay-client does
// not depend on dispatch.

/** One worker's share of a layer's expert work, as the dispatcher hands it to a transport. */
export interface TransportRequest {
  readonly model: string;
  readonly layer: number;
  readonly n: number;
  readonly embd: number;
  /** "f64" exists only between in-process peers; the wire has no f64 activations. */
  readonly dtype: "f32" | "f64";
  readonly x: Float32Array | Float64Array;
  readonly k: number;
  readonly ids: Int32Array;
  readonly w?: Float32Array;
  readonly mode: DispatchMode;
  readonly deadline?: number;
  /** Mode "each": the dispatcher accepts a compact result (passed on to the worker). */
  readonly compact?: boolean;
}

export interface TransportResult {
  readonly mode: DispatchMode;
  readonly n: number;
  readonly k: number;
  readonly embd: number;
  readonly y: Float32Array;
  readonly ms?: number;
  /** `y` holds the request's filled slots' rows only. */
  readonly compact?: boolean;
}

export interface TransportCallOptions {
  readonly signal?: AbortSignal;
  readonly deadlineMs?: number;
}

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
 * dispatcher can tell failover cases from bad requests.
 */
export class RelayTransport {
  readonly connection: RelayConnection;
  readonly #wireDtype: WireDtype;

  constructor(connection: RelayConnection, options: RelayTransportOptions = {}) {
    if (connection?.role !== "backbone") {
      throw new InvalidArgumentError(
        "MOESWARM_INVALID_ARGUMENT",
        "RelayTransport needs a backbone connection",
      );
    }
    const wireDtype = options.wireDtype ?? "f32";
    if (wireDtype !== "f32" && wireDtype !== "f16" && wireDtype !== "bf16") {
      throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "wireDtype must be f32, f16 or bf16");
    }
    this.connection = connection;
    this.#wireDtype = wireDtype;
  }

  async request(
    owner: string,
    req: TransportRequest,
    options: TransportCallOptions = {},
  ): Promise<TransportResult> {
    if (req?.dtype !== "f32" || !(req.x instanceof Float32Array)) {
      throw new InvalidArgumentError(
        "MOESWARM_INVALID_ARGUMENT",
        "the relay carries f32 activations only (f64 requests are for in-process workers)",
      );
    }
    const reply = await this.connection.request(
      owner,
      {
        model: req.model,
        layer: req.layer,
        n: req.n,
        embd: req.embd,
        dtype: this.#wireDtype,
        x: req.x,
        k: req.k,
        ids: req.ids,
        w: req.w,
        mode: req.mode,
        ...(req.compact === true && req.mode === "each" ? { compact: true } : {}),
      },
      { signal: options.signal, deadlineMs: options.deadlineMs ?? req.deadline },
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

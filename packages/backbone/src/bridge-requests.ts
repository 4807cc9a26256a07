import {
  type DispatchFrame,
  decodeFrame,
  type ExpertHandler,
  type ExpertTransport,
  errorFrame,
  type Frame,
  isMoeswarmError,
  resultFrame,
  traceHop,
} from "@moeswarm/core";
import {
  type DispatchCallMetrics,
  type DispatchMetrics,
  type DispatchOptions,
  dispatchExpertsDetailed,
  emptyCallMetrics,
  type Liveness,
  type Placement,
  type SpotCheck,
  type Verification,
} from "@moeswarm/dispatch";
import type { BridgeCounters, BridgeRequestStats } from "./bridge-metrics.js";
import type { NativePlane } from "./native-bridge.js";
import { isNativeFrameType } from "./native-plane.js";
import type { PluginConnection, ReplyFn } from "./plugin-socket.js";
import type { RoutingStats } from "./routing-stats.js";

// What the bridge does with each frame from the plugin: a `dispatch` frame (one remote MoE layer of
// one ubatch) becomes one dispatchExperts call, and its combined output the `result` frame.

export interface BridgeRequestsOptions {
  /** The model id the plugin must send. */
  model: string;
  /** The placement a request starts with (a live one changes between requests, never during one). */
  placement: () => Placement;
  transport: ExpertTransport;
  fallback?: ExpertHandler | undefined;
  verify?: SpotCheck | undefined;
  /** Trust "verify"'s state (used when `trust` resolves to "verify"), and liveness. */
  verification?: Verification | undefined;
  liveness?: Liveness | undefined;
  trust?: "verify" | "own" | undefined;
  hedgeMs?: number | undefined;
  deadlineMs?: number | undefined;
  maxFrameBytes: number;
  /** Aborted when the bridge closes: requests in flight end without an answer. */
  signal: AbortSignal;
  /** dispatch's totals, shared by every request. */
  metrics: DispatchMetrics;
  counters: BridgeCounters;
  routing: RoutingStats;
  onStats?: ((stats: BridgeRequestStats) => void) | undefined;
  /** The native plane's frames (native-hello, native-receipts) go here. */
  native?: NativePlane | undefined;
}

type FixedDispatchOptions = Omit<DispatchOptions, "layer" | "placement">;

function isNativeFrame(error: unknown): boolean {
  return (
    isMoeswarmError(error, "MOESWARM_PROTOCOL_UNKNOWN_TYPE") &&
    isNativeFrameType((error.details as { type?: unknown } | undefined)?.type)
  );
}

function errorMessage(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/** Answers the plugin's frames: decodes each and runs the dispatch call a `dispatch` frame asks for. */
export class BridgeRequests {
  private readonly dispatchOptions: FixedDispatchOptions;

  constructor(private readonly o: BridgeRequestsOptions) {
    this.dispatchOptions = {
      transport: o.transport,
      model: o.model,
      // each worker's sum where it holds a token's every slot (bit-identical, k times fewer
      // bytes back), per-slot outputs elsewhere
      mode: "auto",
      signal: o.signal,
      metrics: o.metrics,
      ...(o.fallback ? { fallback: o.fallback } : {}),
      ...(o.verify ? { verify: o.verify } : {}),
      ...(o.verification ? { verification: o.verification } : {}),
      ...(o.liveness ? { liveness: o.liveness } : {}),
      ...(o.trust ? { trust: o.trust } : {}),
      ...(o.hedgeMs !== undefined ? { hedgeMs: o.hedgeMs } : {}),
      ...(o.deadlineMs !== undefined ? { deadlineMs: o.deadlineMs } : {}),
    };
  }

  /** One frame's payload from a plugin connection. */
  onPayload(payload: Uint8Array, conn: PluginConnection): void {
    const t0 = performance.now();
    const { reply } = conn;
    let frame: Frame;
    try {
      frame = decodeFrame(payload, { maxFrameBytes: this.o.maxFrameBytes });
    } catch (error) {
      // the native plane's frames are not core's (they never leave this socket): core's decoder
      // refuses their type, and only then is the payload read as one, so dispatches pay nothing
      if (isNativeFrame(error)) {
        this.o.native?.onPayload(payload, conn);
        return;
      }
      // a bad payload leaves the framing intact: say so and read on
      const code = isMoeswarmError(error) ? error.code : "MOESWARM_PROTOCOL_MALFORMED";
      this.o.counters.failed(code);
      reply(errorFrame({ code, msg: errorMessage(error) }));
      return;
    }
    if (frame.t === "dispatch") {
      this.o.counters.totals.requests++;
      // several requests of one connection may be in flight; each answer carries its id
      void this.answer(frame, t0, reply);
    } else if (frame.t === "ping") {
      reply({ t: "pong", v: 1, seq: frame.seq, ts: frame.ts });
    }
  }

  /** The frame's error answer, counted (and reported to onStats when a dispatch call was made). */
  private fail(
    f: DispatchFrame,
    t0: number,
    reply: ReplyFn,
    code: string,
    msg: string,
    call?: DispatchCallMetrics,
  ) {
    this.o.counters.failed(code);
    reply(errorFrame({ id: f.id, code, msg: msg.slice(0, 16_000) }));
    if (call) {
      this.o.onStats?.({
        layer: f.layer,
        tokens: f.n,
        k: f.k,
        ms: performance.now() - t0,
        error: code,
        dispatch: call,
      });
    }
  }

  private async answer(f: DispatchFrame, t0: number, reply: ReplyFn): Promise<void> {
    const { model } = this.o;
    if (f.model !== model) {
      const msg = `dispatch.model ${JSON.stringify(f.model)}: this bridge serves ${JSON.stringify(model)}`;
      this.fail(f, t0, reply, "MOESWARM_PROTOCOL_BAD_FIELD", msg);
      return;
    }
    if (f.dtype !== "f32" || f.mode !== "sum" || !f.w) {
      const msg = "the bridge answers f32 requests in mode sum, with weights";
      this.fail(f, t0, reply, "MOESWARM_PROTOCOL_BAD_FIELD", msg);
      return;
    }
    this.o.routing.countSelections(f.layer, f.ids);
    // this request's snapshot: a new placement from the hub applies to the requests after it
    const placement = this.o.placement();
    let call: DispatchCallMetrics | undefined;
    try {
      traceHop("bridge.dispatch", f.layer);
      const r = await dispatchExpertsDetailed(
        f.x,
        { n: f.n, k: f.k, ids: f.ids, weights: f.w },
        { layer: f.layer, placement, ...this.dispatchOptions },
      );
      call = r.metrics;
      traceHop("bridge.combined", f.layer);
      this.o.routing.countServed(f.layer, f.n, call.owners);
      const ms = performance.now() - t0;
      reply(resultFrame({ id: f.id, mode: "sum", n: f.n, k: f.k, embd: f.embd, y: r.output, ms }));
      traceHop("bridge.out", f.layer);
      this.o.counters.answered(f.layer, f.n, performance.now() - t0);
      this.o.onStats?.({ layer: f.layer, tokens: f.n, k: f.k, ms, dispatch: call });
    } catch (error) {
      if (this.o.signal.aborted) return;
      const code = isMoeswarmError(error) ? error.code : "MOESWARM_DISPATCH_FAILED";
      this.fail(f, t0, reply, code, errorMessage(error), call ?? emptyCallMetrics(f.layer, "auto", f));
    }
  }
}

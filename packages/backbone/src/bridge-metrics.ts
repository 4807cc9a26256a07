import type {
  DispatchCallMetrics,
  DispatchMetricsSnapshot,
  LivenessSnapshot,
  SpotCheckSnapshot,
  VerificationStats,
  WireQuantizeMetrics,
} from "@moeswarm/dispatch";
import type { HubLinkMetrics } from "./hub-link.js";
import type { NativeMetrics } from "./native-bridge.js";

/** One plugin request as the bridge saw it. */
export interface BridgeRequestStats {
  layer: number;
  tokens: number;
  k: number;
  /** From the frame's arrival to the result's write, on the bridge. */
  ms: number;
  /** The MOESWARM_* code when it failed. */
  error?: string;
  dispatch: DispatchCallMetrics;
}

export interface BridgeLayerLatency {
  layer: number;
  requests: number;
  tokens: number;
  meanMs: number;
  p50Ms: number;
  p99Ms: number;
  maxMs: number;
}

/** The bridge's counters: a plain object (JSON-safe). */
export interface BridgeMetrics {
  /** Plugin connections open now, and ever accepted. */
  connections: number;
  connectionsTotal: number;
  requests: number;
  failed: number;
  tokens: number;
  /** Bytes of frames (with length prefixes) from and to the plugin. */
  bytesIn: number;
  bytesOut: number;
  /** Worker requests retried on a replica, and answered by the fallback in a worker's place. */
  failovers: number;
  fallbacks: number;
  /** Trust "verify": agreed answers re-computed locally by the fallback before use (never a fallback). */
  audits: number;
  /** Per remote layer: the bridge's time per request, from the frame in to the result out. */
  layers: BridgeLayerLatency[];
  /** Failed requests by error code. */
  errors: Record<string, number>;
  /** The workers' side: requests, bytes, latency and compute per worker (dispatch's totals). */
  dispatch: DispatchMetricsSnapshot;
  /** With `spotCheck`: checks, disagreements, the quarantined workers and their strikes. */
  spotCheck?: SpotCheckSnapshot;
  /** Trust "verify": parts verified, disagreements, third opinions, quarantines, extra bytes and compute. */
  verification?: VerificationStats;
  /** An untrusted transport: timeouts, circuits opened and open, per-worker round times. */
  liveness?: LivenessSnapshot;
  /** With `hub`: the placement version followed, the poller's and the reporter's counters. */
  hub?: HubLinkMetrics;
  /**
   * With `wire`: requests sent as q8_0/q8_K, their activation bytes against f32's, refusals.
   * `dispatch.bytesOut` counts activations as f32; the wire carried `bytesF32 - bytesQuantized` fewer.
   */
  wire?: WireQuantizeMetrics;
  /**
   * The native data plane: whether it is on (and why not), the table pushed to the plugin, the
   * native splits its receipts reported (credited like the bridge's own), fallbacks by code.
   */
  native?: NativeMetrics;
}

const SAMPLES = 4096;

class LayerLatency {
  requests = 0;
  tokens = 0;
  totalMs = 0;
  maxMs = 0;
  readonly samples = new Float64Array(SAMPLES);
  next = 0;

  add(ms: number, tokens: number): void {
    this.samples[this.next++ % SAMPLES] = ms;
    this.requests++;
    this.tokens += tokens;
    this.totalMs += ms;
    this.maxMs = Math.max(this.maxMs, ms);
  }

  summary(layer: number): BridgeLayerLatency {
    const v = this.samples.slice(0, Math.min(this.next, SAMPLES)).sort();
    // nearest rank over the most recent samples
    const at = (q: number) =>
      v.length === 0 ? 0 : v[Math.min(v.length - 1, Math.max(0, Math.ceil(q * v.length) - 1))]!;
    return {
      layer,
      requests: this.requests,
      tokens: this.tokens,
      meanMs: this.requests ? this.totalMs / this.requests : 0,
      p50Ms: at(0.5),
      p99Ms: at(0.99),
      maxMs: this.maxMs,
    };
  }
}

/** What `BridgeCounters.snapshot` adds from the bridge's other parts. */
export interface BridgeMetricsParts {
  connections: number;
  dispatch: DispatchMetricsSnapshot;
  spotCheck?: SpotCheckSnapshot | undefined;
  verification?: VerificationStats | undefined;
  liveness?: LivenessSnapshot | undefined;
  hub?: HubLinkMetrics | undefined;
  wire?: WireQuantizeMetrics | undefined;
  native?: NativeMetrics | undefined;
}

/** The bridge's own side of its metrics: the plugin's traffic, failures and per-layer latency. */
export class BridgeCounters {
  readonly totals = {
    connectionsTotal: 0,
    requests: 0,
    failed: 0,
    tokens: 0,
    bytesIn: 0,
    bytesOut: 0,
  };
  private readonly errors: Record<string, number> = Object.create(null) as Record<string, number>;
  private readonly layers = new Map<number, LayerLatency>();

  /** An error code seen (a broken stream counts here without failing a request). */
  error(code: string): void {
    this.errors[code] = (this.errors[code] ?? 0) + 1;
  }

  /** A request (or an undecodable frame) answered with an error frame. */
  failed(code: string): void {
    this.totals.failed++;
    this.error(code);
  }

  /** A request answered with its result. */
  answered(layer: number, tokens: number, ms: number): void {
    this.totals.tokens += tokens;
    let l = this.layers.get(layer);
    if (!l) {
      l = new LayerLatency();
      this.layers.set(layer, l);
    }
    l.add(ms, tokens);
  }

  snapshot(parts: BridgeMetricsParts): BridgeMetrics {
    const d = parts.dispatch;
    return {
      connections: parts.connections,
      ...this.totals,
      failovers: d.failovers,
      fallbacks: d.fallbacks,
      audits: d.audits,
      layers: [...this.layers.entries()].sort((a, b) => a[0] - b[0]).map(([layer, l]) => l.summary(layer)),
      errors: { ...this.errors },
      dispatch: d,
      ...(parts.spotCheck ? { spotCheck: parts.spotCheck } : {}),
      ...(parts.verification ? { verification: parts.verification } : {}),
      ...(parts.liveness ? { liveness: parts.liveness } : {}),
      ...(parts.hub ? { hub: parts.hub } : {}),
      ...(parts.wire ? { wire: parts.wire } : {}),
      ...(parts.native ? { native: parts.native } : {}),
    };
  }
}

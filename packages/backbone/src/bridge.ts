import { existsSync, lstatSync, rmSync } from "node:fs";
import { connect, createServer, type Server, type Socket } from "node:net";
import {
  abortReason,
  DEFAULT_MAX_FRAME_BYTES,
  type DispatchFrame,
  decodeFrame,
  encodeLengthPrefixed,
  errorFrame,
  type Frame,
  FrameReader,
  InvalidArgumentError,
  isMoeswarmError,
  resultFrame,
  TransportError,
  throwIfAborted,
  traceHop,
} from "@moeswarm/core";
import {
  type DispatchCallMetrics,
  DispatchMetrics,
  type DispatchMetricsSnapshot,
  dispatchExpertsDetailed,
  type ExpertCompute,
  type ExpertTransport,
  FALLBACK_OWNER,
  type Placement,
  REFERENCE_OWNER,
  SpotCheck,
  type SpotCheckOptions,
  type SpotCheckSnapshot,
} from "@moeswarm/dispatch";
import {
  checkHubOptions,
  connectHub,
  type HubLink,
  type HubLinkMetrics,
  type HubLinkOptions,
} from "./hub-link.js";
import type { BridgeStatsReport } from "./stats-report.js";

/** Where the bridge listens: a Unix socket path, or TCP (port 0 picks a free one). */
export type BridgeSocket = string | { readonly host?: string; readonly port: number };

/** The bridge's hub: its URL, a backbone token and the model id (see {@link HubLinkOptions}). */
export type BackboneHubOptions = Omit<HubLinkOptions, "signal">;

export interface BackboneBridgeOptions {
  socket: BridgeSocket;
  /**
   * The model id the plugin sends (`MOESWARM_MODEL`); default `hub.model`, else `placement.model`.
   * Others are refused.
   */
  model?: string;
  /**
   * Who serves which expert, with `transport`: a Placement, or a function asked at each request
   * (a live placement, such as `connectHub(...).placement`). Exclusive with `hub`.
   */
  placement?: Placement | (() => Placement);
  transport?: ExpertTransport;
  /**
   * Instead of `placement` + `transport`: the bridge connects to the hub (`connectHub`), follows
   * its live placement, sends the experts over its relay and reports routing statistics and
   * receipts to it; closing the bridge closes that link (after a final report).
   */
  hub?: BackboneHubOptions;
  /** Serves experts no live worker can (e.g. `createLocalFallback(modelPath).compute`). */
  fallback?: ExpertCompute;
  /** How long each worker request may take before failover (dispatch's default: 30 s). */
  deadlineMs?: number;
  /** Largest frame accepted from the plugin (default 64 MiB). */
  maxFrameBytes?: number;
  /** Closes the bridge when aborted. */
  signal?: AbortSignal;
  /** Called after every answered or failed request (for logs, the hub's statistics). */
  onStats?: (stats: BridgeRequestStats) => void;
  /**
   * Result spot-checking (dispatch's `SpotCheck`): this share of the workers' answers is
   * re-computed by `fallback` (else by another owner) before the combine; a worker that disagrees
   * is quarantined (`bridge.spotCheck.release(id)` lets it back). `SpotCheckOptions` without
   * `reference`: the fallback is the reference. Off by default.
   */
  spotCheck?: Omit<SpotCheckOptions, "reference">;
  /**
   * Hedged requests (dispatch's `hedgeMs`): a worker silent for this long gets a twin request to
   * a replica; the first answer wins. Off by default.
   */
  hedgeMs?: number;
}

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
  /** Worker requests retried on a replica, and answered by the fallback. */
  failovers: number;
  fallbacks: number;
  /** Per remote layer: the bridge's time per request, from the frame in to the result out. */
  layers: BridgeLayerLatency[];
  /** Failed requests by error code. */
  errors: Record<string, number>;
  /** The workers' side: requests, bytes, latency and compute per worker (dispatch's totals). */
  dispatch: DispatchMetricsSnapshot;
  /** With `spotCheck`: checks, disagreements, the quarantined workers and their strikes. */
  spotCheck?: SpotCheckSnapshot;
  /** With `hub`: the placement version followed, the poller's and the reporter's counters. */
  hub?: HubLinkMetrics;
}

/** How often the router sent tokens of a layer to an expert (for the hub's coverage market). */
export interface RoutingCount {
  layer: number;
  expert: number;
  count: number;
}

export interface BackboneBridge extends AsyncDisposable {
  /** What the plugin's `MOESWARM_BRIDGE` takes: `unix:/path` or `tcp:host:port`. */
  readonly address: string;
  /** With `hub`: the link to the hub (its live placement, relay connection and reporter). */
  readonly hub: HubLink | undefined;
  /** With `spotCheck`: the checker shared by every request (`quarantined()`, `release(id)`). */
  readonly spotCheck: SpotCheck | undefined;
  metrics(): BridgeMetrics;
  /** Routing counts since the start or the last report, by layer then expert. */
  routingCounts(): IterableIterator<RoutingCount>;
  /**
   * The counts since the previous report for the hub's coverage market, and starts a new span.
   * `nExpert`: the routed experts per layer (the length of each counts array).
   */
  takeStatsReport(options: { nExpert: number }): BridgeStatsReport;
  close(): Promise<void>;
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

function invalid(message: string): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", message);
}

function checkOptions(o: BackboneBridgeOptions): void {
  if (typeof o !== "object" || o === null) throw invalid("serveBackboneBridge needs options");
  const s = o.socket;
  if (typeof s === "string") {
    if (s.length === 0 || Buffer.byteLength(s) > 107)
      throw invalid("socket path must be 1..107 bytes (sun_path)");
  } else if (
    typeof s !== "object" ||
    s === null ||
    !Number.isInteger(s.port) ||
    s.port < 0 ||
    s.port > 65535
  ) {
    throw invalid("socket must be a Unix socket path or {host, port}");
  }
  if (o.hub !== undefined) {
    if (o.placement !== undefined || o.transport !== undefined) {
      throw invalid("give either hub or placement + transport, not both");
    }
    checkHubOptions(o.hub);
    if (o.model !== undefined && o.model !== o.hub.model) {
      throw invalid(`model ${JSON.stringify(o.model)} differs from hub.model ${JSON.stringify(o.hub.model)}`);
    }
  } else {
    const p = o.placement;
    if (!p || (typeof p !== "function" && typeof p.choose !== "function")) {
      throw invalid("placement must be a Placement or a function returning one (or give hub)");
    }
    if (!o.transport || typeof o.transport.request !== "function")
      throw invalid("transport must have request() (or give hub)");
  }
  if (o.fallback !== undefined && typeof o.fallback !== "function")
    throw invalid("fallback must be a function");
  if (o.model !== undefined && (typeof o.model !== "string" || o.model.length === 0)) {
    throw invalid("model must be a non-empty string");
  }
  const sc = o.spotCheck;
  if (sc !== undefined && (typeof sc !== "object" || sc === null || "reference" in sc)) {
    throw invalid("spotCheck must be { fraction, minCosine?, seed?, ... } (the fallback is its reference)");
  }
  const h = o.hedgeMs;
  if (h !== undefined && !(typeof h === "number" && Number.isFinite(h) && h >= 0)) {
    throw invalid("hedgeMs must be a finite number >= 0");
  }
  const max = o.maxFrameBytes;
  if (max !== undefined && (!Number.isInteger(max) || max < 1024 || max > 0xffff_ffff)) {
    throw invalid("maxFrameBytes must be an integer in 1024..2^32-1");
  }
}

/** A Unix socket left by a process that died: nobody accepts on it. */
function staleSocket(path: string): Promise<boolean> {
  return new Promise((resolve) => {
    if (!existsSync(path) || !lstatSync(path).isSocket()) {
      resolve(false);
      return;
    }
    const probe = connect(path);
    probe.once("connect", () => {
      probe.destroy();
      resolve(false);
    });
    probe.once("error", (e: NodeJS.ErrnoException) => resolve(e.code === "ECONNREFUSED"));
  });
}

function listen(server: Server, socket: BridgeSocket): Promise<void> {
  return new Promise((resolve, reject) => {
    const onError = (e: Error) => {
      server.off("listening", onListening);
      reject(e);
    };
    const onListening = () => {
      server.off("error", onError);
      resolve();
    };
    server.once("error", onError);
    server.once("listening", onListening);
    if (typeof socket === "string") server.listen(socket);
    else server.listen(socket.port, socket.host ?? "127.0.0.1");
  });
}

/**
 * Answers the `libggml-moeswarm` plugin: reads length-prefixed `dispatch` frames (one per remote
 * MoE layer and ubatch: the normed hidden rows, the top-k ids, the router weights) from each
 * connection, runs `dispatchExperts` in mode "each" (the combine in the router's slot order, as
 * llama.cpp adds its experts) and writes the combined output back as a `result` frame (mode
 * "sum"). A dispatch failure becomes an `error` frame, which makes that `llama_decode` fail.
 */
export async function serveBackboneBridge(options: BackboneBridgeOptions): Promise<BackboneBridge> {
  checkOptions(options);
  // SpotCheck validates the rest (InvalidArgumentError), before anything connects
  const verify = options.spotCheck
    ? new SpotCheck({ ...options.spotCheck, ...(options.fallback ? { reference: options.fallback } : {}) })
    : undefined;
  throwIfAborted(options.signal);
  const { fallback, deadlineMs, signal, onStats } = options;
  const maxFrameBytes = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
  // the hub first: a hub that refuses us must not leave a socket listening
  const link = options.hub ? await connectHub({ ...options.hub, ...(signal ? { signal } : {}) }) : undefined;
  const given = options.placement;
  const currentPlacement: () => Placement = link
    ? link.placement
    : typeof given === "function"
      ? given
      : () => given as Placement;
  const transport = link ? link.transport : (options.transport as ExpertTransport);
  const model = options.model ?? link?.model ?? currentPlacement().model;

  const controller = new AbortController();
  const sockets = new Set<Socket>();
  const layers = new Map<number, LayerLatency>();
  let routing = new Map<number, Map<number, number>>();
  // the current report span: tokens per layer, and what each worker served
  let spanStart = performance.now();
  let spanTokens = new Map<number, number>();
  let receipts = new Map<string, { slots: number; requests: number; latencyMs: number }>();
  const dispatchMetrics = new DispatchMetrics();
  const totals = {
    connectionsTotal: 0,
    requests: 0,
    failed: 0,
    tokens: 0,
    bytesIn: 0,
    bytesOut: 0,
  };
  const errors: Record<string, number> = Object.create(null) as Record<string, number>;

  const countRouting = (layer: number, ids: Int32Array) => {
    let byExpert = routing.get(layer);
    if (!byExpert) {
      byExpert = new Map();
      routing.set(layer, byExpert);
    }
    for (const e of ids) if (e >= 0) byExpert.set(e, (byExpert.get(e) ?? 0) + 1);
  };

  const send = (socket: Socket, frame: Frame) => {
    if (socket.destroyed) return;
    const bytes = encodeLengthPrefixed(frame, { maxFrameBytes: 0xffff_ffff });
    totals.bytesOut += bytes.byteLength;
    socket.write(bytes);
  };

  const answer = async (socket: Socket, f: DispatchFrame, t0: number): Promise<void> => {
    const fail = (code: string, msg: string, dispatch?: DispatchCallMetrics) => {
      totals.failed++;
      errors[code] = (errors[code] ?? 0) + 1;
      send(socket, errorFrame({ id: f.id, code, msg: msg.slice(0, 16_000) }));
      if (dispatch)
        onStats?.({ layer: f.layer, tokens: f.n, k: f.k, ms: performance.now() - t0, error: code, dispatch });
    };
    if (f.model !== model) {
      fail(
        "MOESWARM_PROTOCOL_BAD_FIELD",
        `dispatch.model ${JSON.stringify(f.model)}: this bridge serves ${JSON.stringify(model)}`,
      );
      return;
    }
    if (f.dtype !== "f32" || f.mode !== "sum" || !f.w) {
      fail("MOESWARM_PROTOCOL_BAD_FIELD", "the bridge answers f32 requests in mode sum, with weights");
      return;
    }
    countRouting(f.layer, f.ids);
    // this request's snapshot: a new placement from the hub applies to the requests after it
    const placement = currentPlacement();
    let metrics: DispatchCallMetrics | undefined;
    try {
      traceHop("bridge.dispatch", f.layer);
      const r = await dispatchExpertsDetailed(
        f.x,
        { n: f.n, k: f.k, ids: f.ids, weights: f.w },
        {
          layer: f.layer,
          placement,
          transport,
          model,
          // each worker's sum where it holds a token's every slot (bit-identical, k times fewer
          // bytes back), per-slot outputs elsewhere
          mode: "auto",
          signal: controller.signal,
          metrics: dispatchMetrics,
          ...(fallback ? { fallback } : {}),
          ...(verify ? { verify } : {}),
          ...(options.hedgeMs !== undefined ? { hedgeMs: options.hedgeMs } : {}),
          ...(deadlineMs !== undefined ? { deadlineMs } : {}),
        },
      );
      metrics = r.metrics;
      traceHop("bridge.combined", f.layer);
      spanTokens.set(f.layer, (spanTokens.get(f.layer) ?? 0) + f.n);
      for (const [id, o] of Object.entries(metrics.owners)) {
        if (o.failures === o.requests || id === REFERENCE_OWNER) continue;
        const rec = receipts.get(id) ?? { slots: 0, requests: 0, latencyMs: 0 };
        rec.slots += o.slots;
        rec.requests += o.requests - o.failures;
        rec.latencyMs += o.latencyMs;
        receipts.set(id, rec);
      }
      const ms = performance.now() - t0;
      send(socket, resultFrame({ id: f.id, mode: "sum", n: f.n, k: f.k, embd: f.embd, y: r.output, ms }));
      traceHop("bridge.out", f.layer);
      totals.tokens += f.n;
      let l = layers.get(f.layer);
      if (!l) {
        l = new LayerLatency();
        layers.set(f.layer, l);
      }
      l.add(performance.now() - t0, f.n);
      onStats?.({ layer: f.layer, tokens: f.n, k: f.k, ms, dispatch: metrics });
    } catch (error) {
      if (controller.signal.aborted) return;
      const code = isMoeswarmError(error) ? error.code : "MOESWARM_DISPATCH_FAILED";
      const msg = error instanceof Error ? error.message : String(error);
      fail(code, msg, metrics ?? emptyCall(f));
    }
  };

  const onFrame = (socket: Socket, payload: Uint8Array): void => {
    const t0 = performance.now();
    totals.bytesIn += payload.byteLength + 4;
    let frame: Frame;
    try {
      frame = decodeFrame(payload, { maxFrameBytes });
    } catch (error) {
      // a bad payload leaves the framing intact: say so and read on
      const code = isMoeswarmError(error) ? error.code : "MOESWARM_PROTOCOL_MALFORMED";
      totals.failed++;
      errors[code] = (errors[code] ?? 0) + 1;
      send(socket, errorFrame({ code, msg: error instanceof Error ? error.message : String(error) }));
      return;
    }
    if (frame.t === "dispatch") {
      totals.requests++;
      // several requests of one connection may be in flight; each answer carries its id
      void answer(socket, frame, t0);
    } else if (frame.t === "ping") {
      send(socket, { t: "pong", v: 1, seq: frame.seq, ts: frame.ts });
    }
  };

  // core's FrameReader (what readFrames wraps): on a broken stream the bridge can still write its
  // error frame before it ends the connection
  const serveConnection = (socket: Socket): void => {
    sockets.add(socket);
    totals.connectionsTotal++;
    socket.setNoDelay(true);
    const reader = new FrameReader({ maxFrameBytes });
    const broken = (error: unknown) => {
      const code = isMoeswarmError(error) ? error.code : "MOESWARM_PROTOCOL_MALFORMED";
      errors[code] = (errors[code] ?? 0) + 1;
      send(socket, errorFrame({ code, msg: error instanceof Error ? error.message : String(error) }));
      socket.end();
      socket.removeListener("data", onData);
    };
    const onData = (chunk: Buffer) => {
      traceHop("bridge.in");
      let payloads: Uint8Array[];
      try {
        payloads = reader.push(chunk);
      } catch (error) {
        broken(error);
        return;
      }
      for (const p of payloads) onFrame(socket, p);
    };
    socket.on("data", onData);
    socket.on("end", () => {
      try {
        reader.end();
        socket.end();
      } catch (error) {
        broken(error);
      }
    });
    socket.on("error", () => socket.destroy());
    socket.on("close", () => sockets.delete(socket));
  };

  const server = createServer(serveConnection);
  const socketPath = typeof options.socket === "string" ? options.socket : undefined;
  try {
    await listen(server, options.socket);
  } catch (error) {
    try {
      if (
        socketPath &&
        (error as NodeJS.ErrnoException).code === "EADDRINUSE" &&
        (await staleSocket(socketPath))
      ) {
        rmSync(socketPath, { force: true });
        await listen(server, options.socket);
      } else {
        throw new TransportError(
          "MOESWARM_TRANSPORT_CONNECT",
          `the bridge cannot listen on ${socketPath ?? JSON.stringify(options.socket)}: ${(error as Error).message}`,
          { cause: error },
        );
      }
    } catch (failure) {
      await link?.close();
      throw failure;
    }
  }
  const bound = server.address();
  const address =
    socketPath !== undefined
      ? `unix:${socketPath}`
      : `tcp:${typeof bound === "object" && bound ? (bound.family === "IPv6" ? `[${bound.address}]` : bound.address) : "127.0.0.1"}:${typeof bound === "object" && bound ? bound.port : 0}`;

  function* routingCounts(): IterableIterator<RoutingCount> {
    for (const layer of [...routing.keys()].sort((a, b) => a - b)) {
      const byExpert = routing.get(layer)!;
      for (const expert of [...byExpert.keys()].sort((a, b) => a - b)) {
        yield { layer, expert, count: byExpert.get(expert)! };
      }
    }
  }

  let closing: Promise<void> | undefined;
  const close = (): Promise<void> => {
    closing ??= (async () => {
      signal?.removeEventListener("abort", onAbort);
      controller.abort(signal?.aborted ? abortReason(signal) : new Error("the bridge is closing"));
      const closed = new Promise<void>((resolve) => server.close(() => resolve()));
      for (const s of sockets) s.destroy();
      await closed;
      if (socketPath && (await staleSocket(socketPath))) rmSync(socketPath, { force: true });
      // after the last answer: the final report holds everything the bridge did
      await link?.close();
    })();
    return closing;
  };
  const onAbort = () => void close();
  signal?.addEventListener("abort", onAbort, { once: true });
  if (signal?.aborted) {
    await close();
    throw abortReason(signal);
  }

  const bridge: BackboneBridge = {
    address,
    hub: link,
    spotCheck: verify,
    metrics(): BridgeMetrics {
      const d = dispatchMetrics.snapshot();
      return {
        connections: sockets.size,
        ...totals,
        failovers: d.failovers,
        fallbacks: d.fallbacks,
        layers: [...layers.entries()].sort((a, b) => a[0] - b[0]).map(([layer, l]) => l.summary(layer)),
        errors: { ...errors },
        dispatch: d,
        ...(verify ? { spotCheck: verify.snapshot() } : {}),
        ...(link ? { hub: link.metrics() } : {}),
      };
    },
    routingCounts,
    takeStatsReport({ nExpert }: { nExpert: number }): BridgeStatsReport {
      if (!Number.isInteger(nExpert) || nExpert < 1 || nExpert > 65_536) {
        throw invalid("takeStatsReport: nExpert must be an integer in 1..65536");
      }
      const counts: Record<string, number[]> = {};
      for (const [layer, byExpert] of routing) {
        const row = new Array<number>(nExpert).fill(0);
        for (const [e, c] of byExpert) {
          if (e >= nExpert)
            throw invalid(`takeStatsReport: expert ${e} was routed in layer ${layer}, nExpert is ${nExpert}`);
          row[e] = c;
        }
        counts[String(layer)] = row;
      }
      const out: BridgeStatsReport["receipts"] = {};
      for (const [id, r] of receipts) {
        // the fallback is this process, not a worker to credit
        if (id === FALLBACK_OWNER) continue;
        out[id] = { expertTokens: r.slots, ...(r.requests > 0 ? { ms: r.latencyMs / r.requests } : {}) };
      }
      const lowest = Math.min(...spanTokens.keys());
      const now = performance.now();
      const report: BridgeStatsReport = {
        tokens: spanTokens.size ? spanTokens.get(lowest)! : 0,
        ms: now - spanStart,
        counts,
        receipts: out,
      };
      routing = new Map();
      spanTokens = new Map();
      receipts = new Map();
      spanStart = now;
      return report;
    },
    close,
    [Symbol.asyncDispose]: close,
  };
  link?.reportStatsFrom(bridge);
  return bridge;
}

function emptyCall(f: DispatchFrame): DispatchCallMetrics {
  return {
    layer: f.layer,
    mode: "auto",
    sumRequests: 0,
    tokens: f.n,
    k: f.k,
    requests: 0,
    bytesOut: 0,
    bytesIn: 0,
    failovers: 0,
    fallbacks: 0,
    spotChecks: 0,
    spotDisagreements: 0,
    spotUnverifiable: 0,
    hedges: 0,
    hedgeWins: 0,
    owners: Object.create(null) as DispatchCallMetrics["owners"],
    wallMs: 0,
  };
}

import {
  AuthError,
  abortReason,
  type DirectEndpointJson,
  InvalidArgumentError,
  isMoeswarmError,
  isQuantizedActivationDtype,
  type MoeswarmError,
  onAbort,
  sleep,
  TransportError,
  traceHop,
  type WireActivationDtype,
} from "@moeswarm/core";
import {
  connectRelay,
  type DirectServer,
  type DispatchAnswer,
  type DispatchAnswerInto,
  type IncomingDispatch,
  isTransient,
  type RelayConnection,
  selfSignedCertificate,
} from "@moeswarm/relay-client";
import type { RunRequest } from "@moeswarm/worker-native";
import { DIRECT_REPORT_MS, DirectServedReport, publishDirect, startDirect } from "./direct.js";
import type { WorkerEventBody } from "./events.js";
import { NativePlane } from "./native.js";
import type { Settings } from "./options.js";
import { codeOf, jitter, message } from "./run-helpers.js";
import type { RunOutput, SliceRouter } from "./slice-router.js";

/** The answer's activations as the compute takes them: q8 rows as they came, others as f32. */
function runRequestOf(req: IncomingDispatch): RunRequest {
  // q8_0/q8_K rows go to the compute as they came: a CPU compute of the native core takes them,
  // any other refuses them (MOESWARM_NATIVE_WIRE_DTYPE) and the sender sends f32
  const q8 = isQuantizedActivationDtype(req.dtype);
  const request: { -readonly [K in keyof RunRequest]: RunRequest[K] } = {
    layer: req.layer,
    x: q8 ? (req.x as Uint8Array) : req.activations(),
    ids: req.ids,
    k: req.k,
    mode: req.mode,
  };
  if (q8) request.xType = req.dtype as RunRequest["xType"];
  if (req.w) request.w = req.w;
  return request;
}

// The serving side of a run: the relay connection, the dispatches it brings (routed to the slices'
// computes), what was served, and the drain.

/** What serving needs from the run. */
export interface ServingContext {
  readonly s: Settings;
  emit(body: WorkerEventBody): void;
  /** Aborted when the run stops. */
  readonly stop: AbortSignal;
  /** Asks the run to stop: the hub's drain, or a relay connection closed for good. */
  requestStop(reason: "signal" | "drain", text: string): void;
  /** The relay connection closed for good: the run rejects with this. */
  fatal(error: MoeswarmError): void;
  /** A relay notice (a connection-level error frame): true when it was handled (the hub's pause). */
  onNotice?(code: string, msg: string): boolean;
  /** The relay connection came back (the hub may have restarted meanwhile). */
  onReconnect?(): void;
  /** Whether the run is paused (the native listener then serves nothing). */
  paused?(): boolean;
}

/** The run's relay side: one router per model, the counters of what was served, the in-flight count. */
export class Serving {
  readonly #ctx: ServingContext;
  /** The computes of the slices served, per model. */
  readonly routers = new Map<string, SliceRouter>();
  #requests = 0;
  #tokens = 0;
  #failed = 0;
  #inFlight = 0;
  #draining = false;
  #idleWaiters: Array<() => void> = [];
  #dispatchErrors = 0;
  #direct: { server: DirectServer; endpoint: DirectEndpointJson } | undefined;
  /** The native listener (--listen-native), when it runs. */
  #native: NativePlane | undefined;
  /** What was answered directly, reported to the hub for credits, and its timer. */
  #served: { report: DirectServedReport; timer: NodeJS.Timeout } | undefined;

  constructor(ctx: ServingContext) {
    this.#ctx = ctx;
  }

  /** Dispatches answered. */
  get requests(): number {
    return this.#requests;
  }

  /** Tokens in the dispatches answered. */
  get tokens(): number {
    return this.#tokens;
  }

  /** Dispatches that failed. */
  get failed(): number {
    return this.#failed;
  }

  /**
   * Connects to the relay, retrying transient failures until it works or the worker stops. The
   * hello says which activation dtypes the compute takes (`dtypes`, compute-class.ts
   * wireDtypesOf; the hub hands them to backbones with the placement), or nothing when undefined.
   */
  async connect(dtypes?: readonly WireActivationDtype[]): Promise<RelayConnection> {
    const { s, stop } = this.#ctx;
    // the direct endpoint and the native listener listen before the relay registrations, so the
    // placement that first lists this worker's slices already carries them
    await this.#listen();
    let published = false;
    for (let attempt = 1; ; attempt++) {
      // aborting connectRelay's signal closes the connection, and a drain must not: this one
      // only aborts while connecting
      const connecting = new AbortController();
      if (stop.aborted) connecting.abort(abortReason(stop));
      const stopping = onAbort(stop, (reason) => connecting.abort(reason));
      try {
        const endpoint = this.#endpoint();
        if (endpoint && !published) {
          if (await publishDirect(s.hub, s.id, endpoint, connecting.signal)) {
            this.#published();
          } else {
            // a hub from before direct links: serve through the relay alone
            this.#ctx.emit({ event: "direct-unsupported", hub: s.hub.base.href });
            await this.closeDirect();
          }
          published = true;
        }
        const conn = await connectRelay(s.relay, {
          role: "worker",
          id: s.id,
          token: s.token,
          ...(s.hub.ca !== undefined ? { ca: s.hub.ca } : {}),
          ...(s.heartbeatMs !== undefined ? { heartbeatMs: s.heartbeatMs } : {}),
          ...(dtypes !== undefined ? { caps: { dtypes: [...dtypes] } } : {}),
          signal: connecting.signal,
          onDispatch: (req) => this.answer(req),
          // the hub takes this worker out of service: drain as on a signal
          onDrain: (reason) => this.#ctx.requestStop("drain", `the hub asked${reason ? `: ${reason}` : ""}`),
        });
        this.#ctx.emit({ event: "connected", url: s.relay });
        conn.on((e) => {
          if (e.type === "drain") return; // onDrain has it
          if (e.type === "notice") {
            if (this.#ctx.onNotice?.(e.error.code, e.error.message)) return;
            this.#ctx.emit({ event: "relay", state: "notice", error: `${e.error.code}: ${e.error.message}` });
            return;
          }
          if (e.state === "closed") {
            if (!stop.aborted) {
              const fatal =
                e.error && isMoeswarmError(e.error)
                  ? e.error
                  : new TransportError(
                      "MOESWARM_TRANSPORT_CLOSED",
                      `the relay connection closed${e.error ? `: ${e.error.message}` : ""}`,
                    );
              this.#ctx.fatal(fatal);
              this.#ctx.emit({ event: "relay", state: "closed", error: fatal.message });
              this.#ctx.requestStop("signal", "relay connection closed");
            }
            return;
          }
          // a hub that restarted forgot the endpoints: told again with the registrations
          const told = this.#endpoint();
          if (e.state === "connected" && told) {
            publishDirect(s.hub, s.id, told, stop).catch(() => {});
          }
          if (e.state === "connected") this.#ctx.onReconnect?.();
          this.#ctx.emit({
            event: "relay",
            state: e.state,
            attempt: e.attempt,
            delayMs: e.delayMs,
            error: e.error ? message(e.error) : undefined,
          });
        });
        return conn;
      } catch (error) {
        if (stop.aborted) throw abortReason(stop);
        if (error instanceof AuthError || !isTransient(error)) throw error;
        const retryInMs = Math.min(30_000, 500 * 2 ** Math.min(attempt - 1, 10));
        this.#ctx.emit({ event: "hub-unreachable", error: message(error), code: codeOf(error), retryInMs });
        await sleep(jitter(retryInMs), stop);
      } finally {
        stopping[Symbol.dispose]();
      }
    }
  }

  /** Starts the direct endpoint and the native listener (one certificate) and the served reports. */
  async #listen(): Promise<void> {
    const { s, stop } = this.#ctx;
    if ((!s.direct && !s.native) || this.#served) return;
    const given = s.direct?.cert ?? s.native?.cert;
    const tls =
      given !== undefined
        ? { cert: given, key: (s.direct?.cert !== undefined ? s.direct.key : s.native?.key) as string }
        : await selfSignedCertificate({ signal: stop });
    const emit = (body: WorkerEventBody) => this.#ctx.emit(body);
    if (s.direct) {
      this.#direct = await startDirect(s.direct, {
        id: s.id,
        hub: s.hub,
        onDispatch: (req) => this.#answerDirect(req),
        emit,
        signal: stop,
        tls,
      });
    }
    if (s.native) {
      const compute = s.backend === "llama-cpu" ? "llama-cpu" : "native";
      this.#native = await NativePlane.start(s.native, {
        id: s.id,
        hub: s.hub,
        tls,
        compute,
        emit,
        signal: stop,
      });
      this.nativeRoutes();
    }
    const report = new DirectServedReport(s.hub, s.id);
    const timer = setInterval(
      () => {
        this.#takeNative();
        // a failed send keeps its counts for the next one
        report.flush(stop).catch(() => {});
      },
      s.direct?.reportMs ?? s.native?.reportMs ?? DIRECT_REPORT_MS,
    );
    timer.unref();
    this.#served = { report, timer };
  }

  /** What PUT /api/workers/:id/direct tells: the direct endpoints and the native addresses. */
  #endpoint(): DirectEndpointJson | undefined {
    const native = this.#native;
    if (!this.#direct && !native) return undefined;
    return {
      endpoints: this.#direct ? [...this.#direct.endpoint.endpoints] : [],
      fingerprint: this.#direct?.endpoint.fingerprint ?? (native as NativePlane).server.fingerprint,
      ...(native ? { native: [...native.addresses] } : {}),
    };
  }

  #published(): void {
    if (this.#direct) {
      const { endpoint, server } = this.#direct;
      this.#ctx.emit({ event: "direct", ...endpoint, port: server.port });
    }
    if (this.#native) {
      const { addresses, server } = this.#native;
      this.#ctx.emit({
        event: "native-listening",
        addresses,
        fingerprint: server.fingerprint,
        port: server.port,
      });
    }
  }

  /**
   * Sets the native listener's table from the routers: call after every slice added or removed,
   * and on pause, resume and drain (nothing is served then).
   */
  nativeRoutes(): void {
    this.#native?.setRoutes(this.routers, !this.#draining && this.#ctx.paused?.() !== true);
  }

  /** The native listener's counts, into the served report. */
  #takeNative(): void {
    for (const e of this.#native?.takeServed() ?? []) {
      this.#served?.report.addCounts(e.backbone, e.model, e.expertTokens, e.requests);
    }
  }

  /**
   * Answers one dispatch (the relay and the direct server call it): `{ y, ms }` from a compute on
   * the thread pool or `{ fill }`, which writes the answer into the result frame (a small
   * request is computed right there) and returns its ms. A request the compute runs inline is
   * answered without a promise (relay-client then sends it at once); a refusal is thrown.
   */
  answer(
    req: IncomingDispatch,
  ): DispatchAnswer | DispatchAnswerInto | Promise<DispatchAnswer | DispatchAnswerInto> {
    let router: SliceRouter;
    let request: RunRequest;
    let inline: RunOutput | undefined;
    const t0 = performance.now();
    try {
      if (this.#draining) {
        throw new TransportError("MOESWARM_TRANSPORT_DRAINING", `worker ${this.#ctx.s.id} is draining`);
      }
      router = this.#routerOf(req);
      traceHop("worker.run", req.layer);
      request = runRequestOf(req);
      // layer and expert ids are checked against the slices (InvalidArgumentError); the signal is
      // not read (relay-client makes it only when asked): a dispatch it gets is not aborted yet,
      // one aborted while it waited in dispatches() is not handed out
      inline = router.inlineOutput(request);
    } catch (error) {
      this.#dispatchFailed(req, error);
      throw error;
    }
    if (inline) return this.#fillAnswer(req, inline, t0);
    return this.#answerLater(req, router, request, t0);
  }

  /** answer() of a request computed on the thread pool or split over slices. */
  async #answerLater(
    req: IncomingDispatch,
    router: SliceRouter,
    request: RunRequest,
    t0: number,
  ): Promise<DispatchAnswer | DispatchAnswerInto> {
    this.#inFlight++;
    try {
      const output = await router.runOutput(request, { signal: req.signal });
      if (output.y) {
        traceHop("worker.ran", req.layer);
        this.#served1(req);
        return { y: output.y, ms: performance.now() - t0 };
      }
      // written straight into the result frame (relay-client's respondInto), without an array of
      // its own: the rows of a dispatch split over slices, or their weighted sum
      return this.#fillAnswer(req, output, t0);
    } catch (error) {
      this.#dispatchFailed(req, error);
      throw error;
    } finally {
      this.#inFlight--;
      if (this.#inFlight === 0) for (const w of this.#idleWaiters.splice(0)) w();
    }
  }

  /** answer() on the direct link: what it answered is counted for the hub's credits. */
  #answerDirect(req: IncomingDispatch): ReturnType<Serving["answer"]> {
    const answer = this.answer(req);
    if (!(answer instanceof Promise)) {
      this.#served?.report.add(req.from, req.model, req.ids);
      return answer;
    }
    return answer.then((a) => {
      this.#served?.report.add(req.from, req.model, req.ids);
      return a;
    });
  }

  #routerOf(req: IncomingDispatch): SliceRouter {
    const router = this.routers.get(req.model);
    if (!router || router.size === 0) {
      throw new InvalidArgumentError(
        `model ${req.model} is not served here (${[...this.routers.keys()].join(", ") || "nothing yet"})`,
      );
    }
    if (req.embd !== router.nEmbd) {
      throw new InvalidArgumentError(`embd ${req.embd} does not match the slice's n_embd ${router.nEmbd}`);
    }
    return router;
  }

  /**
   * `{ fill }`: `output` written into the result frame's y (a small request's compute itself, the
   * addon's runSync into the frame), counted as served or failed. `fill` returns the ms since
   * `t0`, which the frame carries (it follows y on the wire). (`fill` may be called detached.)
   */
  #fillAnswer(req: IncomingDispatch, output: RunOutput, t0: number): DispatchAnswerInto {
    return { fill: (y: Float32Array) => this.#filled(req, output, y, t0) };
  }

  #filled(req: IncomingDispatch, output: RunOutput, y: Float32Array, t0: number): number {
    try {
      if (y.length !== output.values) {
        throw new InvalidArgumentError(`the answer has ${output.values} values, the result ${y.length}`);
      }
      output.write(y);
    } catch (error) {
      this.#dispatchFailed(req, error);
      throw error;
    }
    traceHop("worker.ran", req.layer);
    this.#served1(req);
    return performance.now() - t0;
  }

  #served1(req: IncomingDispatch): void {
    this.#requests++;
    this.#tokens += req.n;
  }

  #dispatchFailed(req: IncomingDispatch, error: unknown): void {
    this.#failed++;
    this.#dispatchErrors++;
    // a hostile or confused backbone must not flood the log: the first ten, then every hundredth
    if (this.#dispatchErrors <= 10 || this.#dispatchErrors % 100 === 0) {
      this.#ctx.emit({
        event: "dispatch-error",
        error: message(error),
        code: codeOf(error),
        layer: req.layer,
        from: req.from,
      });
    }
  }

  /**
   * Closes the direct endpoint and the native listener (their dispatches are aborted; backbones
   * go back to the relay), and sends the last served counts.
   */
  async closeDirect(): Promise<void> {
    const direct = this.#direct;
    this.#direct = undefined;
    await direct?.server.close();
    this.#takeNative();
    this.#native?.close();
    this.#takeNative();
    this.#native = undefined;
    const served = this.#served;
    this.#served = undefined;
    if (served) {
      clearInterval(served.timer);
      // the last counts, with a short bound: a hub that is gone must not hold the drain
      await served.report.flush(AbortSignal.timeout(5000)).catch(() => {});
    }
  }

  /**
   * Stops taking dispatches, withdraws every registration, waits for those in flight (at most
   * drainTimeoutMs) and closes the connection.
   */
  async drain(conn: RelayConnection, reason: string, slices: number): Promise<void> {
    const t0 = performance.now();
    this.#draining = true;
    this.nativeRoutes();
    this.#ctx.emit({ event: "drain", reason, inFlight: this.#inFlight });
    try {
      // withdraws every registration on the relay
      conn.drain(reason);
    } catch {
      // the connection is down: nothing to tell the relay
    }
    let abandoned = 0;
    if (this.#inFlight > 0) {
      const idle = new Promise<void>((resolve) => this.#idleWaiters.push(resolve));
      const timedOut = !(await Promise.race([
        idle.then(() => true),
        sleep(this.#ctx.s.drainTimeoutMs).then(() => false),
      ]));
      if (timedOut) abandoned = this.#inFlight;
    }
    // a small request's compute runs in its answer's encoding (fill), in the promise jobs right
    // after its handler returned: one turn of the event loop lets those answers out first
    await new Promise<void>((resolve) => setImmediate(resolve));
    await conn.close();
    await this.closeDirect();
    this.#ctx.emit({
      event: "drained",
      requests: this.#requests,
      tokens: this.#tokens,
      failed: this.#failed,
      inFlightAbandoned: abandoned,
      slices,
      ms: performance.now() - t0,
    });
  }
}

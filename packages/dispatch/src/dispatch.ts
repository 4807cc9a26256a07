import type { ExpertHandler, ExpertRequest, ExpertResult, ExpertTransport } from "@moeswarm/core";
import {
  AbortError,
  abortReason,
  DispatchError,
  expandSlots,
  filledSlots,
  formatRange,
  InvalidArgumentError,
  isMoeswarmError,
  toRanges,
} from "@moeswarm/core";
import { combineSlotsF32, combineSlotsF64, type SlotSources } from "./combine.js";
import {
  type DispatchCallMetrics,
  type DispatchMetrics,
  FALLBACK_OWNER,
  type OwnerCallMetrics,
  REFERENCE_OWNER,
} from "./metrics.js";
import { checkRouting } from "./oracle.js";
import type { Placement } from "./placement.js";
import type { Routing } from "./route.js";
import { SpotCheck } from "./spot-check.js";

export interface DispatchOptions {
  /** The MoE layer (block index) the routing belongs to. */
  readonly layer: number;
  readonly placement: Placement;
  readonly transport: ExpertTransport;
  /** Model id in the requests; default `placement.model`. */
  readonly model?: string;
  readonly signal?: AbortSignal;
  /** How long to wait for each request before failing over (default 30000 ms). */
  readonly deadlineMs?: number;
  /**
   * "each" (default): workers return every slot's output and the combine here is in the router's
   * k order, bit-identical whatever the placement. "auto" (recommended; the backbone bridge uses
   * it): per worker request, "sum" when the worker holds every filled slot of every token it is
   * sent (its weighted sum, products rounded to f32 and added in slot order, is then the whole sum,
   * the same bits as the combine here: k times fewer bytes back), else "each"; bit-identical to
   * "each" whatever the placement, but every worker must answer both modes as the protocol says.
   * "sum": workers always return their partial sums; partials from several workers are added here,
   * which is not bit-identical across placements (f32 addition is not associative; see README).
   * The f64 path treats "auto" as "each".
   */
  readonly mode?: "each" | "sum" | "auto";
  /** Serves experts whose workers failed (after the replica retry) or that have no owner. */
  readonly fallback?: ExpertHandler;
  /** Retry a failed request once on replicas (default true). */
  readonly retry?: boolean;
  /** Aggregate collector; every call, failed ones too, is recorded. */
  readonly metrics?: DispatchMetrics;
  /**
   * Hedged requests (tail latency): a worker that has not answered after this many ms gets a
   * twin request to a replica owning all the same experts; the first good answer is used and the
   * other request is cancelled. Off by default. Replicas on other hardware round differently, so
   * with hedging the output bits can depend on which replica was faster (the values never do).
   */
  readonly hedgeMs?: number;
  /**
   * Result spot-checking, shared across calls: a sampled share of the workers' answers is
   * re-computed (its `reference`, else a replica) before the combine; a disagreeing answer is
   * replaced and its worker struck, and quarantined workers get no requests.
   */
  readonly verify?: SpotCheck;
}

export interface DispatchResult<T extends Float32Array | Float64Array> {
  /** `[n x embd]`. */
  readonly output: T;
  readonly metrics: DispatchCallMetrics;
}

const DEFAULT_DEADLINE_MS = 30_000;
const MAX_TOKENS = 65_536;
const MAX_EMBD = 65_536;

type Precision = "f32" | "f64";

/** One answered request: which tokens and experts it covered and the worker's `y`. */
interface Part {
  readonly tokens: Int32Array;
  readonly ids: Int32Array;
  readonly y: Float32Array | Float64Array;
  /** The layout of `y`: the request's mode. */
  readonly mode: "each" | "sum";
  readonly experts: readonly number[];
  /** The worker that answered; undefined for the fallback and the reference. */
  readonly worker: string | undefined;
  /** A spot check compared it (or it is the re-computation that replaced a worker's answer). */
  readonly verified: boolean;
}

/**
 * A compact "each" result (the filled slots' rows, in slot order) laid out in full: `n*k*embd`,
 * zeros for the empty slots; or why it cannot be (a string).
 */
function expandCompact(request: ExpertRequest, ids: Int32Array, r: ExpertResult): ExpertResult | string {
  const { n, k, embd } = request;
  if (request.mode !== "each" || request.compact !== true)
    return "a compact result to a request that did not ask for one";
  if (r.mode !== "each") return `a compact result must be mode "each", not ${String(r.mode)}`;
  if (r.n !== n || r.k !== k || r.embd !== embd) {
    return `shape n=${r.n} k=${r.k} embd=${r.embd}, expected n=${n} k=${k} embd=${embd}`;
  }
  if (!(r.y instanceof Float32Array)) return "y must be a Float32Array";
  const filled = filledSlots(ids);
  if (r.y.length !== filled * embd) {
    return `a compact y has ${r.y.length} values, expected ${filled * embd} (${filled} filled slots)`;
  }
  return { ...r, y: expandSlots(r.y, ids, embd), compact: false };
}

/** Index of the first NaN or ±Infinity in `y[from .. from+count)`, or -1. */
function nonFinite(y: Float32Array | Float64Array, from: number, count: number): number {
  for (let i = from; i < from + count; i++) {
    // x - x is 0 for finite x and NaN for NaN and ±Infinity: one compare per value
    if (y[i]! - y[i]! !== 0) return i;
  }
  return -1;
}

function describeExperts(experts: readonly number[]): string {
  return toRanges(experts).map(formatRange).join(",");
}

function validateOptions(options: DispatchOptions): void {
  if (typeof options !== "object" || options === null) {
    throw new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", "dispatchExperts: options are required");
  }
  if (!Number.isInteger(options.layer) || options.layer < 0) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: layer must be a non-negative integer",
    );
  }
  const p = options.placement as Partial<Placement> | undefined;
  if (!p || typeof p.choose !== "function" || typeof p.owners !== "function") {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: placement must be a Placement",
    );
  }
  if (!options.transport || typeof options.transport.request !== "function") {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: transport must have request()",
    );
  }
  const d = options.deadlineMs;
  if (d !== undefined && !(Number.isFinite(d) && d > 0 && d <= 2_147_483_647)) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: deadlineMs must be in (0, 2^31)",
    );
  }
  if (
    options.mode !== undefined &&
    options.mode !== "each" &&
    options.mode !== "sum" &&
    options.mode !== "auto"
  ) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `dispatchExperts: unknown mode ${String(options.mode)}`,
    );
  }
  if (options.fallback !== undefined && typeof options.fallback !== "function") {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: fallback must be a function",
    );
  }
  const h = options.hedgeMs;
  if (h !== undefined && !(typeof h === "number" && Number.isFinite(h) && h >= 0)) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: hedgeMs must be a finite number >= 0",
    );
  }
  if (options.verify !== undefined && !(options.verify instanceof SpotCheck)) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: verify must be a SpotCheck",
    );
  }
}

/**
 * llama4 weights the expert *input* (llama-graph.cpp:1965, 2104-2109): each (token, slot) becomes its own
 * row `fround(w * x)` with one slot of weight 1, so dispatch and combine need no special case;
 * the per-slot outputs are then added in slot order.
 */
function expandWeightBeforeFfn(
  hidden: Float32Array | Float64Array,
  routing: Routing,
  embd: number,
  precision: Precision,
): { hidden: Float32Array | Float64Array; routing: Routing } {
  const { n, k, ids, weights } = routing;
  const x = precision === "f32" ? new Float32Array(n * k * embd) : new Float64Array(n * k * embd);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < k; j++) {
      const w = weights[i * k + j]!;
      const o = (i * k + j) * embd;
      for (let c = 0; c < embd; c++) x[o + c] = w * hidden[i * embd + c]!;
    }
  }
  return {
    hidden: x,
    routing: { n: n * k, k: 1, ids: ids.slice(), weights: new Float32Array(n * k).fill(1) },
  };
}

class CallState {
  readonly precision: Precision;
  readonly layer: number;
  readonly model: string;
  readonly mode: "each" | "sum" | "auto";
  readonly deadlineMs: number;
  readonly placement: Placement;
  readonly transport: ExpertTransport;
  readonly fallback: ExpertHandler | undefined;
  readonly retry: boolean;
  readonly verify: SpotCheck | undefined;
  readonly hedgeMs: number | undefined;
  readonly hidden: Float32Array | Float64Array;
  readonly routing: Routing;
  readonly embd: number;
  readonly rotation: number;
  /** Aborted when the call ends early (caller abort or a failure): cancels outstanding requests. */
  readonly controller = new AbortController();
  /** Outstanding attempts, ended together when the call ends early (one listener, not one each). */
  readonly #active = new Set<(reason: unknown) => void>();
  readonly metrics: DispatchCallMetrics;

  constructor(
    precision: Precision,
    options: DispatchOptions,
    hidden: Float32Array | Float64Array,
    routing: Routing,
    embd: number,
  ) {
    this.precision = precision;
    this.layer = options.layer;
    this.model = options.model ?? options.placement.model;
    this.mode = precision === "f64" && options.mode !== "sum" ? "each" : (options.mode ?? "each");
    this.deadlineMs = options.deadlineMs ?? DEFAULT_DEADLINE_MS;
    this.placement = options.placement;
    this.transport = options.transport;
    this.fallback = options.fallback;
    this.retry = options.retry ?? true;
    this.verify = options.verify;
    this.hedgeMs = options.hedgeMs;
    this.hidden = hidden;
    this.routing = routing;
    this.embd = embd;
    this.rotation = options.placement.nextRotation();
    const signal = this.controller.signal;
    signal.addEventListener(
      "abort",
      () => {
        for (const end of [...this.#active]) end(signal.reason);
      },
      { once: true },
    );
    this.metrics = {
      layer: options.layer,
      mode: this.mode,
      sumRequests: 0,
      tokens: routing.n,
      k: routing.k,
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
      // worker ids are untrusted (a peer may call itself "__proto__"): no prototype to pollute
      owners: Object.create(null) as Record<string, OwnerCallMetrics>,
      wallMs: 0,
    };
  }

  owner(id: string): OwnerCallMetrics {
    let o = Object.hasOwn(this.metrics.owners, id) ? this.metrics.owners[id] : undefined;
    if (!o) {
      o = {
        requests: 0,
        tokens: 0,
        slots: 0,
        bytesOut: 0,
        bytesIn: 0,
        latencyMs: 0,
        latencyMsMax: 0,
        computeMs: 0,
        failures: 0,
      };
      this.metrics.owners[id] = o;
    }
    return o;
  }

  /** The request for the given experts: every token with a slot among them, other slots -1. */
  build(experts: ReadonlySet<number>): { request: ExpertRequest; tokens: Int32Array; slots: number } {
    const { n, k, ids, weights } = this.routing;
    const embd = this.embd;
    const tokenList: number[] = [];
    let slots = 0;
    for (let i = 0; i < n; i++) {
      let hit = false;
      for (let j = 0; j < k; j++) {
        if (experts.has(ids[i * k + j]!)) {
          hit = true;
          slots++;
        }
      }
      if (hit) tokenList.push(i);
    }
    const m = tokenList.length;
    const tokens = Int32Array.from(tokenList);
    let mode: "each" | "sum" = this.mode === "each" ? "each" : "sum";
    if (this.mode === "auto") {
      // "sum" only when no token it gets has a filled slot owned elsewhere
      scan: for (const i of tokenList) {
        for (let j = 0; j < k; j++) {
          const id = ids[i * k + j]!;
          if (id >= 0 && !experts.has(id)) {
            mode = "each";
            break scan;
          }
        }
      }
    }
    const x = this.precision === "f32" ? new Float32Array(m * embd) : new Float64Array(m * embd);
    const rid = new Int32Array(m * k);
    const w = mode === "sum" ? new Float32Array(m * k) : undefined;
    for (let r = 0; r < m; r++) {
      const i = tokens[r]!;
      x.set(this.hidden.subarray(i * embd, (i + 1) * embd), r * embd);
      for (let j = 0; j < k; j++) {
        const id = ids[i * k + j]!;
        const mine = experts.has(id);
        rid[r * k + j] = mine ? id : -1;
        if (w && mine) w[r * k + j] = weights[i * k + j]!;
      }
    }
    const request: ExpertRequest = {
      model: this.model,
      layer: this.layer,
      n: m,
      embd,
      dtype: this.precision,
      x,
      k,
      ids: rid,
      ...(w ? { w } : {}),
      mode,
      deadline: Math.ceil(this.deadlineMs),
      // only the owned slots' rows need to come back (f32 only: the wire has no f64)
      ...(mode === "each" && this.precision === "f32" ? { compact: true } : {}),
    };
    return { request, tokens, slots };
  }

  /** The result in the full layout (a compact one expanded), checked; or why it is refused. */
  accept(request: ExpertRequest, ids: Int32Array, result: ExpertResult): ExpertResult | string {
    if (typeof result === "object" && result !== null && result.compact === true) {
      const full = expandCompact(request, ids, result);
      if (typeof full === "string") return full;
      result = full;
    }
    return this.check(request, ids, result) ?? result;
  }

  /** Checks shape, type and finiteness of a result before anything is combined. */
  check(request: ExpertRequest, ids: Int32Array, result: ExpertResult): string | undefined {
    if (typeof result !== "object" || result === null) return "the result is not an object";
    if (result.mode !== request.mode) return `mode ${String(result.mode)}, expected ${request.mode}`;
    if (result.n !== request.n || result.k !== request.k || result.embd !== request.embd) {
      return `shape n=${result.n} k=${result.k} embd=${result.embd}, expected n=${request.n} k=${request.k} embd=${request.embd}`;
    }
    const y = result.y;
    const okType = y instanceof Float32Array || (this.precision === "f64" && y instanceof Float64Array);
    if (!okType)
      return `y must be a ${this.precision === "f32" ? "Float32Array" : "Float32Array or Float64Array"}`;
    const { n, k, embd } = request;
    const want = request.mode === "each" ? n * k * embd : n * embd;
    if (y.length !== want) return `y has ${y.length} values, expected ${want}`;
    // every value the combine will read must be finite (empty slots are never read)
    let bad = -1;
    if (request.mode === "sum") bad = nonFinite(y, 0, y.length);
    else for (let s = 0; s < n * k && bad < 0; s++) if (ids[s]! >= 0) bad = nonFinite(y, s * embd, embd);
    return bad < 0 ? undefined : `y[${bad}] is not finite`;
  }

  /**
   * One request to one worker (or the fallback) with the deadline; settles once. A reply that
   * arrives after the deadline or after the call ended is dropped.
   */
  attempt(
    worker: string,
    experts: readonly number[],
    via: "transport" | "fallback" | "reference",
    cancel?: AbortSignal,
  ): Promise<Part> {
    const { request, tokens, slots } = this.build(new Set(experts));
    // a transport may transfer (detach) the request's buffers: keep the slot ids for the combine
    const ids = request.ids.slice();
    const key = via === "fallback" ? FALLBACK_OWNER : via === "reference" ? REFERENCE_OWNER : worker;
    const who =
      via === "fallback" ? "the fallback" : via === "reference" ? "the reference" : `worker ${worker}`;
    const om = this.owner(key);
    om.requests++;
    om.tokens += request.n;
    om.slots += slots;
    const out = request.x.byteLength + request.ids.byteLength + (request.w?.byteLength ?? 0);
    om.bytesOut += out;
    this.metrics.bytesOut += out;
    this.metrics.requests++;
    if (request.mode === "sum") this.metrics.sumRequests++;
    if (via === "fallback") this.metrics.fallbacks++;
    const callSignal = this.controller.signal;
    const attemptController = new AbortController();
    const t0 = performance.now();
    if (via === "transport") this.placement.acquire(worker);
    return new Promise<Part>((resolve, reject) => {
      let settled = false;
      let cancelled = false;
      const onCancel = () => {
        cancelled = true;
        finish(cancel?.reason ?? new AbortError("MOESWARM_ABORTED", "the hedge's twin answered first"));
      };
      const finish = (error: unknown, result?: ExpertResult) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        this.#active.delete(onCallAbort);
        cancel?.removeEventListener("abort", onCancel);
        if (via === "transport") this.placement.release(worker);
        const ms = performance.now() - t0;
        om.latencyMs += ms;
        om.latencyMsMax = Math.max(om.latencyMsMax, ms);
        if (error !== undefined) {
          attemptController.abort(error);
          // the loser of a hedge did nothing wrong
          if (!cancelled) om.failures++;
          reject(error);
          return;
        }
        const r = this.accept(request, ids, result!);
        if (typeof r === "string") {
          om.failures++;
          reject(
            new DispatchError(
              "MOESWARM_DISPATCH_BAD_RESULT",
              `layer ${this.layer}: ${who} answered experts ${describeExperts(experts)} with a bad result: ${r}`,
              { details: { layer: this.layer, worker: key, experts: describeExperts(experts), reason: r } },
            ),
          );
          return;
        }
        // what travelled: a compact answer's rows, not the layout they were expanded to
        const wireBytes = result!.y.byteLength;
        om.bytesIn += wireBytes;
        this.metrics.bytesIn += wireBytes;
        if (typeof r.ms === "number" && Number.isFinite(r.ms)) om.computeMs += r.ms;
        resolve({
          tokens,
          ids,
          y: r.y,
          mode: request.mode,
          experts,
          worker: via === "transport" ? worker : undefined,
          verified: false,
        });
      };
      const onCallAbort = (reason: unknown) => finish(reason);
      const timer = setTimeout(() => {
        finish(
          new DispatchError(
            "MOESWARM_WORKER_TIMEOUT",
            `layer ${this.layer}: ${who} did not answer experts ${describeExperts(experts)} within ${this.deadlineMs} ms`,
            {
              details: {
                layer: this.layer,
                worker: key,
                experts: describeExperts(experts),
                deadlineMs: this.deadlineMs,
              },
            },
          ),
        );
      }, this.deadlineMs);
      if (callSignal.aborted) {
        finish(callSignal.reason);
        return;
      }
      if (cancel?.aborted) {
        onCancel();
        return;
      }
      cancel?.addEventListener("abort", onCancel, { once: true });
      this.#active.add(onCallAbort);
      let pending: Promise<ExpertResult>;
      try {
        const local =
          via === "fallback" ? this.fallback : via === "reference" ? this.verify?.reference : undefined;
        pending = local
          ? Promise.resolve(local(request, { signal: attemptController.signal }))
          : this.transport.request(worker, request, {
              signal: attemptController.signal,
              deadlineMs: this.deadlineMs,
            });
        if (!pending || typeof pending.then !== "function")
          throw new TypeError("transport.request did not return a promise");
      } catch (error) {
        pending = Promise.reject(error);
      }
      pending.then(
        (r) => finish(undefined, r),
        (e: unknown) => finish(e ?? new Error("request rejected without a reason")),
      );
    });
  }

  /** The final error when nobody could serve these experts. */
  failure(error: unknown, worker: string, experts: readonly number[], tried: string): DispatchError {
    const code =
      isMoeswarmError(error, "MOESWARM_WORKER_TIMEOUT") ||
      isMoeswarmError(error, "MOESWARM_DISPATCH_BAD_RESULT")
        ? (error as DispatchError).code
        : "MOESWARM_DISPATCH_FAILED";
    const reason = error instanceof Error ? error.message : String(error);
    return new DispatchError(
      code,
      `layer ${this.layer}: experts ${describeExperts(experts)} failed on worker ${worker} and ${tried}: ${reason}`,
      {
        cause: error,
        details: { layer: this.layer, worker, experts: describeExperts(experts), model: this.model },
      },
    );
  }

  /** Local fallback for experts nobody else serves, or the typed error. */
  async fallbackFor(
    error: unknown,
    worker: string,
    experts: readonly number[],
    tried: string,
  ): Promise<Part[]> {
    if (!this.fallback) throw this.failure(error, worker, experts, `${tried} and there is no fallback`);
    try {
      return [await this.attempt(worker, experts, "fallback")];
    } catch (fallbackError) {
      if (this.controller.signal.aborted) throw fallbackError;
      throw this.failure(fallbackError, worker, experts, `${tried} and the fallback failed too`);
    }
  }

  /** Workers `choose` must skip: the quarantined ones, plus `also`. */
  exclude(also?: string): Set<string> | undefined {
    const out = this.verify?.excluded();
    if (also === undefined) return out;
    return out ? out.add(also) : new Set([also]);
  }

  /** One worker's answer for its experts, spot-checked when the draw says so. */
  async answer(worker: string, experts: readonly number[], avoid?: string): Promise<Part> {
    // drawn before sending, so the draws follow the call's (deterministic) send order, not arrival
    const sampled = this.verify?.sample() ?? false;
    const part =
      this.hedgeMs === undefined
        ? await this.attempt(worker, experts, "transport")
        : await this.hedged(worker, experts, this.hedgeMs, avoid);
    return sampled ? this.spotCheck(part.worker ?? worker, part) : part;
  }

  /**
   * The request, and after `hedgeMs` without an answer a twin to a replica owning all the same
   * experts: the first good answer wins and the other request is cancelled. When both fail, the
   * worker's own error is thrown (failover takes it from there).
   */
  async hedged(worker: string, experts: readonly number[], hedgeMs: number, avoid?: string): Promise<Part> {
    const cancelFirst = new AbortController();
    const first = this.attempt(worker, experts, "transport", cancelFirst.signal);
    let timer: ReturnType<typeof setTimeout> | undefined;
    const early = await Promise.race([
      first.then(
        (part) => ({ part }),
        (error: unknown) => ({ error }),
      ),
      new Promise<undefined>((resolve) => {
        timer = setTimeout(() => resolve(undefined), hedgeMs);
      }),
    ]);
    clearTimeout(timer);
    if (early !== undefined) {
      if ("error" in early) throw early.error;
      return early.part;
    }
    const replica = this.replicaOfAll(worker, experts, avoid);
    if (replica === undefined || this.controller.signal.aborted) return first;
    this.metrics.hedges++;
    const cancelSecond = new AbortController();
    const second = this.attempt(replica, experts, "transport", cancelSecond.signal);
    return new Promise<Part>((resolve, reject) => {
      let failed = 0;
      let firstError: unknown;
      const lost = () => {
        if (++failed === 2) reject(firstError);
      };
      first.then(
        (part) => {
          cancelSecond.abort();
          resolve(part);
        },
        (error: unknown) => {
          firstError = error;
          lost();
        },
      );
      second.then(
        (part) => {
          this.metrics.hedgeWins++;
          cancelFirst.abort();
          resolve(part);
        },
        (error: unknown) => {
          firstError ??= error;
          lost();
        },
      );
    });
  }

  /** Another owner of every expert of the part, not quarantined, chosen as `choose` would. */
  replicaOfAll(worker: string, experts: readonly number[], avoid?: string): string | undefined {
    const exclude = this.exclude(worker)!;
    if (avoid !== undefined) exclude.add(avoid);
    const first = experts[0]!;
    for (const id of this.placement.owners(this.layer, first)) {
      if (exclude.has(id)) continue;
      if (!experts.every((e) => this.placement.owners(this.layer, e).includes(id))) exclude.add(id);
    }
    return this.placement.choose(this.layer, first, { rotation: this.rotation, exclude });
  }

  /**
   * Re-computes a worker's part (the reference, else a replica) and compares. The worker's part
   * when it agrees or cannot be checked; the re-computation when it disagrees (and a strike).
   */
  async spotCheck(worker: string, part: Part): Promise<Part> {
    const v = this.verify!;
    const { experts } = part;
    const replica = v.reference ? undefined : this.replicaOfAll(worker, experts);
    if (!v.reference && replica === undefined) {
      v.unverifiable();
      this.metrics.spotUnverifiable++;
      return part;
    }
    let ref: Part;
    try {
      ref = await (replica === undefined
        ? this.attempt(worker, experts, "reference")
        : this.attempt(replica, experts, "transport"));
    } catch (error) {
      if (this.controller.signal.aborted) throw error;
      v.unverifiable();
      this.metrics.spotUnverifiable++;
      return part;
    }
    const n = part.tokens.length;
    const c = v.compare(part.mode, n, this.routing.k, this.embd, part.ids, part.tokens, part.y, ref.y);
    this.metrics.spotChecks++;
    if (c.reason === undefined) {
      v.agreed();
      return { ...part, verified: true };
    }
    this.metrics.spotDisagreements++;
    // its answer was refused: no credit for it
    this.owner(worker).failures++;
    v.disagreed({
      worker,
      layer: this.layer,
      experts,
      cosine: c.cosine,
      reason: `${replica === undefined ? "the reference" : `replica ${replica}`} disagrees: ${c.reason}`,
    });
    return { ...ref, verified: true };
  }

  /** One worker's experts: the request, then once on replicas, then the fallback. */
  async serve(worker: string, experts: readonly number[]): Promise<Part[]> {
    try {
      return [await this.answer(worker, experts)];
    } catch (error) {
      if (this.controller.signal.aborted) throw error;
      return this.failover(worker, experts, error);
    }
  }

  /** A worker's experts again without it: regrouped on replicas, the rest on the fallback. */
  async failover(worker: string, experts: readonly number[], error: unknown): Promise<Part[]> {
    const byReplica = new Map<string, number[]>();
    const orphans: number[] = [];
    const exclude = this.exclude(worker);
    for (const e of experts) {
      const r = this.retry
        ? this.placement.choose(this.layer, e, {
            rotation: this.rotation,
            exclude,
            chosen: new Set(byReplica.keys()),
          })
        : undefined;
      if (r === undefined) orphans.push(e);
      else {
        const list = byReplica.get(r);
        if (list) list.push(e);
        else byReplica.set(r, [e]);
      }
    }
    if (byReplica.size > 0) this.metrics.failovers++;
    const jobs: Promise<Part[]>[] = [];
    for (const [replica, list] of byReplica) {
      jobs.push(
        // a hedge of the replica's request must not go back to the worker that just failed
        this.answer(replica, list, worker).then(
          (p) => [p],
          (e: unknown) => {
            if (this.controller.signal.aborted) throw e;
            return this.fallbackFor(e, replica, list, `its replica ${replica} failed too`);
          },
        ),
      );
    }
    if (orphans.length > 0) jobs.push(this.fallbackFor(error, worker, orphans, "no replica is left"));
    return (await Promise.all(jobs)).flat();
  }

  /**
   * Every part, with those of workers quarantined while the call ran (by another part's check)
   * served again without them, unless a check vouched for that very answer.
   */
  async collect(jobs: Promise<Part[]>[]): Promise<Part[]> {
    const parts = (await Promise.all(jobs)).flat();
    if (!this.verify) return parts;
    const keep: Part[] = [];
    const again: Promise<Part[]>[] = [];
    for (const p of parts) {
      if (p.worker !== undefined && !p.verified && this.verify.isQuarantined(p.worker)) {
        const why = new DispatchError(
          "MOESWARM_DISPATCH_BAD_RESULT",
          `worker ${p.worker} was quarantined by a spot check`,
        );
        again.push(this.failover(p.worker, p.experts, why));
      } else keep.push(p);
    }
    return again.length === 0 ? parts : [...keep, ...(await Promise.all(again)).flat()];
  }
}

function sourcesFromParts<T extends Float32Array | Float64Array>(
  parts: Part[],
  n: number,
  k: number,
  embd: number,
): SlotSources<T> & { part: Int32Array } {
  const src: (T | undefined)[] = new Array(n * k);
  const off = new Float64Array(n * k);
  const part = new Int32Array(n * k).fill(-1);
  parts.forEach((p, pi) => {
    for (let r = 0; r < p.tokens.length; r++) {
      const i = p.tokens[r]!;
      for (let j = 0; j < k; j++) {
        if (p.ids[r * k + j]! < 0) continue;
        const s = i * k + j;
        src[s] = p.y as T;
        off[s] = p.mode === "each" ? (r * k + j) * embd : r * embd;
        part[s] = pi;
      }
    }
  });
  return { src, off, part };
}

/** mode "sum": per token, each part's partial once, in the order of the part's first slot. */
function combinePartials(
  out: Float32Array | Float64Array,
  n: number,
  k: number,
  embd: number,
  ids: Int32Array,
  sources: SlotSources<Float32Array | Float64Array> & { part: Int32Array },
): void {
  const seen = new Set<number>();
  for (let i = 0; i < n; i++) {
    seen.clear();
    const o = i * embd;
    let first = true;
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      if (ids[s]! < 0) continue;
      const pi = sources.part[s]!;
      if (seen.has(pi)) continue;
      seen.add(pi);
      const y = sources.src[s]!;
      const yo = sources.off[s]!;
      if (first) {
        for (let c = 0; c < embd; c++) out[o + c] = y[yo + c]!;
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[o + c]! += y[yo + c]!;
      }
    }
  }
}

/**
 * mode "auto": a token whose slots one "sum" part answered takes that part's row as it is (the
 * worker's sum is this combine's, bit for bit); every other token is combined from its "each" slots.
 */
function combineAuto(
  out: Float32Array,
  n: number,
  k: number,
  embd: number,
  ids: Int32Array,
  weights: Float32Array,
  parts: Part[],
): void {
  const sources = sourcesFromParts<Float32Array>(parts, n, k, embd);
  const sumRow = new Int32Array(n).fill(-1);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < k; j++) {
      const s = i * k + j;
      if (ids[s]! < 0) continue;
      const p = parts[sources.part[s]!]!;
      if (p.mode === "sum") {
        // a "sum" part holds every filled slot of the token: its row, once
        sumRow[i] = s;
        for (let jj = 0; jj < k; jj++) sources.src[i * k + jj] = undefined;
      }
      break;
    }
  }
  combineSlotsF32(out, n, k, embd, weights, sources);
  for (let i = 0; i < n; i++) {
    const s = sumRow[i]!;
    if (s < 0) continue;
    const p = parts[sources.part[s]!]!;
    const off = sources.off[s]!;
    out.set(p.y.subarray(off, off + embd), i * embd);
  }
}

/** llama4: add the per-slot rows of the expanded routing back into one row per token. */
function foldSlots<T extends Float32Array | Float64Array>(
  rows: T,
  ids: Int32Array,
  n: number,
  k: number,
  embd: number,
  make: (len: number) => T,
): T {
  const out = make(n * embd);
  for (let i = 0; i < n; i++) {
    let first = true;
    for (let j = 0; j < k; j++) {
      if (ids[i * k + j]! < 0) continue;
      const ro = (i * k + j) * embd;
      if (first) {
        out.set(rows.subarray(ro, ro + embd), i * embd);
        first = false;
      } else {
        for (let c = 0; c < embd; c++) out[i * embd + c]! += rows[ro + c]!;
      }
    }
  }
  return out;
}

async function run<T extends Float32Array | Float64Array>(
  precision: Precision,
  hidden: Float32Array | Float64Array,
  routing: Routing,
  options: DispatchOptions,
): Promise<DispatchResult<T>> {
  validateOptions(options);
  const signal = options.signal;
  if (signal?.aborted) throw abortReason(signal);
  const embd = checkRouting(hidden, routing, "dispatchExperts");
  const make = (len: number) => (precision === "f32" ? new Float32Array(len) : new Float64Array(len)) as T;
  if (routing.n === 0) {
    const empty = new CallState(precision, options, hidden, routing, 0).metrics;
    options.metrics?.record(empty);
    return { output: make(0), metrics: empty };
  }
  if (embd > MAX_EMBD) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `dispatchExperts: n_embd ${embd} exceeds ${MAX_EMBD}`,
    );
  }
  // a NaN in the input would come back from every worker and be blamed on them
  const bad = nonFinite(hidden, 0, hidden.length);
  if (bad >= 0) {
    throw new InvalidArgumentError("MOESWARM_NUMERIC", `dispatchExperts: hidden[${bad}] is not finite`, {
      details: { token: Math.floor(bad / embd) },
    });
  }
  const wbf = routing.weightBeforeFfn === true;
  if ((wbf ? routing.n * routing.k : routing.n) > MAX_TOKENS) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      `dispatchExperts: more than ${MAX_TOKENS} tokens in one call`,
    );
  }
  const work = wbf ? expandWeightBeforeFfn(hidden, routing, embd, precision) : { hidden, routing };
  const state = new CallState(precision, options, work.hidden, work.routing, embd);
  const t0 = performance.now();
  const { n, k, ids, weights } = work.routing;
  const layer = options.layer;

  let onAbort: (() => void) | undefined;
  try {
    // group the experts of this call by the owner chosen for each
    const unique = [...new Set(ids)].filter((id) => id >= 0).sort((a, b) => a - b);
    // a quarantined worker gets no traffic; its experts go to replicas or the fallback
    const quarantined = state.exclude();
    const groups = new Map<string, number[]>();
    const orphans: number[] = [];
    for (const id of unique) {
      const owner = options.placement.choose(layer, id, {
        rotation: state.rotation,
        chosen: new Set(groups.keys()),
        ...(quarantined ? { exclude: quarantined } : {}),
      });
      if (owner === undefined) orphans.push(id);
      else {
        const list = groups.get(owner);
        if (list) list.push(id);
        else groups.set(owner, [id]);
      }
    }
    if (orphans.length > 0 && !options.fallback) {
      throw new DispatchError(
        "MOESWARM_DISPATCH_NO_OWNER",
        `layer ${layer}: experts ${describeExperts(orphans)} have no owner${quarantined?.size ? ` (quarantined: ${[...quarantined].slice(0, 8).join(", ")}${quarantined.size > 8 ? ", ..." : ""})` : ""} and there is no fallback`,
        { details: { layer, experts: describeExperts(orphans), model: state.model } },
      );
    }
    const jobs: Promise<Part[]>[] = [...groups].map(([owner, list]) => state.serve(owner, list));
    if (orphans.length > 0) {
      const none = new DispatchError(
        "MOESWARM_DISPATCH_NO_OWNER",
        `experts ${describeExperts(orphans)} have no owner`,
      );
      jobs.push(state.fallbackFor(none, "(none)", orphans, "no owner is registered"));
    }
    const all = state.collect(jobs);
    const aborted = new Promise<never>((_, reject) => {
      if (!signal) return;
      onAbort = () => reject(abortReason(signal));
      signal.addEventListener("abort", onAbort, { once: true });
    });
    const parts = await Promise.race([all, aborted]);

    const output = make(n * embd);
    if (state.mode === "auto") {
      combineAuto(output as Float32Array, n, k, embd, ids, weights, parts);
    } else if (state.mode === "each") {
      const sources = sourcesFromParts<T>(parts, n, k, embd);
      if (precision === "f32") {
        combineSlotsF32(
          output as Float32Array,
          n,
          k,
          embd,
          weights,
          sources as unknown as SlotSources<Float32Array>,
        );
      } else {
        combineSlotsF64(output as Float64Array, n, k, embd, weights, sources);
      }
    } else {
      combinePartials(output, n, k, embd, ids, sourcesFromParts<T>(parts, n, k, embd));
    }
    const final = wbf ? foldSlots(output, routing.ids, routing.n, routing.k, embd, make) : output;
    state.metrics.wallMs = performance.now() - t0;
    options.metrics?.record(state.metrics);
    return { output: final, metrics: state.metrics };
  } catch (error) {
    state.controller.abort(error instanceof Error ? error : new AbortError("MOESWARM_ABORTED"));
    state.metrics.wallMs = performance.now() - t0;
    state.metrics.error = isMoeswarmError(error)
      ? error.code
      : error instanceof Error
        ? error.name
        : "unknown";
    options.metrics?.record(state.metrics);
    throw error;
  } finally {
    if (onAbort) signal?.removeEventListener("abort", onAbort);
  }
}

/**
 * Sends the routed (token, expert) pairs of one layer to the workers that own the experts (one
 * request per worker, all tokens of the batch in it, sent concurrently) and combines
 * `sum_j w_j * y_j` in the router's k order in f32 exactly as llama.cpp does, so the result does
 * not depend on placement or arrival order (mode "each"). A request that times out, fails or
 * returns a bad result is retried once on replicas, then served by `fallback`, else the call
 * rejects with a DispatchError naming the layer, experts and worker.
 */
export async function dispatchExperts(
  hidden: Float32Array,
  routing: Routing,
  options: DispatchOptions,
): Promise<Float32Array> {
  return (await dispatchExpertsDetailed(hidden, routing, options)).output;
}

/** {@link dispatchExperts} with the call's metrics. */
export async function dispatchExpertsDetailed(
  hidden: Float32Array,
  routing: Routing,
  options: DispatchOptions,
): Promise<DispatchResult<Float32Array>> {
  if (!(hidden instanceof Float32Array)) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExperts: hidden must be a Float32Array",
    );
  }
  return run<Float32Array>("f32", hidden, routing, options);
}

/**
 * The f64 path (equivalence 1 of ARCHITECTURE.md): requests carry f64 activations (`dtype`
 * "f64", in-process transports only), workers may answer Float64Array, and the combine is in
 * f64 in the same order. With f64 workers this equals {@link referenceMoe} up to rounding of the
 * f64 sums.
 */
export async function dispatchExpertsF64(
  hidden: Float32Array | Float64Array,
  routing: Routing,
  options: DispatchOptions,
): Promise<Float64Array> {
  if (!(hidden instanceof Float32Array) && !(hidden instanceof Float64Array)) {
    throw new InvalidArgumentError(
      "MOESWARM_INVALID_ARGUMENT",
      "dispatchExpertsF64: hidden must be a typed float array",
    );
  }
  return (await run<Float64Array>("f64", hidden, routing, options)).output;
}

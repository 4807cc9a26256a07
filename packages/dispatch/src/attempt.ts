import type { ExpertRequest, ExpertResult } from "@moeswarm/core";
import { DispatchError, isMoeswarmError, onAbort } from "@moeswarm/core";
import { acceptResult } from "./accept.js";
import { buildRequest } from "./build-request.js";
import type { CallState } from "./call-state.js";
import { FALLBACK_OWNER, type OwnerCallMetrics, REFERENCE_OWNER } from "./metrics.js";
import { type Answer, type Ask, describeExperts, type Part } from "./part.js";

// The innermost step of the pipeline: one request to one worker (or the fallback, or a spot
// check's reference), made of smaller steps: the exchange itself, its deadline, the acceptance of
// the result, and the metering of all three.

/**
 * Who answers: a worker through the transport, or one of the call's local handlers. The local
 * third opinion of trust "verify" answers for three reasons, metered apart: "third" decides a
 * disagreement (counted in `thirdOpinions` by its caller), "audit" re-computes an agreed answer
 * (`audits`), "local" serves a part no second owner can check (`fallbacks`, as the fallback).
 */
export type Via = "transport" | "fallback" | "reference" | "third" | "audit" | "local";

/** Whether `via` is the local third opinion of trust "verify". */
const isThird = (via: Via) => via === "third" || via === "audit" || via === "local";

type Outcome = { readonly result: ExpertResult } | { readonly error: unknown; readonly cancelled: boolean };

/**
 * One request per ask, with the deadline; settles once. A reply that arrives after the deadline,
 * after `ask.cancel` or after the call ended is dropped.
 */
export function attempt(call: CallState, via: Via): Answer {
  return (ask) => attemptOnce(call, via, ask);
}

function attemptOnce(call: CallState, via: Via, ask: Ask): Promise<Part> {
  const { worker, experts } = ask;
  const { request, tokens, slots } = buildRequest(call, new Set(experts));
  // a transport may transfer (detach) the request's buffers: keep the slot ids for the combine
  const ids = request.ids.slice();
  const third = isThird(via) ? call.thirdOpinion : undefined;
  const key =
    via === "fallback" ? FALLBACK_OWNER : via === "reference" ? REFERENCE_OWNER : (third?.key ?? worker);
  const who =
    via === "fallback" || third?.key === FALLBACK_OWNER
      ? "the fallback"
      : via === "reference" || third
        ? "the reference"
        : `worker ${worker}`;
  const meter = startMeter(call, key, via, request, slots);
  const controller = new AbortController();
  const remote = via === "transport";
  if (remote) {
    call.placement.acquire(worker);
    call.liveness?.sent(worker);
  }
  // a worker's own deadline, from its round times (liveness), never past the call's
  const deadlineMs =
    remote && call.liveness ? call.liveness.deadline(worker, call.deadlineMs, slots) : call.deadlineMs;
  const timeout = () =>
    new DispatchError(
      "MOESWARM_WORKER_TIMEOUT",
      `layer ${call.layer}: ${who} did not answer experts ${describeExperts(experts)} within ${deadlineMs} ms`,
      {
        details: { layer: call.layer, worker: key, experts: describeExperts(experts), deadlineMs },
      },
    );
  const t0 = performance.now();
  return new Promise<Part>((resolve, reject) => {
    const settle = (outcome: Outcome) => {
      if (remote) call.placement.release(worker);
      meter.settled();
      if ("error" in outcome) {
        controller.abort(outcome.error);
        // the loser of a hedge did nothing wrong
        if (!outcome.cancelled) meter.failed();
        if (remote && !outcome.cancelled && isMoeswarmError(outcome.error, "MOESWARM_WORKER_TIMEOUT")) {
          call.liveness?.timedOut(worker);
          call.metrics.timeouts++;
        } else if (remote) call.liveness?.failed(worker);
        reject(outcome.error);
        return;
      }
      if (remote) call.liveness?.answered(worker, performance.now() - t0, slots);
      const r = acceptResult(call.precision, request, ids, outcome.result);
      if (typeof r === "string") {
        meter.failed();
        const details = { layer: call.layer, worker: key, experts: describeExperts(experts), reason: r };
        const msg = `layer ${call.layer}: ${who} answered experts ${details.experts} with a bad result: ${r}`;
        reject(new DispatchError("MOESWARM_DISPATCH_BAD_RESULT", msg, { details }));
        return;
      }
      // what travelled: a compact answer's rows, not the layout they were expanded to
      meter.answered(outcome.result.y.byteLength, r.ms);
      const from = remote ? worker : undefined;
      const bytes = meter.bytesOut + outcome.result.y.byteLength;
      resolve({
        tokens,
        ids,
        y: r.y,
        mode: request.mode,
        experts,
        worker: from,
        verified: false,
        bytes,
        computeMs: r.ms,
      });
    };
    const exchange = () => send(call, via, worker, request, controller.signal);
    firstOutcome(call, ask.cancel, { ms: deadlineMs, error: timeout }, exchange, settle);
  });
}

/** The exchange step: the transport's or the local handler's answer, always as a promise. */
function send(
  call: CallState,
  via: Via,
  worker: string,
  request: ExpertRequest,
  signal: AbortSignal,
): Promise<ExpertResult> {
  try {
    const local =
      via === "fallback"
        ? call.fallback
        : via === "reference"
          ? call.verify?.reference
          : isThird(via)
            ? call.thirdOpinion?.handler
            : undefined;
    const pending = local
      ? Promise.resolve(local(request, { signal }))
      : call.transport.request(worker, request, { signal, deadlineMs: call.deadlineMs });
    if (!pending || typeof pending.then !== "function")
      throw new TypeError("transport.request did not return a promise");
    return pending;
  } catch (error) {
    return Promise.reject(error);
  }
}

/**
 * The deadline step: settles once with the first of the exchange's answer, the deadline, the
 * call's early end and `cancel`; whatever comes later is dropped and nothing stays registered.
 * An ended call or a cancelled ask sends nothing.
 */
function firstOutcome(
  call: CallState,
  cancel: AbortSignal | undefined,
  deadline: { readonly ms: number; readonly error: () => Error },
  exchange: () => Promise<ExpertResult>,
  settle: (outcome: Outcome) => void,
): void {
  if (call.signal.aborted) {
    settle({ error: call.signal.reason, cancelled: false });
    return;
  }
  if (cancel?.aborted) {
    settle({ error: cancel.reason, cancelled: true });
    return;
  }
  let done = false;
  const finish = (outcome: Outcome) => {
    if (done) return;
    done = true;
    clearTimeout(timer);
    cancelled[Symbol.dispose]();
    ended[Symbol.dispose]();
    settle(outcome);
  };
  const timer = setTimeout(() => finish({ error: deadline.error(), cancelled: false }), deadline.ms);
  const cancelled = onAbort(cancel, (reason) => finish({ error: reason, cancelled: true }));
  const ended = call.onEnd((reason) => finish({ error: reason, cancelled: false }));
  exchange().then(
    (result) => finish({ result }),
    (error: unknown) =>
      finish({ error: error ?? new Error("request rejected without a reason"), cancelled: false }),
  );
}

/** The metering step: counts a request when it is sent, then how it settled. */
function startMeter(call: CallState, key: string, via: Via, request: ExpertRequest, slots: number) {
  const om: OwnerCallMetrics = call.owner(key);
  const m = call.metrics;
  om.requests++;
  om.tokens += request.n;
  om.slots += slots;
  const out = request.x.byteLength + request.ids.byteLength + (request.w?.byteLength ?? 0);
  om.bytesOut += out;
  m.bytesOut += out;
  m.requests++;
  if (request.mode === "sum") m.sumRequests++;
  if (via === "fallback" || via === "local") m.fallbacks++;
  else if (via === "audit") m.audits++;
  const t0 = performance.now();
  return {
    bytesOut: out,
    settled(): void {
      const ms = performance.now() - t0;
      om.latencyMs += ms;
      om.latencyMsMax = Math.max(om.latencyMsMax, ms);
    },
    failed(): void {
      om.failures++;
    },
    answered(wireBytes: number, computeMs: number | undefined): void {
      om.bytesIn += wireBytes;
      m.bytesIn += wireBytes;
      if (typeof computeMs === "number" && Number.isFinite(computeMs)) om.computeMs += computeMs;
    },
  };
}

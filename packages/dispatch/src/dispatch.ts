import {
  AbortError,
  abortable,
  DispatchError,
  InvalidArgumentError,
  isMoeswarmError,
  throwIfAborted,
} from "@moeswarm/core";
import { nonFinite } from "./accept.js";
import { attempt } from "./attempt.js";
import { CallState, type Precision } from "./call-state.js";
import { combineParts, expandWeightBeforeFfn, foldSlots } from "./combine-parts.js";
import {
  type DispatchOptions,
  type DispatchResult,
  MAX_EMBD,
  MAX_TOKENS,
  validateOptions,
} from "./dispatch-options.js";
import { collect, fallbackFor, withFailover } from "./failover.js";
import { withHedge } from "./hedge.js";
import { checkRouting } from "./oracle.js";
import { compose, describeExperts, type Part } from "./part.js";
import type { Routing } from "./route.js";
import { withSpotCheck } from "./spot-check-step.js";
import { withRedundancy } from "./verify-step.js";

export type { DispatchOptions, DispatchResult } from "./dispatch-options.js";

/** Rejects what no worker should be blamed for: too wide, non-finite, too many tokens. */
function checkInput(hidden: Float32Array | Float64Array, routing: Routing, embd: number): void {
  if (embd > MAX_EMBD) {
    throw new InvalidArgumentError(`dispatchExperts: n_embd ${embd} exceeds ${MAX_EMBD}`);
  }
  // a NaN in the input would come back from every worker and be blamed on them
  const bad = nonFinite(hidden, 0, hidden.length);
  if (bad >= 0) {
    throw new InvalidArgumentError("MOESWARM_NUMERIC", `dispatchExperts: hidden[${bad}] is not finite`, {
      details: { token: Math.floor(bad / embd) },
    });
  }
  const rows = routing.weightBeforeFfn === true ? routing.n * routing.k : routing.n;
  if (rows > MAX_TOKENS) {
    throw new InvalidArgumentError(`dispatchExperts: more than ${MAX_TOKENS} tokens in one call`);
  }
}

/** One request's worth of experts: the owner chosen for them (and, trust "verify", the second). */
interface Group {
  readonly worker: string;
  readonly second: string | undefined;
  readonly experts: number[];
}

/**
 * The call's experts grouped by the owner chosen for each (under trust "verify", by the pair of
 * owners chosen for each); those with none are orphans.
 */
function groupByOwner(call: CallState): { groups: Group[]; orphans: number[] } {
  const unique = [...new Set(call.routing.ids)].filter((id) => id >= 0).sort((a, b) => a - b);
  // a quarantined worker (or one whose circuit is open) gets no traffic; its experts go to
  // replicas or the fallback
  const quarantined = call.exclude();
  const groups = new Map<string, Group>();
  const primaries = new Set<string>();
  const seconds = new Map<string, Set<string>>();
  const orphans: number[] = [];
  for (const id of unique) {
    const owner = call.placement.choose(call.layer, id, {
      rotation: call.rotation,
      chosen: primaries,
      ...(quarantined ? { exclude: quarantined } : {}),
    });
    if (owner === undefined) {
      orphans.push(id);
      continue;
    }
    primaries.add(owner);
    let second: string | undefined;
    if (call.verification) {
      const taken = seconds.get(owner) ?? new Set<string>();
      seconds.set(owner, taken);
      // the twin must be another principal's: two ids of one owner are one opinion
      second = call.placement.choose(call.layer, id, {
        rotation: call.rotation,
        chosen: taken,
        exclude: new Set([...(quarantined ?? []), ...call.placement.samePrincipal(owner), owner]),
      });
      if (second !== undefined) taken.add(second);
    }
    const key = `${owner}\u0000${second ?? ""}`;
    const group = groups.get(key);
    if (group) group.experts.push(id);
    else groups.set(key, { worker: owner, second, experts: [id] });
  }
  if (orphans.length > 0 && !call.fallback) {
    const also = quarantined?.size
      ? ` (quarantined: ${[...quarantined].slice(0, 8).join(", ")}${quarantined.size > 8 ? ", ..." : ""})`
      : "";
    throw new DispatchError(
      "MOESWARM_DISPATCH_NO_OWNER",
      `layer ${call.layer}: experts ${describeExperts(orphans)} have no owner${also} and there is no fallback`,
      { details: { layer: call.layer, experts: describeExperts(orphans), model: call.model } },
    );
  }
  return { groups: [...groups.values()], orphans };
}

/**
 * Every group served through the pipeline: attempt <- hedge <- redundancy (trust "verify") <-
 * spot check, inside failover and the fallback; the orphans straight to the fallback.
 */
function serveAll(call: CallState, groups: Group[], orphans: number[]): Promise<Part[]> {
  const answer = compose(
    attempt(call, "transport"),
    call.hedgeMs === undefined ? undefined : withHedge(call, call.hedgeMs),
    call.verification && withRedundancy(call, call.verification),
    call.verify && withSpotCheck(call, call.verify),
  );
  const serve = withFailover(call, answer);
  const jobs = groups.map((g) => serve(g.worker, g.experts, g.second));
  if (orphans.length > 0) {
    const none = new DispatchError(
      "MOESWARM_DISPATCH_NO_OWNER",
      `experts ${describeExperts(orphans)} have no owner`,
    );
    jobs.push(fallbackFor(call, none, "(none)", orphans, "no owner is registered"));
  }
  return collect(call, answer, jobs);
}

async function run<T extends Float32Array | Float64Array>(
  precision: Precision,
  hidden: Float32Array | Float64Array,
  routing: Routing,
  options: DispatchOptions,
): Promise<DispatchResult<T>> {
  validateOptions(options);
  throwIfAborted(options.signal);
  const embd = checkRouting(hidden, routing, "dispatchExperts");
  const make = (len: number) => (precision === "f32" ? new Float32Array(len) : new Float64Array(len)) as T;
  if (routing.n === 0) {
    const empty = new CallState(precision, options, hidden, routing, 0).metrics;
    options.metrics?.record(empty);
    return { output: make(0), metrics: empty };
  }
  checkInput(hidden, routing, embd);
  const wbf = routing.weightBeforeFfn === true;
  const work = wbf ? expandWeightBeforeFfn(hidden, routing, embd, precision) : { hidden, routing };
  const call = new CallState(precision, options, work.hidden, work.routing, embd);
  const t0 = performance.now();
  try {
    const { groups, orphans } = groupByOwner(call);
    const parts = await abortable(serveAll(call, groups, orphans), options.signal);
    const output = make(work.routing.n * embd);
    combineParts(output, call.mode, precision, work.routing, embd, parts);
    const final = wbf ? foldSlots(output, routing.ids, routing.n, routing.k, embd, make) : output;
    call.metrics.wallMs = performance.now() - t0;
    options.metrics?.record(call.metrics);
    return { output: final, metrics: call.metrics };
  } catch (error) {
    call.end(error instanceof Error ? error : new AbortError("MOESWARM_ABORTED"));
    call.metrics.wallMs = performance.now() - t0;
    call.metrics.error = isMoeswarmError(error)
      ? error.code
      : error instanceof Error
        ? error.name
        : "unknown";
    options.metrics?.record(call.metrics);
    throw error;
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
    throw new InvalidArgumentError("dispatchExperts: hidden must be a Float32Array");
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
    throw new InvalidArgumentError("dispatchExpertsF64: hidden must be a typed float array");
  }
  return (await run<Float64Array>("f64", hidden, routing, options)).output;
}

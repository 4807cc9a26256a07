import { DispatchError, isMoeswarmError } from "@moeswarm/core";
import { attempt } from "./attempt.js";
import type { CallState } from "./call-state.js";
import { type Answer, describeExperts, type Part } from "./part.js";

// The outer steps: a worker's experts are asked once (through the hedge and spot-check steps);
// after a failure they are regrouped on replicas (once), and what no replica can serve goes to the
// fallback, else the call fails with a DispatchError naming the layer, experts and worker.

/** Serves a worker's experts as parts, failing over as needed. */
export type Serve = (worker: string, experts: readonly number[], second?: string) => Promise<Part[]>;

/** The serve step around `answer`: the ask, then once on replicas, then the fallback. */
export function withFailover(call: CallState, answer: Answer): Serve {
  return async (worker, experts, second) => {
    try {
      return [await answer({ worker, experts, ...(second !== undefined ? { second } : {}) })];
    } catch (error) {
      // a disagreement no third opinion could decide is not the worker's failure to retry around
      if (call.signal.aborted || isMoeswarmError(error, "MOESWARM_VERIFY_FAILED")) throw error;
      return failover(call, answer, worker, experts, error);
    }
  };
}

/** A worker's experts again without it: regrouped on replicas, the rest on the fallback. */
export async function failover(
  call: CallState,
  answer: Answer,
  worker: string,
  experts: readonly number[],
  error: unknown,
): Promise<Part[]> {
  const byReplica = new Map<string, number[]>();
  const orphans: number[] = [];
  const exclude = call.exclude(worker);
  for (const e of experts) {
    const r = call.retry
      ? call.placement.choose(call.layer, e, {
          rotation: call.rotation,
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
  if (byReplica.size > 0) call.metrics.failovers++;
  const jobs: Promise<Part[]>[] = [];
  for (const [replica, list] of byReplica) {
    jobs.push(
      // a hedge of the replica's request must not go back to the worker that just failed
      answer({ worker: replica, experts: list, avoid: worker }).then(
        (p) => [p],
        (e: unknown) => {
          if (call.signal.aborted) throw e;
          return fallbackFor(call, e, replica, list, `its replica ${replica} failed too`);
        },
      ),
    );
  }
  if (orphans.length > 0) jobs.push(fallbackFor(call, error, worker, orphans, "no replica is left"));
  return (await Promise.all(jobs)).flat();
}

/** The fallback step: the local fallback for experts nobody else serves, or the typed error. */
export async function fallbackFor(
  call: CallState,
  error: unknown,
  worker: string,
  experts: readonly number[],
  tried: string,
): Promise<Part[]> {
  if (!call.fallback) throw failure(call, error, worker, experts, `${tried} and there is no fallback`);
  try {
    return [await attempt(call, "fallback")({ worker, experts })];
  } catch (fallbackError) {
    if (call.signal.aborted) throw fallbackError;
    throw failure(call, fallbackError, worker, experts, `${tried} and the fallback failed too`);
  }
}

/** The final error when nobody could serve these experts. */
function failure(
  call: CallState,
  error: unknown,
  worker: string,
  experts: readonly number[],
  tried: string,
): DispatchError {
  const code =
    isMoeswarmError(error, "MOESWARM_WORKER_TIMEOUT") ||
    isMoeswarmError(error, "MOESWARM_DISPATCH_BAD_RESULT") ||
    isMoeswarmError(error, "MOESWARM_VERIFY_UNAVAILABLE") ||
    isMoeswarmError(error, "MOESWARM_VERIFY_FAILED")
      ? (error as DispatchError).code
      : "MOESWARM_DISPATCH_FAILED";
  const reason = error instanceof Error ? error.message : String(error);
  return new DispatchError(
    code,
    `layer ${call.layer}: experts ${describeExperts(experts)} failed on worker ${worker} and ${tried}: ${reason}`,
    {
      cause: error,
      details: { layer: call.layer, worker, experts: describeExperts(experts), model: call.model },
    },
  );
}

/**
 * Every part, with those of workers quarantined while the call ran (by another part's check)
 * served again without them, unless a check vouched for that very answer.
 */
export async function collect(call: CallState, answer: Answer, jobs: Promise<Part[]>[]): Promise<Part[]> {
  const parts = (await Promise.all(jobs)).flat();
  if (!call.verify) return parts;
  const keep: Part[] = [];
  const again: Promise<Part[]>[] = [];
  for (const p of parts) {
    if (p.worker !== undefined && !p.verified && call.verify.isQuarantined(p.worker)) {
      const why = new DispatchError(
        "MOESWARM_DISPATCH_BAD_RESULT",
        `worker ${p.worker} was quarantined by a spot check`,
      );
      again.push(failover(call, answer, p.worker, p.experts, why));
    } else keep.push(p);
  }
  return again.length === 0 ? parts : [...keep, ...(await Promise.all(again)).flat()];
}

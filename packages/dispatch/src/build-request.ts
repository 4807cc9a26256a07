import type { ExpertRequest } from "@moeswarm/core";
import type { CallState } from "./call-state.js";

/** A worker's request and where its rows come from. */
export interface BuiltRequest {
  readonly request: ExpertRequest;
  /** The call's token index of each request row. */
  readonly tokens: Int32Array;
  /** Filled slots the request asks for. */
  readonly slots: number;
}

/** The request for the given experts: every token with a slot among them, other slots -1. */
export function buildRequest(call: CallState, experts: ReadonlySet<number>): BuiltRequest {
  const { n, k, ids, weights } = call.routing;
  const embd = call.embd;
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
  const mode = requestMode(call, experts, tokenList);
  const x = call.precision === "f32" ? new Float32Array(m * embd) : new Float64Array(m * embd);
  const rid = new Int32Array(m * k);
  const w = mode === "sum" ? new Float32Array(m * k) : undefined;
  for (let r = 0; r < m; r++) {
    const i = tokens[r]!;
    x.set(call.hidden.subarray(i * embd, (i + 1) * embd), r * embd);
    for (let j = 0; j < k; j++) {
      const id = ids[i * k + j]!;
      const mine = experts.has(id);
      rid[r * k + j] = mine ? id : -1;
      if (w && mine) w[r * k + j] = weights[i * k + j]!;
    }
  }
  const request: ExpertRequest = {
    model: call.model,
    layer: call.layer,
    n: m,
    embd,
    dtype: call.precision,
    x,
    k,
    ids: rid,
    ...(w ? { w } : {}),
    mode,
    deadline: Math.ceil(call.deadlineMs),
    // only the owned slots' rows need to come back (f32 only: the wire has no f64)
    ...(mode === "each" && call.precision === "f32" ? { compact: true } : {}),
  };
  return { request, tokens, slots };
}

/** The call's mode, with "auto" decided: "sum" only when no token sent has a slot owned elsewhere. */
function requestMode(
  call: CallState,
  experts: ReadonlySet<number>,
  tokens: readonly number[],
): "each" | "sum" {
  if (call.mode !== "auto") return call.mode;
  const { k, ids } = call.routing;
  for (const i of tokens) {
    for (let j = 0; j < k; j++) {
      const id = ids[i * k + j]!;
      if (id >= 0 && !experts.has(id)) return "each";
    }
  }
  return "sum";
}

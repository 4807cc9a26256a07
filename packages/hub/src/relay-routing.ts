// Routing in the relay: a backbone's dispatch forwarded to the worker it names (with the limits
// and back-pressure checks that refuse it), and the worker's answer, or a timeout, sent back.
// Dispatches and results are forwarded as the bytes that came, with only their routing fields
// (`id`, `to`, `from`) rewritten: the relay validated them (decodeFrame `raw`) but never decodes or
// re-encodes their activations and outputs. A frame whose sender left room (relay-client does) is
// rewritten in its own memory, only its first bytes, and nothing of it is copied; any other is
// written into memory reused frame after frame (FrameRerouter) unless the socket kept the last ones.
import {
  type DispatchFrame,
  type ErrorFrame,
  encodeFrame,
  type FrameRerouter,
  isMoeswarmError,
  PROTOCOL_VERSION,
  type ResultFrame,
  traceHop,
} from "@moeswarm/core";
import { CLOSE_SLOW_CONSUMER } from "@moeswarm/relay-client";
import type { RouteDeadlines } from "./relay-deadlines.js";
import type { Peer, RelaySettings, Route } from "./relay-peer.js";
import type { RelayServerEvent, RelayStats } from "./relay-types.js";

// Answers a relay gives for a dispatch it cannot route.
export type RouteErrorCode =
  | "MOESWARM_TRANSPORT_UNKNOWN_PEER"
  | "MOESWARM_TRANSPORT_DRAINING"
  | "MOESWARM_TRANSPORT_LIMIT"
  | "MOESWARM_TRANSPORT_BACKPRESSURE"
  | "MOESWARM_TRANSPORT_CLOSED"
  | "MOESWARM_TRANSPORT_TIMEOUT"
  | "MOESWARM_PROTOCOL_FRAME_TOO_LARGE";

/** What routing needs of the relay server: its settings, counters, peers and plumbing. */
export interface RelayLink {
  readonly s: RelaySettings;
  readonly stats: RelayStats;
  readonly workers: ReadonlyMap<string, Peer>;
  guard(fn: () => void): void;
  emit(event: RelayServerEvent): void;
  sendBytes(peer: Peer, bytes: Uint8Array): boolean;
  /**
   * Reroutes forwarded frames in their own memory or into reused memory: each is released in a
   * `finally`, kept when the peer's socket may still hold the bytes (ws writes a server's frames
   * without copying).
   */
  readonly rerouter: FrameRerouter;
  /** When routes are forgotten: each is added when forwarded and deleted when finished. */
  readonly deadlines: RouteDeadlines;
  error(peer: Peer, code: string, msg: string, id?: number, from?: string): void;
  violation(peer: Peer, code: string, msg: string, id?: number): void;
  drop(peer: Peer, code: number, reason: string, destroy: boolean): void;
}

/**
 * Forwards a backbone's dispatch to the worker it names, or refuses it with an error frame.
 * `raw`: the frame's bytes as received (decoded with `raw: true` into `frame`).
 */
export function routeDispatch(link: RelayLink, backbone: Peer, frame: DispatchFrame, raw: Uint8Array): void {
  const refuse = (code: RouteErrorCode, msg: string) => {
    link.stats.refused++;
    link.error(backbone, code, msg, frame.id, frame.to);
  };
  if (backbone.role !== "backbone") {
    link.violation(backbone, "MOESWARM_AUTH_ROLE", "a worker cannot send dispatch", frame.id);
    return;
  }
  if (frame.to === undefined) {
    link.violation(backbone, "MOESWARM_PROTOCOL_MISSING_FIELD", "dispatch.to names no worker", frame.id);
    return;
  }
  if (backbone.outstanding.size >= link.s.maxInFlight) {
    refuse(
      "MOESWARM_TRANSPORT_LIMIT",
      `${backbone.outstanding.size} requests in flight (limit ${link.s.maxInFlight})`,
    );
    return;
  }
  const worker = link.workers.get(frame.to);
  if (!worker || worker.closed) {
    refuse("MOESWARM_TRANSPORT_UNKNOWN_PEER", `no live worker ${JSON.stringify(frame.to)}`);
    return;
  }
  if (worker.draining) {
    refuse("MOESWARM_TRANSPORT_DRAINING", `worker ${frame.to} is draining`);
    return;
  }
  if (!worker.servesModel(frame.model)) {
    refuse("MOESWARM_TRANSPORT_UNKNOWN_PEER", `worker ${frame.to} has registered no slice of ${frame.model}`);
    return;
  }
  if (worker.routes.size >= link.s.maxInFlight) {
    refuse("MOESWARM_TRANSPORT_LIMIT", `worker ${frame.to} holds ${worker.routes.size} requests`);
    return;
  }
  let relayId = worker.nextRouteId;
  while (worker.routes.has(relayId)) relayId = (relayId + 1) >>> 0;
  worker.nextRouteId = (relayId + 1) >>> 0;
  let bytes: Uint8Array;
  try {
    bytes = link.rerouter.rerouteReceived(
      raw,
      { id: relayId, from: backbone.id, to: frame.to },
      link.s.maxFrameBytes,
    );
    if (bytes.buffer !== raw.buffer) link.stats.copied++;
  } catch (error) {
    // e.g. the added `from` pushed a frame at the limit over it
    const e = isMoeswarmError(error) ? error : undefined;
    link.stats.refused++;
    link.error(backbone, e?.code ?? "MOESWARM_PROTOCOL_MALFORMED", e?.message ?? "cannot forward", frame.id);
    return;
  }
  let kept = false;
  try {
    if (bytes.byteLength > worker.maxFrame) {
      // the worker would drop its link on it; refusing keeps the worker and fails only this request
      refuse(
        "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
        `dispatch of ${bytes.byteLength} bytes exceeds worker ${frame.to}'s limit of ${worker.maxFrame}`,
      );
      return;
    }
    if (worker.ws.bufferedAmount + bytes.byteLength > link.s.maxQueueBytes) {
      refuse("MOESWARM_TRANSPORT_BACKPRESSURE", `the send queue to worker ${frame.to} is full`);
      return;
    }
    const started = performance.now();
    const route: Route = {
      relayId,
      origId: frame.id,
      backbone,
      worker,
      started,
      // the backbone gives up at its deadline; the relay forgets the route a little later
      due: started + (frame.deadline ?? link.s.requestTimeoutMs) + 1000,
    };
    link.deadlines.add(route);
    worker.routes.set(relayId, route);
    backbone.outstanding.add(route);
    link.stats.routed++;
    if (link.s.onForward) {
      const forward = {
        backbone: backbone.id as string,
        worker: frame.to,
        model: frame.model,
        layer: frame.layer,
        n: frame.n,
        k: frame.k,
        ids: frame.ids,
      };
      link.guard(() => link.s.onForward?.(forward));
    }
    link.sendBytes(worker, bytes);
    kept = worker.ws.bufferedAmount > 0;
  } finally {
    link.rerouter.release(kept);
  }
  traceHop("hub.out.dispatch", relayId);
}

export function finishRoute(link: RelayLink, route: Route): void {
  link.deadlines.delete(route);
  route.worker.routes.delete(route.relayId);
  route.backbone.outstanding.delete(route);
}

/** A route's deadline passed (RouteDeadlines): the backbone is told, the worker's answer will be dropped. */
export function expireRoute(link: RelayLink, route: Route): void {
  if (route.worker.routes.get(route.relayId) !== route) return;
  finishRoute(link, route);
  answerBackbone(link, route, {
    t: "error",
    v: PROTOCOL_VERSION,
    id: route.origId,
    code: "MOESWARM_TRANSPORT_TIMEOUT",
    msg: `worker ${route.worker.id} did not answer in time`,
  });
}

/** A worker's result or error (`raw`: its bytes as received), sent back to the backbone it answers. */
export function routeAnswer(
  link: RelayLink,
  worker: Peer,
  frame: ResultFrame | ErrorFrame,
  raw: Uint8Array,
): void {
  if (frame.id === undefined) return; // a worker's connection-level notice; nothing to route
  const route = worker.routes.get(frame.id);
  if (!route) return; // late: the route expired or its backbone's connection is gone
  finishRoute(link, route);
  // (answerBackbone writes the backbone's own id over the frame's)
  answerBackbone(link, route, frame, frame.t === "result" ? raw : undefined);
}

/**
 * Sends an answer to the backbone of `route`. `raw`: a worker's result as received, forwarded
 * with its routing fields rewritten; without it the frame is encoded (errors, timeouts).
 */
export function answerBackbone(
  link: RelayLink,
  route: Route,
  frame: ResultFrame | ErrorFrame,
  raw?: Uint8Array,
): void {
  const backbone = route.backbone;
  // (the event is built only for a hook that reads it: this runs once per forwarded answer)
  if (link.s.onEvent) {
    link.emit({
      type: "routed",
      from: backbone.id as string,
      to: route.worker.id as string,
      outcome: frame.t === "result" ? "result" : frame.code,
      ms: performance.now() - route.started,
    });
  }
  if (backbone.closed) return;
  let bytes: Uint8Array;
  try {
    const routing = { id: route.origId, from: route.worker.id, to: backbone.id };
    bytes =
      raw === undefined
        ? encodeFrame({ ...frame, ...routing }, { maxFrameBytes: link.s.maxFrameBytes })
        : link.rerouter.rerouteReceived(raw, routing, link.s.maxFrameBytes);
    if (raw !== undefined && bytes.buffer !== raw.buffer) link.stats.copied++;
  } catch (error) {
    const e = isMoeswarmError(error) ? error : undefined;
    link.error(
      backbone,
      e?.code ?? "MOESWARM_PROTOCOL_MALFORMED",
      e?.message ?? "the answer could not be re-encoded",
      route.origId,
      route.worker.id,
    );
    return;
  }
  // (encoded bytes are the frame's own: releasing the rerouter then is a no-op)
  const lent = raw !== undefined;
  let kept = false;
  try {
    if (backbone.ws.bufferedAmount + bytes.byteLength > link.s.maxQueueBytes) {
      // the backbone does not read its answers: cut it off rather than buffer without bound
      link.drop(
        backbone,
        CLOSE_SLOW_CONSUMER,
        "MOESWARM_TRANSPORT_BACKPRESSURE: answers are not being read",
        true,
      );
      return;
    }
    link.sendBytes(backbone, bytes);
    kept = backbone.ws.bufferedAmount > 0;
  } finally {
    if (lent) link.rerouter.release(kept);
  }
  traceHop("hub.out.answer", route.relayId);
}

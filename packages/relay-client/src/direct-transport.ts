import {
  type ExpertCallOptions,
  type ExpertRequest,
  type ExpertResult,
  type ExpertTransport,
  InvalidArgumentError,
  isMoeswarmError,
} from "@moeswarm/core";
import { type Backoff, backoffDelay, normalizeBackoff, type ReconnectOptions } from "./backoff.js";
import { connectRelay } from "./connection.js";
import type { RelayConnection } from "./connection-types.js";
import { dialWebSocket, type FrameDialer } from "./link.js";
import { RelayTransport, type RelayTransportOptions } from "./transport.js";

/*
 * Direct links, composed as a transport: a request goes straight to its worker over a link this
 * backbone dialed (the worker's advertised endpoint, its certificate pinned by the fingerprint the
 * hub published, the hello carrying a ticket the hub signed), and over the relay (`fallback`)
 * whenever there is no such link: none advertised, not dialed yet, backing off after a failed
 * dial, or dead. A link is one more `connectRelay` connection over a pinned dialer, so its
 * framing, heartbeats, deadlines and back-pressure are the relay connection's own. Results are
 * the same bytes either way; a request in flight on a link that dies is sent again over the relay.
 */

/** Where a worker can be reached directly (from the hub's placement). */
export interface DirectRoute {
  /** `wss://` URLs, tried in order. */
  readonly endpoints: readonly string[];
  /** SHA-256 fingerprint of the worker's certificate (AA:BB:...), pinned. */
  readonly fingerprint: string;
}

export type DirectLinkEvent =
  | { type: "linked"; worker: string; url: string }
  | { type: "dial-failed"; worker: string; error: Error; retryInMs: number }
  | { type: "lost"; worker: string; error?: Error; retryInMs: number };

export interface DirectTransportOptions extends RelayTransportOptions {
  /** The transport used when there is no direct link (the backbone's RelayTransport). */
  fallback: ExpertTransport;
  /** The backbone's id: the hello's id, which the ticket must name. */
  id: string;
  /** Asks the hub for a ticket admitting this backbone to `worker` (before every dial). */
  ticket(worker: string, signal: AbortSignal): Promise<string>;
  /** Back-off between dials to one worker after a failure (default 1 s doubling to 60 s). */
  backoff?: ReconnectOptions;
  /** Time for one dial and the worker's acceptance (default 5000 ms). */
  connectTimeoutMs?: number;
  heartbeatMs?: number;
  deadPeerMs?: number;
  maxFrameBytes?: number;
  onEvent?(event: DirectLinkEvent): void;
  /** The dialer under a link (default: WebSocket with the certificate pinned). */
  dial?: FrameDialer;
}

export interface DirectTransportCounters {
  /** Requests answered over a direct link, and over the fallback. */
  direct: number;
  relay: number;
  /** Requests whose direct link died under them, sent again over the fallback. */
  retried: number;
  /** Dials started, and failed. */
  dials: number;
  dialFailures: number;
  /** Direct links up now, by worker. */
  linked: string[];
}

interface Link {
  readonly route: DirectRoute;
  readonly key: string;
  conn: RelayConnection | undefined;
  transport: RelayTransport | undefined;
  dialing: Promise<void> | undefined;
  failures: number;
  retryAt: number;
}

const routeKey = (r: DirectRoute) => `${r.fingerprint} ${r.endpoints.join(" ")}`;

/** A transport that takes a direct link to a worker when it has one, and `fallback` otherwise. */
export class DirectTransport implements ExpertTransport {
  /** Workers are strangers' devices, on either path. */
  readonly trusted = false;
  readonly #o: DirectTransportOptions;
  readonly #backoff: Backoff;
  readonly #links = new Map<string, Link>();
  readonly #life = new AbortController();
  readonly #counts = { direct: 0, relay: 0, retried: 0, dials: 0, dialFailures: 0 };

  constructor(options: DirectTransportOptions) {
    if (typeof options?.fallback?.request !== "function" || typeof options.ticket !== "function") {
      throw new InvalidArgumentError("DirectTransport needs a fallback transport and a ticket function");
    }
    this.#o = options;
    this.#backoff = normalizeBackoff({ initialDelayMs: 1000, maxDelayMs: 60_000, ...options.backoff });
  }

  /**
   * The workers that advertise endpoints now (a new placement): links to workers no longer listed,
   * or whose endpoints or certificate changed, are closed; new ones are dialed in the background.
   */
  update(routes: ReadonlyMap<string, DirectRoute>): void {
    if (this.#life.signal.aborted) return;
    for (const [worker, link] of this.#links) {
      const next = routes.get(worker);
      if (!next || routeKey(next) !== link.key) {
        this.#links.delete(worker);
        void link.conn?.close();
      }
    }
    for (const [worker, route] of routes) {
      if (!this.#links.has(worker)) {
        this.#links.set(worker, {
          route,
          key: routeKey(route),
          conn: undefined,
          transport: undefined,
          dialing: undefined,
          failures: 0,
          retryAt: 0,
        });
      }
      this.#maybeDial(worker);
    }
  }

  /** Resolves when `worker`'s direct link is up, or its current dial failed (false). */
  async linked(worker: string): Promise<boolean> {
    const link = this.#links.get(worker);
    if (!link) return false;
    await link.dialing;
    return link.transport !== undefined;
  }

  counters(): DirectTransportCounters {
    const linked = [...this.#links].filter(([, l]) => l.transport !== undefined).map(([w]) => w);
    return { ...this.#counts, linked: linked.sort() };
  }

  async request(owner: string, req: ExpertRequest, options: ExpertCallOptions): Promise<ExpertResult> {
    const link = this.#links.get(owner);
    const direct = link?.transport;
    if (direct) {
      const started = performance.now();
      try {
        const result = await direct.request(owner, req, options);
        this.#counts.direct++;
        return result;
      } catch (error) {
        // only a link that died is worth the relay: the worker's own refusals stand
        if (
          !isMoeswarmError(error) ||
          error.code !== "MOESWARM_TRANSPORT_CLOSED" ||
          options?.signal?.aborted
        ) {
          throw error;
        }
        this.#counts.retried++;
        const left =
          options?.deadlineMs === undefined
            ? undefined
            : Math.max(1, options.deadlineMs - (performance.now() - started));
        options = { ...options, ...(left !== undefined ? { deadlineMs: left } : {}) };
      }
    } else if (link) this.#maybeDial(owner);
    const result = await this.#o.fallback.request(owner, req, options);
    this.#counts.relay++;
    return result;
  }

  /** Closes every direct link (the fallback is its owner's to close). */
  async close(): Promise<void> {
    this.#life.abort();
    const links = [...this.#links.values()];
    this.#links.clear();
    await Promise.all(links.map((l) => l.conn?.close()));
  }

  #maybeDial(worker: string): void {
    const link = this.#links.get(worker);
    if (!link || link.conn || link.dialing || performance.now() < link.retryAt || this.#life.signal.aborted) {
      return;
    }
    link.dialing = this.#dial(worker, link).finally(() => {
      link.dialing = undefined;
    });
  }

  async #dial(worker: string, link: Link): Promise<void> {
    this.#counts.dials++;
    const o = this.#o;
    const pin = link.route.fingerprint;
    const dial = o.dial ?? dialWebSocket;
    let last: Error | undefined;
    for (const url of link.route.endpoints) {
      try {
        const conn = await connectRelay(url, {
          role: "backbone",
          id: o.id,
          token: () => o.ticket(worker, this.#life.signal),
          dial: (u, d) => dial(u, { ...d, pin }),
          // its errors name the worker and the link, not the relay (which may be fine)
          peerName: `worker ${worker} on its direct link ${url}`,
          reconnect: false,
          signal: this.#life.signal,
          connectTimeoutMs: o.connectTimeoutMs ?? 5000,
          ...(o.heartbeatMs !== undefined ? { heartbeatMs: o.heartbeatMs } : {}),
          ...(o.deadPeerMs !== undefined ? { deadPeerMs: o.deadPeerMs } : {}),
          ...(o.maxFrameBytes !== undefined ? { maxFrameBytes: o.maxFrameBytes } : {}),
        });
        if (this.#links.get(worker) !== link) {
          await conn.close();
          return;
        }
        link.conn = conn;
        link.transport = new RelayTransport(conn, o.wireDtype ? { wireDtype: o.wireDtype } : {});
        link.failures = 0;
        conn.on((e) => {
          if (e.type === "state" && e.state === "closed") this.#lost(worker, link, e.error);
        });
        o.onEvent?.({ type: "linked", worker, url });
        return;
      } catch (error) {
        last = error instanceof Error ? error : new Error(String(error));
        if (this.#life.signal.aborted) return;
      }
    }
    this.#counts.dialFailures++;
    const retryInMs = this.#backOff(link);
    o.onEvent?.({ type: "dial-failed", worker, error: last ?? new Error("no endpoint"), retryInMs });
  }

  #lost(worker: string, link: Link, error: Error | undefined): void {
    link.conn = undefined;
    link.transport = undefined;
    if (this.#life.signal.aborted || this.#links.get(worker) !== link) return;
    const retryInMs = this.#backOff(link);
    this.#o.onEvent?.({ type: "lost", worker, ...(error ? { error } : {}), retryInMs });
  }

  #backOff(link: Link): number {
    link.failures++;
    const delay = backoffDelay(link.failures, this.#backoff);
    link.retryAt = performance.now() + delay;
    return delay;
  }
}

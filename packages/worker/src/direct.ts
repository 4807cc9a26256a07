import { hostname } from "node:os";
import { type DirectEndpointJson, InvalidArgumentError } from "@moeswarm/core";
import {
  type DirectServer,
  type DispatchHandler,
  type HubClient,
  parseDirectKey,
  selfSignedCertificate,
  serveDirect,
} from "@moeswarm/relay-client";
import type { WorkerEventBody } from "./events.js";

// A worker's direct endpoint (`--listen`): backbones that can reach it dial it instead of sending
// through the relay. The relay connection stays: it carries the backbones that cannot reach this
// worker, and the requests of any direct link that fails.

/** runWorker's `direct` option. */
export interface DirectOptions {
  /** `host:port` to listen on (`0.0.0.0:7443`; port 0 takes any free one). */
  listen: string;
  /** The `wss://name:port` URLs backbones dial (default: `wss://<listen host, or this host's name>:<port>`). */
  advertise?: string | readonly string[];
  /** PEM certificate and key to serve (default: a self-signed pair made with openssl at start). */
  tlsCert?: string;
  tlsKey?: string;
  /** How often to tell the hub what was answered directly, for credits (ms, default 10000; 100..600000). */
  reportMs?: number;
}

export interface DirectSettings {
  host: string;
  port: number;
  advertise: string[] | undefined;
  cert: string | undefined;
  key: string | undefined;
  reportMs: number;
}

/** A listener's `host:port` (IPv6 in brackets), checked; `option` names it in the error. */
export function listenAddress(
  listen: unknown,
  option: string,
  example: string,
): { host: string; port: number } {
  const m = typeof listen === "string" ? /^(\[[0-9A-Fa-f:.]+\]|[^:[\]]+):(\d{1,5})$/.exec(listen) : null;
  const port = m ? Number(m[2]) : Number.NaN;
  if (!m || port > 65_535) {
    throw new InvalidArgumentError(
      `${option} must be host:port (e.g. ${example}), got ${JSON.stringify(listen)}`,
    );
  }
  return { host: (m[1] as string).replace(/^\[|\]$/g, ""), port };
}

/** The name backbones dial for a listener bound to `host`: this machine's name for a wildcard. */
export function advertisedHost(host: string): string {
  return host === "0.0.0.0" || host === "::" ? hostname() : host.includes(":") ? `[${host}]` : host;
}

/** A served-report interval (ms), checked: 100..DIRECT_REPORT_MAX_MS. */
export function checkReportMs<T extends number | undefined>(reportMs: T, option: string): T {
  if (
    reportMs !== undefined &&
    !(typeof reportMs === "number" && reportMs >= 100 && reportMs <= DIRECT_REPORT_MAX_MS)
  ) {
    throw new InvalidArgumentError(
      `${option} must be 100..${DIRECT_REPORT_MAX_MS} ms (the hub waits ${DIRECT_MATCH_MINUTES} minutes for the backbone's half), got ${reportMs}`,
    );
  }
  return reportMs;
}

/** Checks runWorker's `direct` option. */
export function directSettings(o: DirectOptions | undefined): DirectSettings | undefined {
  if (o === undefined) return undefined;
  const { host, port } = listenAddress(o?.listen, "direct.listen", "0.0.0.0:7443");
  const advertise = o.advertise === undefined ? undefined : [o.advertise].flat();
  for (const url of advertise ?? []) {
    let ok = false;
    try {
      ok = new URL(url).protocol === "wss:";
    } catch {
      ok = false;
    }
    if (!ok)
      throw new InvalidArgumentError(
        `direct.advertise must be wss://name:port URLs, got ${JSON.stringify(url)}`,
      );
  }
  if ((o.tlsCert === undefined) !== (o.tlsKey === undefined)) {
    throw new InvalidArgumentError(
      "give both a TLS certificate and its key (--tls-cert and --tls-key), or neither",
    );
  }
  const reportMs = checkReportMs(o.reportMs ?? DIRECT_REPORT_MS, "direct.reportMs");
  return {
    host,
    port,
    advertise,
    cert: o.tlsCert,
    key: o.tlsKey,
    reportMs,
  };
}

/** Starts the listener (a self-signed certificate unless one was given). */
export async function startDirect(
  d: DirectSettings,
  o: {
    id: string;
    hub: HubClient;
    onDispatch: DispatchHandler;
    emit(body: WorkerEventBody): void;
    signal: AbortSignal;
    /** The pair to serve when `d` names none (the native listener's too: one fingerprint). */
    tls?: { cert: string; key: string };
  },
): Promise<{ server: DirectServer; endpoint: DirectEndpointJson }> {
  const tls =
    d.cert !== undefined && d.key !== undefined
      ? { cert: d.cert, key: d.key }
      : (o.tls ?? (await selfSignedCertificate({ signal: o.signal })));
  let refusals = 0;
  const server = await serveDirect({
    id: o.id,
    ...tls,
    host: d.host,
    port: d.port,
    hubKey: async () => parseDirectKey((await o.hub.request("/api/direct/key", { signal: o.signal })).json),
    onDispatch: o.onDispatch,
    onRefused: (error, remote) => {
      // a stranger knocking must not flood the log: the first ten, then every hundredth
      refusals++;
      if (refusals <= 10 || refusals % 100 === 0) {
        o.emit({
          event: "direct-refused",
          code: error.code,
          error: error.message,
          ...(remote ? { remote } : {}),
        });
      }
    },
  });
  const endpoints = d.advertise ?? [`wss://${advertisedHost(d.host)}:${server.port}`];
  return { server, endpoint: { endpoints, fingerprint: server.fingerprint } };
}

/**
 * Tells the hub where this worker listens (placement carries it to backbones); false when the hub
 * has no direct links (404: an older hub).
 */
export async function publishDirect(
  hub: HubClient,
  id: string,
  endpoint: DirectEndpointJson,
  signal: AbortSignal,
): Promise<boolean> {
  try {
    await hub.request(`/api/workers/${encodeURIComponent(id)}/direct`, {
      method: "PUT",
      body: endpoint,
      signal,
    });
    return true;
  } catch (error) {
    if ((error as { details?: { status?: unknown } })?.details?.status === 404) return false;
    throw error;
  }
}

/** How often the worker tells the hub what it answered directly (ms). */
export const DIRECT_REPORT_MS = 10_000;
/**
 * How long the hub keeps one side's unmatched half (hub DIRECT_MATCH_WINDOW_MS; minutes): a report
 * later than that finds the backbone's half gone, so the interval stays well inside it.
 */
export const DIRECT_MATCH_MINUTES = 15;
/** The longest report interval: a report and a retry or two still fit in the hub's window (ms). */
export const DIRECT_REPORT_MAX_MS = 600_000;

/**
 * What this worker answered over direct links, per backbone and model, reported to the hub
 * (`POST /api/workers/:id/direct/served`). The hub credits each pair the minimum of this and the
 * backbone's own receipts: requests that never crossed the relay still earn credits, and neither
 * side alone decides how many.
 */
export class DirectServedReport {
  readonly #hub: HubClient;
  readonly #id: string;
  #pending = new Map<string, { backbone: string; model: string; expertTokens: number; requests: number }>();
  #seq = 0;
  /** false once the hub said it has no such route (an older hub): nothing more is sent. */
  #supported = true;

  constructor(hub: HubClient, id: string) {
    this.#hub = hub;
    this.#id = id;
  }

  /** One answered dispatch: its filled slots (ids != -1), as the backbone's receipts count them. */
  add(backbone: string, model: string, ids: Int32Array): void {
    let filled = 0;
    for (let i = 0; i < ids.length; i++) if (ids[i] !== -1) filled++;
    this.addCounts(backbone, model, filled, 1);
  }

  /** Counts answered elsewhere (the native listener's, which counted the filled slots itself). */
  addCounts(backbone: string, model: string, expertTokens: number, requests: number): void {
    const key = `${backbone}\0${model}`;
    const e = this.#pending.get(key) ?? { backbone, model, expertTokens: 0, requests: 0 };
    e.expertTokens += expertTokens;
    e.requests += requests;
    this.#pending.set(key, e);
  }

  /**
   * Sends what was counted since the last report. The seq follows the clock, so it still rises
   * after a restart; what a failed send carried is counted again into the next one.
   */
  async flush(signal: AbortSignal): Promise<void> {
    if (this.#pending.size === 0 || !this.#supported) return;
    const entries = [...this.#pending.values()];
    this.#pending = new Map();
    this.#seq = Math.max(this.#seq + 1, Date.now());
    try {
      await this.#hub.request(`/api/workers/${encodeURIComponent(this.#id)}/direct/served`, {
        method: "POST",
        body: { seq: this.#seq, served: entries },
        signal,
      });
    } catch (error) {
      if ((error as { details?: { status?: unknown } })?.details?.status === 404) {
        this.#supported = false;
        return;
      }
      for (const e of entries) {
        const key = `${e.backbone}\0${e.model}`;
        const had = this.#pending.get(key);
        if (had) {
          had.expertTokens += e.expertTokens;
          had.requests += e.requests;
        } else this.#pending.set(key, e);
      }
      throw error;
    }
  }
}

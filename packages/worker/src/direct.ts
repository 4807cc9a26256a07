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
}

export interface DirectSettings {
  host: string;
  port: number;
  advertise: string[] | undefined;
  cert: string | undefined;
  key: string | undefined;
}

/** Checks runWorker's `direct` option. */
export function directSettings(o: DirectOptions | undefined): DirectSettings | undefined {
  if (o === undefined) return undefined;
  const m = typeof o?.listen === "string" ? /^(\[[0-9A-Fa-f:.]+\]|[^:[\]]+):(\d{1,5})$/.exec(o.listen) : null;
  const port = m ? Number(m[2]) : Number.NaN;
  if (!m || port > 65_535) {
    throw new InvalidArgumentError(
      `direct.listen must be host:port (e.g. 0.0.0.0:7443), got ${JSON.stringify(o?.listen)}`,
    );
  }
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
  return { host: (m[1] as string).replace(/^\[|\]$/g, ""), port, advertise, cert: o.tlsCert, key: o.tlsKey };
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
  },
): Promise<{ server: DirectServer; endpoint: DirectEndpointJson }> {
  const tls =
    d.cert !== undefined && d.key !== undefined
      ? { cert: d.cert, key: d.key }
      : await selfSignedCertificate({ signal: o.signal });
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
  const name =
    d.host === "0.0.0.0" || d.host === "::" ? hostname() : d.host.includes(":") ? `[${d.host}]` : d.host;
  const endpoints = d.advertise ?? [`wss://${name}:${server.port}`];
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

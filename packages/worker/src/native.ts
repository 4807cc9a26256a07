import type { KeyObject } from "node:crypto";
import { InvalidArgumentError, isMoeswarmError, isNativeAddress } from "@moeswarm/core";
import { type HubClient, parseDirectKey, ticketKeyId, verifyDirectTicket } from "@moeswarm/relay-client";
import {
  type NativeRoute,
  type NativeServed,
  type NativeServer,
  nativeSliceOf,
  serveNative,
} from "@moeswarm/worker-native";
import { advertisedHost, checkReportMs, listenAddress } from "./direct.js";
import type { WorkerEventBody } from "./events.js";
import type { SliceRouter } from "./slice-router.js";

// A worker's native listener (`--listen-native`, protocol section 10.9): backbone plugins send a
// whole layer's dispatch straight to the addon's threads over TLS, without the relay or any
// JavaScript on the way. What stays here: the hello's ticket check (the hub's key, fetched again
// for a key id not seen, at most every 10 s, as the direct endpoint does), which slices serve which
// layers (only a layer that one slice of the in-process addon holds alone), the pause and drain
// (an empty table), and the served counts for credits.

/** runWorker's `native` option. */
export interface NativeListenOptions {
  /** `host:port` to listen on (`0.0.0.0:7444`; port 0 takes any free one). */
  listen: string;
  /** The `host:port` addresses backbones dial (default: `<listen host, or this host's name>:<port>`). */
  advertise?: string | readonly string[];
  /** PEM certificate and key (default: `direct`'s, else a self-signed pair made at start). */
  tlsCert?: string;
  tlsKey?: string;
  /**
   * How often to tell the hub what was answered natively, for credits, when there is no `direct`
   * listener (whose `reportMs` rules otherwise; ms, default 10000; 100..600000).
   */
  reportMs?: number;
}

export interface NativeSettings {
  host: string;
  port: number;
  advertise: string[] | undefined;
  cert: string | undefined;
  key: string | undefined;
  reportMs: number | undefined;
}

/** Checks runWorker's `native` option. */
export function nativeSettings(o: NativeListenOptions | undefined): NativeSettings | undefined {
  if (o === undefined) return undefined;
  const { host, port } = listenAddress(o?.listen, "native.listen", "0.0.0.0:7444");
  const advertise = o.advertise === undefined ? undefined : [o.advertise].flat();
  for (const a of advertise ?? []) {
    if (!isNativeAddress(a)) {
      throw new InvalidArgumentError(
        `native.advertise must be host:port addresses (IPv6 as [::1]:port), got ${JSON.stringify(a)}`,
      );
    }
  }
  if ((o.tlsCert === undefined) !== (o.tlsKey === undefined)) {
    throw new InvalidArgumentError("give both a TLS certificate and its key, or neither");
  }
  const reportMs = checkReportMs(o.reportMs, "native.reportMs");
  return {
    host,
    port,
    advertise,
    cert: o.tlsCert,
    key: o.tlsKey,
    reportMs,
  };
}

/** The native listener of a run. */
export class NativePlane {
  readonly server: NativeServer;
  /** The addresses published (`host:port`). */
  readonly addresses: string[];
  readonly #emit: (body: WorkerEventBody) => void;
  #routes = "";

  private constructor(server: NativeServer, addresses: string[], emit: (body: WorkerEventBody) => void) {
    this.server = server;
    this.addresses = addresses;
    this.#emit = emit;
  }

  /**
   * Starts the listener, or undefined (with a `native-unavailable` event) where the addon cannot
   * serve it (no OpenSSL 3, no addon): the worker carries on without it.
   */
  static async start(
    ns: NativeSettings,
    o: {
      id: string;
      hub: HubClient;
      tls: { cert: string; key: string };
      /** The addon build the slices are loaded with. */
      compute: "native" | "llama-cpu";
      emit(body: WorkerEventBody): void;
      signal: AbortSignal;
    },
  ): Promise<NativePlane | undefined> {
    const keys = new KeyCache(async (signal) =>
      parseDirectKey((await o.hub.request("/api/direct/key", { signal })).json),
    );
    let refusals = 0;
    let server: NativeServer;
    try {
      server = await serveNative({
        host: ns.host,
        port: ns.port,
        ...o.tls,
        id: o.id,
        compute: o.compute,
        admit: async (backbone, ticket) => {
          verifyDirectTicket(ticket, {
            keys: await keys.for(ticketKeyId(ticket), o.signal),
            worker: o.id,
            backbone,
          });
        },
        onRefused: (error, remote) => {
          // a stranger knocking must not flood the log: the first ten, then every hundredth
          refusals++;
          if (refusals <= 10 || refusals % 100 === 0) {
            o.emit({ event: "native-refused", code: error.code, error: error.message, remote });
          }
        },
        signal: o.signal,
      });
    } catch (error) {
      if (isMoeswarmError(error) && error.code === "MOESWARM_NATIVE_LISTEN") throw error;
      o.emit({
        event: "native-unavailable",
        code: isMoeswarmError(error) ? error.code : "MOESWARM_NATIVE_LOAD",
        error: error instanceof Error ? error.message : String(error),
      });
      return undefined;
    }
    return new NativePlane(server, ns.advertise ?? [`${advertisedHost(ns.host)}:${server.port}`], o.emit);
  }

  /**
   * Serves what the routers hold (`serving`), or nothing (paused, draining). A layer goes on the
   * native plane when exactly one slice of this worker holds it and its compute is the listener's
   * addon's; every other layer stays on the relay and direct paths.
   */
  setRoutes(routers: ReadonlyMap<string, SliceRouter>, serving: boolean): void {
    const routes: NativeRoute[] = [];
    if (serving) {
      for (const [model, router] of routers) {
        for (const { layer, compute } of router.soleSlices()) {
          const slice = nativeSliceOf(compute);
          if (slice) routes.push({ model, layer, slice });
        }
      }
    }
    const taken = this.server.setRoutes(routes);
    const key = taken.map((r) => `${r.model}/${r.layer}`).join(",");
    if (key !== this.#routes) {
      this.#routes = key;
      this.#emit({ event: "native-routes", layers: taken.length, offered: routes.length });
    }
  }

  takeServed(): NativeServed[] {
    return this.server.takeServed();
  }

  close(): void {
    this.server.setRoutes([]);
    this.server.close();
  }
}

/** The hub's ticket keys, fetched again when a ticket names one not seen (at most every 10 s). */
class KeyCache {
  readonly #keys = new Map<string, KeyObject>();
  readonly #fetch: (signal: AbortSignal) => Promise<{ kid: string; key: KeyObject }>;
  #last = Number.NEGATIVE_INFINITY;
  #fetching: Promise<void> | undefined;

  constructor(fetch: (signal: AbortSignal) => Promise<{ kid: string; key: KeyObject }>) {
    this.#fetch = fetch;
  }

  async for(kid: string | undefined, signal: AbortSignal): Promise<ReadonlyMap<string, KeyObject>> {
    if (kid !== undefined && this.#keys.has(kid)) return this.#keys;
    const now = performance.now();
    if (!this.#fetching && now - this.#last >= 10_000) {
      this.#last = now;
      this.#fetching = this.#fetch(signal)
        .then(({ kid: id, key }) => void this.#keys.set(id, key))
        .catch(() => {})
        .finally(() => {
          this.#fetching = undefined;
        });
    }
    await this.#fetching;
    return this.#keys;
  }
}

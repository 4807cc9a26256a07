import { AbortError, abortReason, HubError, isNativeAddress, onAbort, sleep } from "@moeswarm/core";
import { type MissingExperts, Placement } from "@moeswarm/dispatch";
import { backoffDelay, type DirectRoute } from "@moeswarm/relay-client";
import { asError, type Emit, type HubLinkError, stamp } from "./hub-events.js";
import type { HubHttp } from "./hub-http.js";
import type { HubSettings } from "./hub-options.js";
import type { NativeRoute } from "./native-table.js";

// The hub's live placement: the first version at connect, then long-polled
// (`?since=<version>&wait=<s>`) with backoff after failures.

/** One version of the hub's live placement, as the link uses it. Never changed once published. */
export interface HubPlacement {
  /** The hub's placement version (it only grows). */
  readonly version: number;
  readonly placement: Placement;
  /** The model's MoE layers. */
  readonly layers: readonly number[];
  /** Routed experts per layer. */
  readonly nExpert: number;
  /** Live, non-draining workers with a slice of the model. */
  readonly workers: readonly string[];
  /** Experts nobody serves (they go to the local fallback, or fail the decode without one). */
  readonly missing: readonly MissingExperts[];
  /** When this version arrived (epoch ms). */
  readonly receivedAt: number;
  /** Workers that advertise direct endpoints, with their certificate's fingerprint. */
  readonly direct: ReadonlyMap<string, DirectRoute>;
  /** Workers that advertise a native listener (`direct.native`), with the same fingerprint. */
  readonly native: ReadonlyMap<string, NativeRoute>;
}

/** The `direct` entries of the registrations, by worker; a malformed one is left out (relay only). */
function directRoutesOf(registrations: readonly unknown[]): Map<string, DirectRoute> {
  const routes = new Map<string, DirectRoute>();
  for (const r of registrations) {
    if (!isObject(r) || typeof r.id !== "string" || !isObject(r.direct)) continue;
    const { endpoints, fingerprint } = r.direct;
    if (
      typeof fingerprint !== "string" ||
      !Array.isArray(endpoints) ||
      // a worker with a native listener only: nothing for the direct transport to dial
      endpoints.length === 0 ||
      !endpoints.every((e) => typeof e === "string" && e.startsWith("wss://"))
    ) {
      continue;
    }
    routes.set(r.id, { endpoints: [...(endpoints as string[])], fingerprint });
  }
  return routes;
}

const FINGERPRINT = /^[0-9A-F]{2}(?::[0-9A-F]{2}){31}$/;

/**
 * The `direct.native` listeners of the registrations, by worker: the plain `host:port` ones with a
 * well-formed fingerprint (a malformed entry leaves that worker off the native plane, nothing else).
 */
function nativeRoutesOf(registrations: readonly unknown[]): Map<string, NativeRoute> {
  const routes = new Map<string, NativeRoute>();
  for (const r of registrations) {
    if (!isObject(r) || typeof r.id !== "string" || !isObject(r.direct)) continue;
    const { native, fingerprint } = r.direct;
    if (typeof fingerprint !== "string" || !FINGERPRINT.test(fingerprint) || !Array.isArray(native)) continue;
    const addrs = native.filter(isNativeAddress);
    if (addrs.length > 0 && addrs.length === native.length) routes.set(r.id, { addrs, fingerprint });
  }
  return routes;
}

/**
 * The registrations with a malformed `dtypes` left out of them: a worker whose advertised dtypes
 * cannot be read is treated as one that said nothing (tried once), not as a broken placement.
 */
function withReadableDtypes(registrations: readonly unknown[]): unknown[] {
  return registrations.map((r) => {
    if (!isObject(r) || r.dtypes === undefined) return r;
    const d = r.dtypes;
    const ok =
      Array.isArray(d) &&
      d.length <= 64 &&
      d.every((x) => typeof x === "string" && x.length > 0 && x.length <= 64);
    if (ok) return r;
    const { dtypes: _, ...rest } = r;
    return rest;
  });
}

const MAX_PLACEMENT_BYTES = 64 * 1024 * 1024;
/** Beyond a long-poll's own wait. */
export const REQUEST_TIMEOUT_MS = 30_000;

function badAnswer(message: string, cause?: unknown): HubError {
  return new HubError("MOESWARM_HUB_INTERNAL", `the hub's placement: ${message}`, { cause });
}

export function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** Checks the hub's placement JSON and builds the dispatcher's Placement from it. */
export function parseHubPlacement(json: unknown, model: string, receivedAt = Date.now()): HubPlacement {
  if (!isObject(json)) throw badAnswer("not a JSON object");
  if (json.model !== model)
    throw badAnswer(`model ${JSON.stringify(json.model)}, expected ${JSON.stringify(model)}`);
  const version = json.version;
  if (!Number.isSafeInteger(version) || (version as number) < 0) throw badAnswer("version is not an integer");
  const layers = json.layers;
  if (!Array.isArray(layers) || !layers.every((l) => Number.isInteger(l) && l >= 0 && l <= 0x7fff_ffff)) {
    throw badAnswer("layers is not a list of layer indices");
  }
  const nExpert = json.experts;
  if (!Number.isInteger(nExpert) || (nExpert as number) < 1 || (nExpert as number) > 65_536) {
    throw badAnswer("experts is not an expert count in 1..65536");
  }
  if (!Array.isArray(json.registrations)) throw badAnswer("registrations is not a list");
  let placement: Placement;
  try {
    placement = Placement.fromRegistrations(withReadableDtypes(json.registrations) as never[], { model });
  } catch (error) {
    throw badAnswer((error as Error).message, error);
  }
  return {
    version: version as number,
    placement,
    layers: [...(layers as number[])],
    nExpert: nExpert as number,
    workers: placement.workers(),
    missing: placement.missing({ layers: layers as number[], nExpert: nExpert as number }),
    receivedAt,
    direct: directRoutesOf(json.registrations),
    native: nativeRoutesOf(json.registrations),
  };
}

/** Experts nobody serves, over every layer. */
export function missingCount(p: HubPlacement): number {
  return p.missing.reduce((s, x) => s + x.count, 0);
}

export interface PlacementFollowerOptions {
  http: HubHttp;
  model: string;
  settings: HubSettings;
  emit: Emit;
  /** Aborted when the link closes: the long-poll ends and waiters are rejected. */
  stop: AbortSignal;
}

/** Follows the hub's placement: `current` is always the newest version received. */
export class PlacementFollower {
  /** Set by `first()`, before anything reads it. */
  current!: HubPlacement;
  readonly counters = {
    placementUpdates: 0,
    polls: 0,
    pollErrors: 0,
    lastPollError: undefined as HubLinkError | undefined,
  };
  private readonly waiters = new Set<() => void>();
  /** Told each version applied (the link's direct transport follows the endpoints). */
  onApply: ((placement: HubPlacement) => void) | undefined;

  constructor(private readonly o: PlacementFollowerOptions) {}

  /** The placement now (a plain GET): connectHub waits for it. */
  async first(): Promise<void> {
    const first = await this.fetch(undefined);
    if (!first) throw badAnswer("304 without a version asked for");
    this.apply(first, true);
  }

  /** The long-poll loop, until `stop`; failures are counted, reported and retried with backoff. */
  async run(): Promise<void> {
    const { stop, settings, emit } = this.o;
    let attempt = 0;
    while (!stop.aborted) {
      try {
        const next = await this.fetch(this.current.version);
        this.counters.polls++;
        attempt = 0;
        if (next && next.version !== this.current.version) this.apply(next, false);
        else if (next) await sleep(1000, stop); // a hub that does not long-poll
      } catch (error) {
        if (stop.aborted) return;
        const e = asError(error);
        this.counters.pollErrors++;
        this.counters.lastPollError = stamp(e);
        attempt++;
        const retryInMs = backoffDelay(attempt, settings.retry);
        emit({ type: "error", source: "poll", error: e, retryInMs });
        // rejects only when the link closes, which ends the loop
        await sleep(retryInMs, stop).catch(() => {});
      }
    }
  }

  /** Resolves with the first version (the current one included) for which `predicate` holds. */
  waitFor(predicate: (placement: HubPlacement) => boolean, signal?: AbortSignal): Promise<HubPlacement> {
    return new Promise<HubPlacement>((resolve, reject) => {
      if (signal?.aborted) {
        reject(abortReason(signal));
        return;
      }
      const done = (error?: unknown) => {
        this.waiters.delete(check);
        aborting[Symbol.dispose]();
        if (error !== undefined) reject(error);
        else resolve(this.current);
      };
      const check = () => {
        if (this.o.stop.aborted) done(new AbortError("the hub link is closed"));
        else {
          try {
            if (predicate(this.current)) done();
          } catch (error) {
            done(error);
          }
        }
      };
      const aborting = onAbort(signal, (reason) => done(reason));
      this.waiters.add(check);
      check();
    });
  }

  /** Lets every waiter see the link closed. */
  wake(): void {
    for (const w of [...this.waiters]) w();
  }

  private apply(next: HubPlacement, first: boolean): void {
    this.current = next;
    if (!first) this.counters.placementUpdates++;
    this.onApply?.(next);
    this.wake();
    this.o.emit({
      type: "placement",
      version: next.version,
      workers: [...next.workers],
      missing: missingCount(next),
    });
  }

  private async fetch(since: number | undefined): Promise<HubPlacement | undefined> {
    const { pollWaitS, modelPath } = this.o.settings;
    const query = since === undefined ? "" : `?since=${since}&wait=${pollWaitS}`;
    const r = await this.o.http.request(`${modelPath}/placement${query}`, {
      signal: this.o.stop,
      headersTimeoutMs: (since === undefined ? 0 : pollWaitS * 1000) + REQUEST_TIMEOUT_MS,
      maxBodyBytes: MAX_PLACEMENT_BYTES,
    });
    return r.status === 304 ? undefined : parseHubPlacement(r.json, this.o.model);
  }
}

import type { LeaseJson } from "@moeswarm/core";
import { isMoeswarmError } from "@moeswarm/core";
import type { HubClient } from "@moeswarm/relay-client";

/**
 * Keeps a lease alive while its slice downloads: renews it every `ttl / 3`, so one lost renewal
 * still leaves two more chances before it expires. When the hub says the lease is gone (it
 * expired, or another claim replaced it), `signal` aborts so the download stops.
 */
export class LeaseKeeper {
  readonly #hub: HubClient;
  readonly #controller = new AbortController();
  readonly #ttlMs: number | undefined;
  readonly #onRenewed: (lease: LeaseJson) => void;
  readonly #onLost: (error: unknown) => void;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #stopped = false;
  #lease: LeaseJson;

  constructor(
    hub: HubClient,
    lease: LeaseJson,
    options: {
      ttlMs?: number | undefined;
      onRenewed: (lease: LeaseJson) => void;
      onLost: (error: unknown) => void;
    },
  ) {
    this.#hub = hub;
    this.#lease = lease;
    this.#ttlMs = options.ttlMs;
    this.#onRenewed = options.onRenewed;
    this.#onLost = options.onLost;
    this.#schedule(lease.ttlMs);
  }

  /** Aborted when the lease is lost. */
  get signal(): AbortSignal {
    return this.#controller.signal;
  }

  get lease(): LeaseJson {
    return this.#lease;
  }

  #schedule(ttlMs: number): void {
    if (this.#stopped) return;
    const ttl = this.#ttlMs ?? ttlMs;
    this.#timer = setTimeout(() => void this.#renew(), Math.max(250, Math.floor(ttl / 3)));
    this.#timer.unref?.();
  }

  async #renew(): Promise<void> {
    if (this.#stopped) return;
    try {
      const lease = await this.#hub.renew(this.#lease.leaseId, this.#ttlMs, this.#controller.signal);
      if (this.#stopped) return;
      this.#lease = lease;
      this.#onRenewed(lease);
      this.#schedule(lease.ttlMs);
    } catch (error) {
      if (this.#stopped) return;
      if (
        isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND") ||
        isMoeswarmError(error, "MOESWARM_AUTH_ROLE") ||
        isMoeswarmError(error, "MOESWARM_AUTH_INVALID") ||
        isMoeswarmError(error, "MOESWARM_AUTH_EXPIRED")
      ) {
        this.#stopped = true;
        this.#onLost(error);
        this.#controller.abort(error);
        return;
      }
      // the hub or the network hiccuped: the lease still has time, try again at the next tick
      this.#schedule(this.#lease.ttlMs);
    }
  }

  /** Stops renewing (the lease was fulfilled by a registration, or is given up). */
  stop(): void {
    this.#stopped = true;
    clearTimeout(this.#timer);
  }
}

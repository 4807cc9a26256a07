import { TransportError } from "@moeswarm/core";

const now = () => performance.now();

export interface HeartbeatHooks {
  /** Whether there is a connected link to watch now. */
  live(): boolean;
  /** Sends a protocol `ping`. */
  ping(seq: number, ts: number): void;
  /** The relay has been silent too long: drop the link. */
  dead(error: TransportError): void;
}

/**
 * Liveness of a connected link: a protocol `ping` every `heartbeatMs`, the round-trip time from
 * the matching `pong`, and a relay silent for `deadPeerMs` (no frame, not even part of one)
 * reported dead.
 */
export class Heartbeat {
  readonly #heartbeatMs: number;
  readonly #deadPeerMs: number;
  readonly #hooks: HeartbeatHooks;
  #lastSeen = 0;
  #lastPing = 0;
  #seq = 0;
  #rttMs: number | undefined;
  #timer: ReturnType<typeof setInterval> | undefined;

  constructor(heartbeatMs: number, deadPeerMs: number, hooks: HeartbeatHooks) {
    this.#heartbeatMs = heartbeatMs;
    this.#deadPeerMs = deadPeerMs;
    this.#hooks = hooks;
  }

  /** Round-trip time of the last answered ping, ms. */
  get rttMs(): number | undefined {
    return this.#rttMs;
  }

  /** Starts watching a link the relay just accepted. */
  start(): void {
    const t = now();
    this.#lastSeen = t;
    this.#lastPing = t;
    clearInterval(this.#timer);
    const tick = Math.max(5, Math.min(this.#heartbeatMs, this.#deadPeerMs / 4));
    this.#timer = setInterval(() => this.#onTick(), tick);
    this.#timer.unref?.();
  }

  stop(): void {
    clearInterval(this.#timer);
    this.#timer = undefined;
  }

  /** The relay showed it is alive (a frame, or bytes of one). */
  seen(): void {
    this.#lastSeen = now();
  }

  /** A `pong`: only the answer to the latest ping counts. */
  pong(seq: number, ts: number): void {
    if (seq === this.#seq - 1) this.#rttMs = now() - ts;
  }

  #onTick(): void {
    if (!this.#hooks.live()) return;
    const t = now();
    if (t - this.#lastSeen > this.#deadPeerMs) {
      this.#hooks.dead(
        new TransportError(
          "MOESWARM_TRANSPORT_TIMEOUT",
          `no frame from the relay for ${Math.round(t - this.#lastSeen)} ms (deadPeerMs ${this.#deadPeerMs})`,
        ),
      );
      return;
    }
    if (t - this.#lastPing >= this.#heartbeatMs) {
      this.#lastPing = t;
      this.#hooks.ping(this.#seq++, t);
    }
  }
}

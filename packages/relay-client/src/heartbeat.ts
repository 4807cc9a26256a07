import { TransportError } from "@moeswarm/core";

const now = () => performance.now();

export interface HeartbeatHooks {
  /** Whether there is a connected link to watch now. */
  live(): boolean;
  /** Sends a protocol `ping`. */
  ping(seq: number, ts: number): void;
  /** The peer has been silent too long: drop the link. */
  dead(error: TransportError): void;
}

/** What a relay connection's peer is called in its errors, unless the caller names it. */
export const RELAY_PEER = "the relay";

/**
 * Liveness of a connected link: a protocol `ping` every `heartbeatMs`, the round-trip time from
 * the matching `pong`, and a peer silent for `deadPeerMs` (no frame, not even part of one)
 * reported dead. The peer is the relay, or a worker a backbone dialed directly: `peer` names it in
 * the error, so a dead direct link is not reported as a dead relay (the relay may be fine).
 */
export class Heartbeat {
  readonly #heartbeatMs: number;
  readonly #deadPeerMs: number;
  readonly #hooks: HeartbeatHooks;
  readonly #peer: string;
  #lastSeen = 0;
  #lastPing = 0;
  #seq = 0;
  #rttMs: number | undefined;
  #timer: ReturnType<typeof setInterval> | undefined;

  /** `peer`: what the other end is called in the dead-peer error ("the relay", "worker w1 (direct link wss://…)"). */
  constructor(heartbeatMs: number, deadPeerMs: number, hooks: HeartbeatHooks, peer: string = RELAY_PEER) {
    this.#heartbeatMs = heartbeatMs;
    this.#deadPeerMs = deadPeerMs;
    this.#hooks = hooks;
    this.#peer = peer;
  }

  /** Round-trip time of the last answered ping, ms. */
  get rttMs(): number | undefined {
    return this.#rttMs;
  }

  /** Starts watching a link the peer just accepted. */
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

  /** The peer showed it is alive (a frame, or bytes of one). */
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
          `no frame from ${this.#peer} for ${Math.round(t - this.#lastSeen)} ms (deadPeerMs ${this.#deadPeerMs})`,
          {
            details: {
              peer: this.#peer,
              silentMs: Math.round(t - this.#lastSeen),
              deadPeerMs: this.#deadPeerMs,
            },
          },
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

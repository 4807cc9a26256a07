import {
  isMoeswarmError,
  onAbort,
  parseWorkerPauseJson,
  parseWorkerPauseNotice,
  workerPauseUrl,
} from "@moeswarm/core";
import { isTransient } from "@moeswarm/relay-client";
import type { WorkerEventBody } from "./events.js";
import type { Settings } from "./options.js";
import { type PowerState, PowerWatch } from "./power.js";
import { codeOf, message } from "./run-helpers.js";

// A run's pause (issue 19): the hub's (its owner or the operator paused it; the relay's notice
// says so) and its own (battery or heat, from PowerWatch). While either holds, the worker claims
// nothing new; the hub leaves it out of placements, so backbones route it nothing new, and what
// is in flight finishes. Its own pause it tells the hub, again at every poll while it lasts (a
// hub that restarted forgets it), and the resume once; a run that starts unpaused tells the hub
// it is not paused (an earlier run may have stopped while paused).

export interface RunPauseContext {
  readonly s: Settings;
  emit(body: WorkerEventBody): void;
  /** Aborted when the run stops. */
  readonly stop: AbortSignal;
}

export class RunPause {
  readonly #ctx: RunPauseContext;
  #hub: { by: "owner" | "operator"; reason?: string } | undefined;
  #self: PowerState | undefined;
  /** The hub has no pause API (an older hub): its own pause is not told. */
  #unsupported = false;
  /** A resume the hub has not taken yet. */
  #resumePending = false;
  /** A request to the hub is under way (a slow hub does not get them stacked). */
  #telling = false;
  #waiters: Array<() => void> = [];
  #timer: ReturnType<typeof setTimeout> | undefined;

  constructor(ctx: RunPauseContext) {
    this.#ctx = ctx;
  }

  get paused(): boolean {
    return this.#hub !== undefined || this.#self !== undefined;
  }

  /** Starts watching the battery and heat (unless `power` is false): a check now, then every interval. */
  start(): void {
    const { s, stop } = this.#ctx;
    if (s.power === false || stop.aborted) return;
    const watch = new PowerWatch(s.power, (state) => this.#onPower(state));
    // a run that starts unpaused lifts a pause of its own that an earlier run left on the hub
    // (it stopped or died while paused); where sysfs tells nothing, no run can have paused
    const first = watch.check();
    this.#resumePending = !first.paused && (first.battery !== undefined || first.tempC !== undefined);
    const tick = () => {
      watch.check();
      void this.#tellHub();
      this.#timer = setTimeout(tick, s.power === false ? 30_000 : (s.power.intervalMs ?? 30_000));
      this.#timer.unref?.();
    };
    onAbort(stop, () => clearTimeout(this.#timer));
    tick();
  }

  /** Resolves when no pause holds (at once when none does), or when the run stops. */
  whenResumed(): Promise<void> {
    if (!this.paused || this.#ctx.stop.aborted) return Promise.resolve();
    return new Promise<void>((resolve) => {
      const stopping = onAbort(this.#ctx.stop, () => done());
      const done = () => {
        stopping[Symbol.dispose]();
        this.#waiters = this.#waiters.filter((w) => w !== done);
        resolve();
      };
      this.#waiters.push(done);
    });
  }

  #wake(): void {
    if (this.paused) return;
    for (const w of [...this.#waiters]) w();
  }

  /** A relay notice: true when it was the hub's pause or resume (handled here). */
  onNotice(code: string, msg: string): boolean {
    if (code !== "MOESWARM_HUB_PAUSED" && code !== "MOESWARM_HUB_RESUMED") return false;
    const n = parseWorkerPauseNotice(msg);
    const paused = code === "MOESWARM_HUB_PAUSED";
    const by = n?.by ?? "operator";
    if (paused) {
      // told again at a reconnect: nothing new to say
      if (this.#hub?.by === by && this.#hub.reason === n?.reason) return true;
      this.#hub = { by, ...(n?.reason !== undefined ? { reason: n.reason } : {}) };
      this.#ctx.emit({ event: "paused", by, ...(n?.reason !== undefined ? { reason: n.reason } : {}) });
    } else if (this.#hub) {
      this.#hub = undefined;
      this.#ctx.emit({ event: "resumed", by });
      this.#wake();
    }
    return true;
  }

  /**
   * The relay connection came back: the hub may have restarted and forgotten its pauses. Its own
   * pause is told again now; the hub's is read back (a pause still in force is also told by a
   * notice after the registrations are replayed), and ends here when the hub has none.
   */
  onReconnect(): void {
    if (this.#self) void this.#tellHub();
    if (this.#hub) void this.#resync();
  }

  async #resync(): Promise<void> {
    const { s, stop } = this.#ctx;
    try {
      const state = parseWorkerPauseJson((await s.hub.request(workerPauseUrl(s.id), { signal: stop })).json);
      if (state.hub || !this.#hub) return;
      const { by } = this.#hub;
      this.#hub = undefined;
      this.#ctx.emit({ event: "resumed", by });
      this.#wake();
    } catch {
      // an older hub, or unreachable: the next reconnect or notice settles it
    }
  }

  #onPower(state: PowerState): void {
    const figures = {
      ...(state.battery !== undefined ? { battery: state.battery } : {}),
      ...(state.tempC !== undefined ? { tempC: state.tempC } : {}),
    };
    if (state.paused) {
      this.#self = state;
      this.#resumePending = false;
      this.#ctx.emit({
        event: "paused",
        by: "self",
        ...(state.reason ? { reason: state.reason } : {}),
        ...figures,
      });
    } else if (this.#self) {
      this.#self = undefined;
      this.#resumePending = true;
      this.#ctx.emit({ event: "resumed", by: "self", ...figures });
      this.#wake();
    }
  }

  /** Tells the hub its own pause (every poll while it lasts) or its resume (until taken). */
  async #tellHub(): Promise<void> {
    if (this.#telling || this.#unsupported || (!this.#self && !this.#resumePending)) return;
    this.#telling = true;
    try {
      await this.#tell();
    } finally {
      this.#telling = false;
    }
  }

  async #tell(): Promise<void> {
    const { s, stop } = this.#ctx;
    const action = this.#self ? "pause" : "resume";
    const reason = this.#self?.reason;
    try {
      await s.hub.request(workerPauseUrl(s.id, action), {
        method: "POST",
        body: { self: true, ...(reason !== undefined ? { reason } : {}) },
        signal: stop,
      });
      if (action === "resume") this.#resumePending = false;
    } catch (error) {
      if (stop.aborted) return;
      if (
        isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND") ||
        isMoeswarmError(error, "MOESWARM_HUB_METHOD_NOT_ALLOWED")
      ) {
        // a hub from before pauses: it routes by placement as before; the worker still claims nothing new
        this.#unsupported = true;
        return;
      }
      const retryInMs = s.power === false ? 30_000 : (s.power.intervalMs ?? 30_000);
      if (isTransient(error)) {
        this.#ctx.emit({ event: "hub-unreachable", error: message(error), code: codeOf(error), retryInMs });
      } else {
        this.#ctx.emit({ event: "pause-unreported", error: message(error), code: codeOf(error) });
      }
    }
  }

  stop(): void {
    clearTimeout(this.#timer);
  }
}

import { InvalidArgumentError } from "@moeswarm/core";

// Liveness (issue 14, attack 7): a worker that stops answering (SIGSTOP, a stalled link) must cost
// a decode at most one deadline, and then not be picked again until it proves it answers. Each
// worker's deadline adapts to its own observed round times, and a circuit breaker takes a worker
// that timed out out of rotation at once, for a cool-down that doubles on repeats; after the
// cool-down one probe request is let through (half-open), and its answer closes the circuit.

export interface LivenessOptions {
  /** The lowest adaptive deadline, ms (default 250): round times of a fast worker jitter. */
  readonly floorMs?: number;
  /** Adaptive deadline = this x the worker's windowed p95 round time (default 4). */
  readonly factor?: number;
  /** Round times a worker needs before its deadline adapts (default 4; until then the call's deadlineMs). */
  readonly minSamples?: number;
  /** First cool-down of an open circuit, ms (default 1000); doubles per repeat. */
  readonly coolDownMs?: number;
  /** Longest cool-down, ms (default 60000). */
  readonly maxCoolDownMs?: number;
  /** Adaptive hedge delay = this x the worker's p50 (default 2). */
  readonly hedgeFactor?: number;
  /** Clock, ms (default performance.now; tests pass fake timers' clock). */
  readonly now?: () => number;
}

export interface LivenessSnapshot {
  /** Requests that ran past their (adaptive) deadline. */
  timeouts: number;
  /** Circuits opened, ever (a half-open probe that fails counts again). */
  opens: number;
  /** Workers whose circuit is open now. */
  open: string[];
  /** Per worker: p50 and p95 of its recent round times (ms) and its adaptive deadline cap-free. */
  workers: Record<string, { p50: number; p95: number; samples: number; deadlineMs: number | undefined }>;
}

const WINDOW = 32;

interface WorkerState {
  /** Recent round times, and per (token, expert) slot, rings of WINDOW. */
  readonly times: number[];
  readonly perSlot: number[];
  next: number;
  /** When the open circuit may be probed (clock ms); undefined: closed. */
  openUntil: number | undefined;
  /** Consecutive opens (the cool-down doubles per repeat). */
  opens: number;
  /** A half-open probe is out. */
  probing: boolean;
}

function positive(v: number | undefined, name: string, fallback: number): number {
  if (v === undefined) return fallback;
  if (!(typeof v === "number" && Number.isFinite(v) && v > 0)) {
    throw new InvalidArgumentError(`Liveness: ${name} must be a positive finite number, got ${String(v)}`);
  }
  return v;
}

function quantile(sorted: readonly number[], q: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
}

/**
 * Per-worker adaptive deadlines, a circuit breaker and adaptive hedge delays, shared by every call
 * of a dispatcher (pass it as `liveness`; without one, an untrusted transport gets its own).
 */
export class Liveness {
  readonly floorMs: number;
  readonly factor: number;
  readonly minSamples: number;
  readonly coolDownMs: number;
  readonly maxCoolDownMs: number;
  readonly hedgeFactor: number;
  readonly #now: () => number;
  readonly #workers = new Map<string, WorkerState>();
  #timeouts = 0;
  #opens = 0;

  constructor(options: LivenessOptions = {}) {
    this.floorMs = positive(options.floorMs, "floorMs", 250);
    this.factor = positive(options.factor, "factor", 4);
    this.minSamples = Math.ceil(positive(options.minSamples, "minSamples", 4));
    this.coolDownMs = positive(options.coolDownMs, "coolDownMs", 1000);
    this.maxCoolDownMs = positive(options.maxCoolDownMs, "maxCoolDownMs", 60_000);
    this.hedgeFactor = positive(options.hedgeFactor, "hedgeFactor", 2);
    if (options.now !== undefined && typeof options.now !== "function") {
      throw new InvalidArgumentError("Liveness: now must be a function");
    }
    this.#now = options.now ?? (() => performance.now());
  }

  #state(worker: string): WorkerState {
    let s = this.#workers.get(worker);
    if (!s) {
      s = { times: [], perSlot: [], next: 0, openUntil: undefined, opens: 0, probing: false };
      this.#workers.set(worker, s);
    }
    return s;
  }

  #sorted(worker: string): number[] | undefined {
    const s = this.#workers.get(worker);
    if (!s || s.times.length < this.minSamples) return undefined;
    return [...s.times].sort((a, b) => a - b);
  }

  /**
   * The deadline for a request of `slots` (token, expert) pairs to `worker`: factor x the larger of
   * the p95 of its round times and the p95 of its time per slot x `slots` (a prefill's big batch
   * takes longer than the decode rounds the history is mostly made of), in [floorMs, capMs].
   */
  deadline(worker: string, capMs: number, slots = 0): number {
    const sorted = this.#sorted(worker);
    if (!sorted) return capMs;
    const s = this.#workers.get(worker)!;
    const perSlot =
      quantile(
        [...s.perSlot].sort((a, b) => a - b),
        0.95,
      ) * slots;
    return Math.min(capMs, Math.max(this.floorMs, this.factor * Math.max(quantile(sorted, 0.95), perSlot)));
  }

  /** The adaptive hedge delay for `worker` (hedgeFactor x p50, at least floorMs / 4); undefined without history. */
  hedgeDelay(worker: string): number | undefined {
    const sorted = this.#sorted(worker);
    if (!sorted) return undefined;
    return Math.max(this.floorMs / 4, this.hedgeFactor * quantile(sorted, 0.5));
  }

  /**
   * Whether `worker` may be picked now: closed, or open past its cool-down with no probe out (the
   * caller that gets true then sends the probe).
   */
  available(worker: string): boolean {
    const s = this.#workers.get(worker);
    if (!s || s.openUntil === undefined) return true;
    if (this.#now() < s.openUntil || s.probing) return false;
    return true;
  }

  /** The workers that may not be picked now, for `Placement.choose`'s `exclude`. */
  excluded(): Set<string> {
    const out = new Set<string>();
    for (const [id, s] of this.#workers) if (s.openUntil !== undefined && !this.available(id)) out.add(id);
    return out;
  }

  /** @internal a request to `worker` is sent (marks the half-open probe). */
  sent(worker: string): void {
    const s = this.#workers.get(worker);
    if (s && s.openUntil !== undefined && this.#now() >= s.openUntil) s.probing = true;
  }

  /** @internal `worker` answered `slots` (token, expert) pairs after `ms`: a sample, and its circuit closes. */
  answered(worker: string, ms: number, slots = 1): void {
    const s = this.#state(worker);
    const rate = ms / Math.max(1, slots);
    if (s.times.length < WINDOW) {
      s.times.push(ms);
      s.perSlot.push(rate);
    } else {
      s.times[s.next] = ms;
      s.perSlot[s.next] = rate;
    }
    s.next = (s.next + 1) % WINDOW;
    s.openUntil = undefined;
    s.opens = 0;
    s.probing = false;
  }

  /** @internal `worker` ran past its deadline: its circuit opens (again, for twice as long). */
  timedOut(worker: string): void {
    this.#timeouts++;
    const s = this.#state(worker);
    s.opens++;
    s.probing = false;
    this.#opens++;
    const cool = Math.min(this.maxCoolDownMs, this.coolDownMs * 2 ** Math.min(30, s.opens - 1));
    s.openUntil = this.#now() + cool;
  }

  /** @internal a probe or request that failed otherwise (not a timeout): the probe slot frees. */
  failed(worker: string): void {
    const s = this.#workers.get(worker);
    if (s) s.probing = false;
  }

  /** Closes a worker's circuit and forgets its history. */
  reset(worker: string): void {
    this.#workers.delete(worker);
  }

  snapshot(): LivenessSnapshot {
    const workers = Object.create(null) as LivenessSnapshot["workers"];
    for (const [id, s] of this.#workers) {
      const sorted = [...s.times].sort((a, b) => a - b);
      workers[id] = {
        p50: sorted.length ? quantile(sorted, 0.5) : 0,
        p95: sorted.length ? quantile(sorted, 0.95) : 0,
        samples: sorted.length,
        deadlineMs:
          sorted.length >= this.minSamples ? this.deadline(id, Number.POSITIVE_INFINITY) : undefined,
      };
    }
    return { timeouts: this.#timeouts, opens: this.#opens, open: [...this.excluded()], workers };
  }
}

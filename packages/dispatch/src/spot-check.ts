import { getRandomValues } from "node:crypto";
import type { ExpertHandler } from "@moeswarm/core";
import { cosine, InvalidArgumentError, mulberry32 } from "@moeswarm/core";

/**
 * Default lowest cosine per slot (mode "each") or token row ("sum") between a worker's answer and
 * the re-computation. Honest answers differ only by numerics: a native worker vs the f64 oracle is
 * 0.99995 (phone 0.99992, GPU vs phone 0.9999), but ggml-cuda's mmq kernels on K-quants lose more
 * as the batch grows (worker-native README, H200: Q4_K 0.99782 and Q5_K 0.99736 per slot vs f64 at
 * 128 tokens), and the CPU reference has its own error (Q4_K 0.99958): the two angles add up to a
 * cosine of about 0.995 in the worst case. 0.99 (an angle of 8.1 degrees) keeps a margin above
 * that; a wrong expert, zeros, noise or a stale row land far below it. Give 0.999 when every
 * worker shares the reference's numerics (CPU and phone workers against a CPU reference).
 */
export const DEFAULT_MIN_COSINE = 0.99;

/**
 * Default largest relative difference between the norms of a part's answer and its
 * re-computation, over all the part's slots together. Cosine cannot see a scaled answer
 * (`1.05 * y` has cosine 1); numerical noise barely moves the norm (it is nearly orthogonal to the
 * signal and averages out over slots), a systematic scale does not average out.
 */
export const DEFAULT_NORM_TOLERANCE = 0.02;

export interface QuarantineEvent {
  readonly worker: string;
  readonly layer: number;
  /** The experts of the part that disagreed, ascending. */
  readonly experts: readonly number[];
  /** The lowest cosine over the part's slots (or rows); NaN for a non-finite value. */
  readonly cosine: number;
  /** What disagreed, for logs: the slot or row, or the norm ratio. */
  readonly reason: string;
  /**
   * The evidence, as verification's quarantines carry it (a backbone reports it to the hub): the
   * sha256 (hex) of the request payload the disagreeing answer answered (x, ids, w bytes).
   */
  readonly requestDigest?: string;
  /** The re-computation's L2 norm, and the worker's with its cosine to it (clamped to [-1, 1]). */
  readonly expected?: { readonly norm: number };
  readonly got?: { readonly norm: number; readonly cosine: number };
  /** Who re-computed: "the reference" (local compute) or the replica's id. */
  readonly decidedBy?: string;
}

export interface SpotCheckOptions {
  /** Share of worker answers (one per call and worker) re-computed, in [0, 1]. */
  readonly fraction: number;
  /** Lowest acceptable cosine per slot ("each") or token row ("sum"); default {@link DEFAULT_MIN_COSINE}. */
  readonly minCosine?: number;
  /** Largest `| ‖y‖ / ‖ref‖ - 1 |` over a part; default {@link DEFAULT_NORM_TOLERANCE}. */
  readonly normTolerance?: number;
  /**
   * Where the sampled answers are re-computed: a local compute (e.g. the backbone's own weights).
   * Without it, another owner of all the part's experts is asked through the same transport.
   */
  readonly reference?: ExpertHandler;
  /** Seed of the sampling PRNG, a uint32 (default: random, from node:crypto). */
  readonly seed?: number;
  /** Disagreements that quarantine a worker (default 1). */
  readonly strikes?: number;
  /** How long a quarantine lasts, ms (default: until {@link SpotCheck.release}). */
  readonly quarantineMs?: number;
  /** Called once per quarantine; an exception it throws is ignored (it must not fail a dispatch). */
  readonly onQuarantine?: (event: QuarantineEvent) => void;
}

export interface SpotCheckSnapshot {
  /** Parts drawn for a check. */
  sampled: number;
  /** Parts compared with a re-computation (agreements + disagreements). */
  checks: number;
  agreements: number;
  disagreements: number;
  /** Sampled parts with no reference and no other owner, or whose re-computation failed. */
  unverifiable: number;
  /** Quarantines started, ever. */
  quarantines: number;
  /** Workers quarantined now. */
  quarantined: string[];
  /** Disagreements per worker since it was last released. */
  strikes: Record<string, number>;
}

/** The comparison of one part: its worst cosine, and why it disagrees (undefined: it agrees). */
export interface PartComparison {
  readonly cosine: number;
  readonly reason: string | undefined;
}

function inUnit(v: unknown): v is number {
  return typeof v === "number" && v >= 0 && v <= 1;
}

/**
 * Result spot-checking (ARCHITECTURE.md section 8): a sampled share of the answers workers give to
 * `dispatchExperts` is re-computed locally or by a replica; an answer that disagrees is replaced by
 * the re-computation and strikes its worker, and a worker with enough strikes is quarantined (no
 * traffic) for `quarantineMs` or until {@link release}. One object is shared by every call of a
 * backbone (pass it as `verify`); the quarantine lives here, not in the Placement, so it survives a
 * new placement from the hub.
 */
export class SpotCheck {
  readonly fraction: number;
  readonly minCosine: number;
  readonly normTolerance: number;
  readonly reference: ExpertHandler | undefined;
  readonly strikes: number;
  readonly quarantineMs: number | undefined;
  readonly #onQuarantine: ((event: QuarantineEvent) => void) | undefined;
  /** Draws in [0, 1): mulberry32, so a seed replays the same samples. */
  readonly #random: () => number;
  /** Worker -> when its quarantine ends (performance.now() ms; Infinity: until released). */
  readonly #quarantine = new Map<string, number>();
  readonly #strikes = new Map<string, number>();
  readonly #counts = {
    sampled: 0,
    checks: 0,
    agreements: 0,
    disagreements: 0,
    unverifiable: 0,
    quarantines: 0,
  };

  constructor(options: SpotCheckOptions) {
    if (typeof options !== "object" || options === null)
      throw new InvalidArgumentError("SpotCheck: options are required");
    const { fraction, minCosine, normTolerance, reference, seed, strikes, quarantineMs, onQuarantine } =
      options;
    if (!inUnit(fraction))
      throw new InvalidArgumentError(`SpotCheck: fraction must be in [0, 1], got ${String(fraction)}`);
    if (minCosine !== undefined && !(inUnit(minCosine) && minCosine > 0)) {
      throw new InvalidArgumentError(`SpotCheck: minCosine must be in (0, 1], got ${String(minCosine)}`);
    }
    if (normTolerance !== undefined && !inUnit(normTolerance)) {
      throw new InvalidArgumentError(
        `SpotCheck: normTolerance must be in [0, 1], got ${String(normTolerance)}`,
      );
    }
    if (reference !== undefined && typeof reference !== "function")
      throw new InvalidArgumentError("SpotCheck: reference must be a function");
    if (seed !== undefined && !(Number.isInteger(seed) && seed >= 0 && seed <= 0xffff_ffff)) {
      throw new InvalidArgumentError(`SpotCheck: seed must be an integer in [0, 2^32), got ${String(seed)}`);
    }
    if (strikes !== undefined && !(Number.isInteger(strikes) && strikes >= 1 && strikes <= 1_000_000)) {
      throw new InvalidArgumentError(`SpotCheck: strikes must be an integer >= 1, got ${String(strikes)}`);
    }
    if (quarantineMs !== undefined && !(Number.isFinite(quarantineMs) && quarantineMs > 0)) {
      throw new InvalidArgumentError(
        `SpotCheck: quarantineMs must be a positive finite number, got ${String(quarantineMs)}`,
      );
    }
    if (onQuarantine !== undefined && typeof onQuarantine !== "function") {
      throw new InvalidArgumentError("SpotCheck: onQuarantine must be a function");
    }
    this.fraction = fraction;
    this.minCosine = minCosine ?? DEFAULT_MIN_COSINE;
    this.normTolerance = normTolerance ?? DEFAULT_NORM_TOLERANCE;
    this.reference = reference;
    this.strikes = strikes ?? 1;
    this.quarantineMs = quarantineMs;
    this.#onQuarantine = onQuarantine;
    this.#random = mulberry32(seed ?? getRandomValues(new Uint32Array(1))[0]!);
  }

  /** @internal draws whether the next part is checked (mulberry32: deterministic for a seed). */
  sample(): boolean {
    const hit = this.#random() < this.fraction;
    if (hit) this.#counts.sampled++;
    return hit;
  }

  /** Whether a worker is quarantined now (an expired quarantine ends here). */
  isQuarantined(id: string): boolean {
    const until = this.#quarantine.get(id);
    if (until === undefined) return false;
    if (performance.now() < until) return true;
    this.release(id);
    return false;
  }

  /** The workers quarantined now. */
  quarantined(): string[] {
    return [...this.#quarantine.keys()].filter((id) => this.isQuarantined(id));
  }

  /** Ends a worker's quarantine and clears its strikes. Returns whether it was quarantined. */
  release(id: string): boolean {
    this.#strikes.delete(id);
    return this.#quarantine.delete(id);
  }

  /** @internal the quarantined workers, for `Placement.choose`'s `exclude`. */
  excluded(): Set<string> {
    return new Set(this.quarantined());
  }

  /** @internal a sampled part that could not be re-computed. */
  unverifiable(): void {
    this.#counts.unverifiable++;
  }

  /** @internal a sampled part that agreed. */
  agreed(): void {
    this.#counts.checks++;
    this.#counts.agreements++;
  }

  /** @internal a sampled part that disagreed: a strike, and a quarantine at `strikes`. */
  disagreed(event: QuarantineEvent): void {
    this.#counts.checks++;
    this.#counts.disagreements++;
    const { worker } = event;
    const n = (this.#strikes.get(worker) ?? 0) + 1;
    this.#strikes.set(worker, n);
    if (n < this.strikes || this.isQuarantined(worker)) return;
    this.#quarantine.set(
      worker,
      this.quarantineMs === undefined ? Number.POSITIVE_INFINITY : performance.now() + this.quarantineMs,
    );
    this.#counts.quarantines++;
    try {
      this.#onQuarantine?.(event);
    } catch {
      // a logging callback must not turn a corrected answer into a failed call
    }
  }

  /**
   * @internal compares a worker's `y` with the re-computation's, both laid out as the part's
   * request asked (mode "each": `[n x k x embd]`, slots with `ids < 0` unread; "sum": `[n x embd]`).
   */
  compare(
    mode: "each" | "sum",
    n: number,
    k: number,
    embd: number,
    ids: Int32Array,
    tokens: Int32Array,
    y: Float32Array | Float64Array,
    ref: Float32Array | Float64Array,
  ): PartComparison {
    let worst = 1;
    let reason: string | undefined;
    let yy = 0;
    let rr = 0;
    const rows = mode === "each" ? n * k : n;
    for (let s = 0; s < rows; s++) {
      if (mode === "each" && ids[s]! < 0) continue;
      const a = y.subarray(s * embd, (s + 1) * embd);
      const b = ref.subarray(s * embd, (s + 1) * embd);
      const c = cosine(a, b);
      for (let i = 0; i < embd; i++) {
        yy += a[i]! * a[i]!;
        rr += b[i]! * b[i]!;
      }
      // NaN compares false both ways: a non-finite value disagrees, and stays the worst
      if (!Number.isNaN(worst) && !(c >= worst)) {
        worst = c;
        if (!(c >= this.minCosine)) {
          const where =
            mode === "each"
              ? `token ${tokens[Math.floor(s / k)]} slot ${s % k} (expert ${ids[s]})`
              : `token ${tokens[s]}`;
          reason = Number.isNaN(c)
            ? `a non-finite value at ${where}`
            : `cosine ${c.toFixed(6)} < ${this.minCosine} at ${where}`;
        }
      }
    }
    if (reason === undefined) {
      const ratio = rr === 0 ? (yy === 0 ? 1 : Number.POSITIVE_INFINITY) : Math.sqrt(yy / rr);
      if (!(Math.abs(ratio - 1) <= this.normTolerance)) {
        reason = `norm ratio ${ratio.toFixed(6)} is off by more than ${this.normTolerance}`;
      }
    }
    return { cosine: worst, reason };
  }

  /** The counters, the quarantined workers and the strikes: a plain object. */
  snapshot(): SpotCheckSnapshot {
    const strikes = Object.create(null) as Record<string, number>;
    for (const [id, n] of this.#strikes) strikes[id] = n;
    return { ...this.#counts, quarantined: this.quarantined(), strikes };
  }
}

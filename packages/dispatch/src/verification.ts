import { getRandomValues } from "node:crypto";
import type { ExpertHandler } from "@moeswarm/core";
import { InvalidArgumentError, mulberry32 } from "@moeswarm/core";
import { DEFAULT_MIN_COSINE, DEFAULT_NORM_TOLERANCE, type PartComparison, SpotCheck } from "./spot-check.js";

// Redundant execution (issue 14: "no wrong token with default settings"). With trust "verify" every
// part a stranger answers is answered by TWO distinct owners that both hold all its experts; the
// two answers are compared (bit for bit when both owners report the same compute class, else with
// the SpotCheck tolerance); on a mismatch a third opinion (the local reference or fallback, else a
// third owner) decides, the answer that agrees with it is used and the other owner is quarantined
// at once, with the evidence handed to `onQuarantine` (the backbone reports it to the hub).
//
// What it cannot see, said plainly: two owners that COLLUDE (hold the same part and return the same
// wrong answer) agree with each other, and redundant execution takes their answer. Against that,
// a SpotCheck with a local `reference` on top (dispatch's `verify`) re-computes a sampled share of
// the parts locally: a colluding pair is caught at the first sampled part (with fraction f, after
// 1/f of their parts on average), and both are quarantined then; the parts before that are wrong.
// Placement must make collusion expensive (the hub's replicas on independent identities).
//
// Against colluders that lie from the start, an AUDIT against the local third opinion (the
// reference or the fallback, when the call has one): a worker's first `probation` agreed answers,
// and a sampled `auditRate` of the agreed answers afterwards, are compared with the local
// re-computation BEFORE they are used, so a lie caught this way never reaches the combine (nor
// llama.cpp's KV cache). Every owner whose answer the audit disproves is convicted: a colluder and
// its twin that returned the same bits go together.

/**
 * Default probation: a worker's first 8 agreed answers are audited locally. A liar that lies from
 * its first answer is caught at it; 8 rather than 1 because one decode step asks a worker once per
 * remote layer, and an attacker cannot know which of its first answers are audited only if a few
 * steps' worth are (8 = two tokens of a 4-layer model, one of an 8-layer one). Its cost is paid once
 * per worker and backbone process: 8 local computes of one part each.
 */
export const DEFAULT_PROBATION = 8;

/**
 * Default share of agreed answers audited after probation: 2%. A patient pair that is the only
 * holder of a part and lies after probation is caught at its first sampled lie; the expected
 * number of lies used before that is (1 - r) / r = 49 parts at r = 0.02. The cost is r local
 * computes per part (2% of the worker compute, done on the backbone).
 */
export const DEFAULT_AUDIT_RATE = 0.02;

/** What a quarantine proved; the body of the hub's quarantine report, plus the experts. */
export interface VerificationEvent {
  readonly worker: string;
  readonly layer: number;
  readonly experts: readonly number[];
  /** Why, for logs (<= 512 bytes). */
  readonly reason: string;
  /** sha256 (hex) of the request payload the lie answered (x, ids, w bytes, in that order). */
  readonly requestDigest: string;
  /** The agreed answer's L2 norm, and the lie's with its cosine to the agreed answer (worst slot). */
  readonly expected: { readonly norm: number };
  readonly got: { readonly norm: number; readonly cosine: number };
  /** Who decided: "reference" (local compute) or the third owner's id. */
  readonly decidedBy: string;
  /** Unix ms. */
  readonly at: number;
}

export interface VerificationOptions {
  /**
   * The third opinion on a mismatch, computed here (the backbone's own weights). Without it the
   * dispatch call's `fallback` is used, else a third owner of all the part's experts.
   */
  readonly reference?: ExpertHandler;
  /**
   * A worker's compute class (e.g. `${backend}/${arch}`): two owners of the same class must agree
   * bit for bit; of different classes, within the tolerance. Undefined (or no function): same class.
   */
  readonly computeClass?: (worker: string) => string | undefined;
  /** Tolerance between owners of different classes; defaults as SpotCheck's. */
  readonly minCosine?: number;
  readonly normTolerance?: number;
  /** How long a quarantine lasts, ms (default: until {@link Verification.release}). */
  readonly quarantineMs?: number;
  /** Called once per quarantine; an exception it throws is ignored. */
  readonly onQuarantine?: (event: VerificationEvent) => void;
  /**
   * Agreed answers of a new worker audited against the local third opinion before they are used
   * (needs a reference or a fallback); default {@link DEFAULT_PROBATION}, 0 turns it off.
   */
  readonly probation?: number;
  /** Share of agreed answers audited after probation, in [0, 1]; default {@link DEFAULT_AUDIT_RATE}. */
  readonly auditRate?: number;
  /** Seed of the audit sampling PRNG, a uint32 (default: random). */
  readonly seed?: number;
}

export interface VerificationStats {
  /** Parts answered by two owners that agreed (or decided by a third opinion). */
  partsVerified: number;
  /** Pairs that disagreed. */
  disagreements: number;
  /** Third opinions asked (local or a third owner). */
  thirdOpinions: number;
  /** Quarantines started, ever, and the workers quarantined now. */
  quarantines: number;
  quarantined: string[];
  /** Parts only one untrusted owner holds, served by the local fallback instead. */
  unverifiableLocal: number;
  /** Parts that failed with MOESWARM_VERIFY_FAILED / MOESWARM_VERIFY_UNAVAILABLE. */
  failed: number;
  /** Payload bytes (out + in) and worker-reported compute ms spent on second and third opinions. */
  extraBytes: number;
  extraComputeMs: number;
  /** Agreed answers audited against the local reference (probation + sampled), and those it disproved. */
  audits: number;
  auditDisagreements: number;
  /** Wall ms of the local computes of audits. */
  auditMs: number;
  /** Pairs not formed because both owners belong to one principal (counted once per part). */
  samePrincipal: number;
}

/**
 * Every counter at zero and no worker quarantined: the stats of a new Verification (a bridge under
 * trust "own" reports them throughout), a fresh object each call, for callers and tests alike.
 */
export function emptyVerificationStats(): VerificationStats {
  return {
    partsVerified: 0,
    disagreements: 0,
    thirdOpinions: 0,
    quarantines: 0,
    quarantined: [],
    unverifiableLocal: 0,
    failed: 0,
    extraBytes: 0,
    extraComputeMs: 0,
    audits: 0,
    auditDisagreements: 0,
    auditMs: 0,
    samePrincipal: 0,
  };
}

/**
 * The state of trust "verify", shared by every call of a dispatcher (pass it as `verification`;
 * without one, an untrusted transport gets its own): the quarantine and the counters.
 */
export class Verification {
  readonly reference: ExpertHandler | undefined;
  readonly quarantineMs: number | undefined;
  readonly #classOf: ((worker: string) => string | undefined) | undefined;
  readonly #onQuarantine: ((event: VerificationEvent) => void) | undefined;
  /** Holds the tolerance; its compare is the one spot checks use. */
  readonly #tolerance: SpotCheck;
  readonly #quarantine = new Map<string, number>();
  readonly #events: VerificationEvent[] = [];
  /** The counters; `quarantined` here stays empty: {@link stats} reads the quarantine itself. */
  readonly #s = emptyVerificationStats();
  readonly probation: number;
  readonly auditRate: number;
  /** Audits each worker passed (probation ends at `probation`). */
  readonly #passed = new Map<string, number>();
  readonly #random: () => number;

  constructor(options: VerificationOptions = {}) {
    if (typeof options !== "object" || options === null)
      throw new InvalidArgumentError("Verification: options must be an object");
    const { reference, computeClass, quarantineMs, onQuarantine } = options;
    if (reference !== undefined && typeof reference !== "function")
      throw new InvalidArgumentError("Verification: reference must be a function");
    if (computeClass !== undefined && typeof computeClass !== "function")
      throw new InvalidArgumentError("Verification: computeClass must be a function");
    if (onQuarantine !== undefined && typeof onQuarantine !== "function")
      throw new InvalidArgumentError("Verification: onQuarantine must be a function");
    if (quarantineMs !== undefined && !(Number.isFinite(quarantineMs) && quarantineMs > 0)) {
      throw new InvalidArgumentError(
        `Verification: quarantineMs must be a positive finite number, got ${String(quarantineMs)}`,
      );
    }
    const { probation, auditRate, seed } = options;
    if (probation !== undefined && !(Number.isInteger(probation) && probation >= 0 && probation <= 1e6))
      throw new InvalidArgumentError(
        `Verification: probation must be an integer >= 0, got ${String(probation)}`,
      );
    if (auditRate !== undefined && !(typeof auditRate === "number" && auditRate >= 0 && auditRate <= 1))
      throw new InvalidArgumentError(`Verification: auditRate must be in [0, 1], got ${String(auditRate)}`);
    if (seed !== undefined && !(Number.isInteger(seed) && seed >= 0 && seed <= 0xffff_ffff))
      throw new InvalidArgumentError(
        `Verification: seed must be an integer in [0, 2^32), got ${String(seed)}`,
      );
    this.probation = probation ?? DEFAULT_PROBATION;
    this.auditRate = auditRate ?? DEFAULT_AUDIT_RATE;
    this.#random = mulberry32(seed ?? getRandomValues(new Uint32Array(1))[0]!);
    this.reference = reference;
    this.quarantineMs = quarantineMs;
    this.#classOf = computeClass;
    this.#onQuarantine = onQuarantine;
    // SpotCheck validates the tolerance (fraction 0: it never samples)
    this.#tolerance = new SpotCheck({
      fraction: 0,
      seed: 0,
      minCosine: options.minCosine ?? DEFAULT_MIN_COSINE,
      normTolerance: options.normTolerance ?? DEFAULT_NORM_TOLERANCE,
    });
  }

  /**
   * Whether two owners must agree bit for bit: same compute class, or unknown. The class comes
   * from `computeClass`, else from the placement's registrations.
   */
  sameClass(a: string, b: string, placement?: { computeClass(id: string): string | undefined }): boolean {
    const of = this.#classOf ?? (placement ? (id: string) => placement.computeClass(id) : undefined);
    if (!of) return true;
    const ca = of(a);
    const cb = of(b);
    return ca === undefined || cb === undefined || ca === cb;
  }

  /**
   * @internal whether an agreed answer of these owners is audited now: one of them is on
   * probation, or the sampled rate draws it (one draw per agreed part).
   */
  shouldAudit(workers: readonly string[]): boolean {
    if (workers.some((w) => (this.#passed.get(w) ?? 0) < this.probation)) return true;
    return this.auditRate > 0 && this.#random() < this.auditRate;
  }

  /** @internal an audit confirmed this worker's answer. */
  passed(worker: string): void {
    this.#passed.set(worker, (this.#passed.get(worker) ?? 0) + 1);
  }

  /** @internal an audit ran (ms of local compute) and how many answers it disproved. */
  audited(ms: number, disproved: number): void {
    this.#s.audits++;
    this.#s.auditMs += ms;
    if (disproved > 0) this.#s.auditDisagreements++;
  }

  /**
   * @internal compares two answers laid out as the part's request asked. `exact`: every value read
   * by the combine must be the same bits; else the SpotCheck tolerance.
   */
  compare(
    exact: boolean,
    part: {
      mode: "each" | "sum";
      n: number;
      k: number;
      embd: number;
      ids: Int32Array;
      tokens: Int32Array;
    },
    a: Float32Array | Float64Array,
    b: Float32Array | Float64Array,
  ): PartComparison {
    const { mode, n, k, embd, ids, tokens } = part;
    const c = this.#tolerance.compare(mode, n, k, embd, ids, tokens, a, b);
    if (!exact || c.reason !== undefined) return c;
    const rows = mode === "each" ? n * k : n;
    for (let s = 0; s < rows; s++) {
      if (mode === "each" && ids[s]! < 0) continue;
      for (let i = s * embd; i < (s + 1) * embd; i++) {
        // Object.is: +0 and -0 differ in bits, NaN equals NaN (never reached: results are finite)
        if (!Object.is(a[i], b[i])) {
          const where =
            mode === "each" ? `token ${tokens[Math.floor(s / k)]} slot ${s % k}` : `token ${tokens[s]}`;
          return { cosine: c.cosine, reason: `not bit-identical at ${where} (${a[i]} vs ${b[i]})` };
        }
      }
    }
    return c;
  }

  /** Whether a worker is quarantined now (an expired quarantine ends here). */
  isQuarantined(id: string): boolean {
    const until = this.#quarantine.get(id);
    if (until === undefined) return false;
    if (performance.now() < until) return true;
    this.#quarantine.delete(id);
    return false;
  }

  /** The workers quarantined now. */
  quarantined(): string[] {
    return [...this.#quarantine.keys()].filter((id) => this.isQuarantined(id));
  }

  /** @internal the quarantined workers, for `Placement.choose`'s `exclude`. */
  excluded(): Set<string> {
    return new Set(this.quarantined());
  }

  /** Ends a worker's quarantine. Returns whether it was quarantined. */
  release(id: string): boolean {
    return this.#quarantine.delete(id);
  }

  /** Quarantines a worker now (e.g. the hub reported it), without an event. */
  quarantine(id: string): void {
    this.#quarantine.set(
      id,
      this.quarantineMs === undefined ? Number.POSITIVE_INFINITY : performance.now() + this.quarantineMs,
    );
  }

  /** @internal a proven lie: quarantine at once and tell `onQuarantine`. */
  convict(event: VerificationEvent): void {
    if (this.isQuarantined(event.worker)) return;
    this.quarantine(event.worker);
    this.#s.quarantines++;
    this.#events.push(event);
    if (this.#events.length > 100) this.#events.shift();
    try {
      this.#onQuarantine?.(event);
    } catch {
      // a reporting callback must not turn a corrected answer into a failed call
    }
  }

  /** @internal counters. */
  count(
    what:
      | "partsVerified"
      | "disagreements"
      | "thirdOpinions"
      | "unverifiableLocal"
      | "failed"
      | "samePrincipal",
  ): void {
    this.#s[what]++;
  }

  /** @internal cost of an extra opinion. */
  spent(bytes: number, computeMs: number | undefined): void {
    this.#s.extraBytes += bytes;
    if (typeof computeMs === "number" && Number.isFinite(computeMs)) this.#s.extraComputeMs += computeMs;
  }

  /** The last quarantines' evidence (up to 100), oldest first. */
  events(): VerificationEvent[] {
    return [...this.#events];
  }

  stats(): VerificationStats {
    return { ...this.#s, quarantined: this.quarantined() };
  }
}

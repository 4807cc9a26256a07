// Credits for direct traffic. Requests on a direct link never cross the relay, so the hub has no
// forward count to bound a backbone's receipts by. Instead each side reports its own half, with
// its own token: the worker what it answered per backbone (POST /api/workers/:id/direct/served),
// the backbone what it accepted per worker (the part of its stats receipts beyond what the relay
// forwarded). The hub credits the pair the minimum of the two, and only for a pair it minted a
// ticket for. Neither peer speaks for the other: a worker over-reporting gains nothing beyond what
// the backbone accepted, a backbone cannot credit a worker that did not claim the work, and what
// either side reported and the other did not (yet) waits, then lapses.
import type { DirectServedJson } from "@moeswarm/core";
import { badRequest } from "./http-errors.js";
import type { DirectPendingRow, DirectSeqRow, DirectWrite } from "./store-direct.js";

/** How long one side's unmatched count waits for the other side's (ms). */
export const DIRECT_MATCH_WINDOW_MS = 15 * 60_000;
/** Entries in one worker report. */
export const MAX_SERVED_ENTRIES = 1024;
/** Pairs with something pending; past this the stalest are dropped (counted as evicted). */
export const MAX_PENDING = 100_000;

interface Pending {
  readonly backbone: string;
  readonly worker: string;
  readonly model: string;
  /** Expert-tokens the worker said it answered, not matched yet. */
  workerCount: number;
  /** Expert-tokens the backbone said it accepted beyond the relay's forwards, not matched yet. */
  backboneCount: number;
  /** The last time either side reported (hub clock); untouched past the window, dropped. */
  at: number;
}

type Side = "worker" | "backbone";

/** One pair's result of a worker report. */
export interface DirectServedOutcome {
  /** false for a retry (seq not above the last one taken): nothing was counted again. */
  accepted: boolean;
  /** Expert-tokens credited now, by backbone and model. */
  credited: Array<{ backbone: string; model: string; expertTokens: number }>;
  /** Entries naming a backbone this hub never gave a ticket to this worker (not counted). */
  refused: Array<{ backbone: string; model: string }>;
}

/** The unmatched halves now, per side (for /metrics). */
export interface DirectPendingFigures {
  /** Pairs (backbone, worker, model) with an unmatched count on this side. */
  halves: Record<Side, number>;
  /** Their expert-tokens. */
  expertTokens: Record<Side, number>;
  /** Age of the oldest (since the last report that touched its pair), ms; 0 when there is none. */
  oldestMs: Record<Side, number>;
  /** Expert-tokens dropped unmatched since this hub started: past the window, or past the bound. */
  lapsed: Record<"expired" | "evicted", Record<Side, number>>;
}

export interface DirectCreditOptions {
  clock: () => number;
  /** Whether the hub minted `backbone` a ticket to `worker` (DirectKeys.ticketed). */
  ticketed(backbone: string, worker: string): boolean;
  windowMs?: number;
  /** Pairs kept pending at most (default MAX_PENDING). */
  maxPending?: number;
}

const key = (backbone: string, worker: string, model: string) => `${backbone}\0${worker}\0${model}`;

/**
 * Both sides' unmatched counts per backbone, worker and model; credits their minimum. What changed
 * is handed to the store by `takeChanges` (market-book.ts writes it before the credits).
 */
export class DirectCredit {
  readonly #o: DirectCreditOptions;
  readonly #windowMs: number;
  readonly #max: number;
  /** Insertion order is last-touched order (re-inserted on every report). */
  readonly #pending = new Map<string, Pending>();
  /** The last seq taken per worker. */
  readonly #seq = new Map<string, number>();
  /** Pairs changed (or dropped) since the last takeChanges, with their identity. */
  #dirty = new Map<string, { backbone: string; worker: string; model: string }>();
  #dirtySeq = new Map<string, number>();
  readonly #lapsed = {
    expired: { worker: 0, backbone: 0 },
    evicted: { worker: 0, backbone: 0 },
  };

  constructor(options: DirectCreditOptions) {
    this.#o = options;
    this.#windowMs = options.windowMs ?? DIRECT_MATCH_WINDOW_MS;
    this.#max = options.maxPending ?? MAX_PENDING;
  }

  /** What the store kept (a restart): pending halves, oldest first, and the last seqs. */
  load(state: { pending: readonly DirectPendingRow[]; seqs: readonly DirectSeqRow[] }): void {
    for (const r of [...state.pending].sort((a, b) => a.at - b.at)) {
      const k = key(r.backbone, r.worker, r.model);
      this.#pending.delete(k);
      this.#pending.set(k, {
        backbone: r.backbone,
        worker: r.worker,
        model: r.model,
        workerCount: r.workerExpertTokens,
        backboneCount: r.backboneExpertTokens,
        at: r.at,
      });
    }
    for (const q of state.seqs) this.#seq.set(q.worker, Math.max(this.#seq.get(q.worker) ?? q.seq, q.seq));
    this.#expire();
  }

  /**
   * The backbone's half: expert-tokens it accepted from `worker` beyond what the relay forwarded.
   * Returns what is credited now (0 for a pair without a ticket: that excess is just cut).
   */
  fromBackbone(backbone: string, worker: string, model: string, expertTokens: number): number {
    if (!(expertTokens > 0) || !this.#o.ticketed(backbone, worker)) return 0;
    return this.#add(backbone, worker, model, "backbone", expertTokens);
  }

  /** The worker's half (its report, already parsed): what is credited now, per entry. */
  fromWorker(worker: string, report: DirectServedJson): DirectServedOutcome {
    const last = this.#seq.get(worker);
    if (last !== undefined && report.seq <= last) return { accepted: false, credited: [], refused: [] };
    this.#seq.set(worker, report.seq);
    this.#dirtySeq.set(worker, report.seq);
    const credited: DirectServedOutcome["credited"] = [];
    const refused: DirectServedOutcome["refused"] = [];
    for (const e of report.served) {
      if (!this.#o.ticketed(e.backbone, worker)) {
        refused.push({ backbone: e.backbone, model: e.model });
        continue;
      }
      const n = this.#add(e.backbone, worker, e.model, "worker", e.expertTokens);
      credited.push({ backbone: e.backbone, model: e.model, expertTokens: n });
    }
    return { accepted: true, credited, refused };
  }

  /** Unmatched counts of one pair (tests, diagnostics). */
  pending(backbone: string, worker: string, model: string): { worker: number; backbone: number } {
    this.#expire();
    const p = this.#pending.get(key(backbone, worker, model));
    return { worker: p?.workerCount ?? 0, backbone: p?.backboneCount ?? 0 };
  }

  /** The unmatched halves now, and what lapsed since start. */
  figures(): DirectPendingFigures {
    this.#expire();
    const now = this.#o.clock();
    const f: DirectPendingFigures = {
      halves: { worker: 0, backbone: 0 },
      expertTokens: { worker: 0, backbone: 0 },
      oldestMs: { worker: 0, backbone: 0 },
      lapsed: { expired: { ...this.#lapsed.expired }, evicted: { ...this.#lapsed.evicted } },
    };
    // last-touched order: the first pair with a count on a side is that side's oldest
    for (const p of this.#pending.values()) {
      for (const [side, n] of [
        ["worker", p.workerCount],
        ["backbone", p.backboneCount],
      ] as const) {
        if (n === 0) continue;
        if (f.halves[side] === 0) f.oldestMs[side] = Math.max(0, now - p.at);
        f.halves[side]++;
        f.expertTokens[side] += n;
      }
    }
    return f;
  }

  /** What changed since the last call, for the store (undefined: nothing). */
  takeChanges(): Pick<DirectWrite, "pending" | "seqs"> | undefined {
    this.#expire();
    if (this.#dirty.size === 0 && this.#dirtySeq.size === 0) return undefined;
    const pending: DirectPendingRow[] = [];
    for (const [k, id] of this.#dirty) {
      const p = this.#pending.get(k);
      pending.push({
        ...id,
        workerExpertTokens: p?.workerCount ?? 0,
        backboneExpertTokens: p?.backboneCount ?? 0,
        at: p?.at ?? 0,
      });
    }
    const seqs = [...this.#dirtySeq].map(([worker, seq]) => ({ worker, seq }));
    this.#dirty = new Map();
    this.#dirtySeq = new Map();
    return { pending, seqs };
  }

  /** A write of `takeChanges` failed: those pairs and seqs are written with the next one. */
  restoreChanges(change: Pick<DirectWrite, "pending" | "seqs">): void {
    for (const r of change.pending) {
      const k = key(r.backbone, r.worker, r.model);
      if (!this.#dirty.has(k)) this.#dirty.set(k, { backbone: r.backbone, worker: r.worker, model: r.model });
    }
    for (const q of change.seqs) {
      if (!this.#dirtySeq.has(q.worker)) this.#dirtySeq.set(q.worker, q.seq);
    }
  }

  #add(backbone: string, worker: string, model: string, side: Side, n: number): number {
    this.#expire();
    const k = key(backbone, worker, model);
    const now = this.#o.clock();
    const p = this.#pending.get(k) ?? { backbone, worker, model, workerCount: 0, backboneCount: 0, at: now };
    this.#pending.delete(k);
    if (side === "worker") p.workerCount += n;
    else p.backboneCount += n;
    p.at = now;
    const matched = Math.min(p.workerCount, p.backboneCount);
    p.workerCount -= matched;
    p.backboneCount -= matched;
    if (p.workerCount > 0 || p.backboneCount > 0) this.#pending.set(k, p);
    this.#dirty.set(k, { backbone, worker, model });
    if (this.#pending.size > this.#max) this.#drop(this.#pending.keys().next().value as string, "evicted");
    return matched;
  }

  #drop(k: string, why: "expired" | "evicted"): void {
    const p = this.#pending.get(k);
    if (!p) return;
    this.#pending.delete(k);
    this.#lapsed[why].worker += p.workerCount;
    this.#lapsed[why].backbone += p.backboneCount;
    this.#dirty.set(k, { backbone: p.backbone, worker: p.worker, model: p.model });
  }

  #expire(): void {
    const cutoff = this.#o.clock() - this.#windowMs;
    for (const [k, p] of this.#pending) {
      if (p.at >= cutoff) break; // last-touched order: the rest are newer
      this.#drop(k, "expired");
    }
  }
}

/** Checks a worker's `POST /api/workers/:id/direct/served` body. */
export function parseDirectServed(body: unknown): DirectServedJson {
  const shape =
    '{"seq": n, "served": [{"backbone": "<id>", "model": "<id>", "expertTokens": n, "requests": n}, ...]}';
  if (typeof body !== "object" || body === null || Array.isArray(body))
    throw badRequest(`the body must be ${shape}`);
  const { seq, served } = body as Record<string, unknown>;
  if (!Number.isSafeInteger(seq) || (seq as number) < 0) throw badRequest('"seq" must be an integer >= 0');
  if (!Array.isArray(served) || served.length > MAX_SERVED_ENTRIES) {
    throw badRequest(`"served" must list at most ${MAX_SERVED_ENTRIES} entries: ${shape}`);
  }
  const out: DirectServedJson["served"] = [];
  const seen = new Set<string>();
  for (const e of served) {
    const { backbone, model, expertTokens, requests } = (e ?? {}) as Record<string, unknown>;
    const count = (v: unknown) => Number.isSafeInteger(v) && (v as number) >= 0;
    if (
      typeof backbone !== "string" ||
      backbone.length === 0 ||
      backbone.length > 128 ||
      typeof model !== "string" ||
      model.length === 0 ||
      model.length > 128 ||
      !count(expertTokens) ||
      (requests !== undefined && !count(requests))
    ) {
      throw badRequest(`each "served" entry must be {"backbone", "model", "expertTokens", "requests"?}`);
    }
    const k = `${backbone}\0${model}`;
    // one entry per pair: a duplicate would count the same work twice on the worker's side
    if (seen.has(k)) throw badRequest(`"served" names backbone ${backbone} and model ${model} twice`);
    seen.add(k);
    out.push({
      backbone,
      model,
      expertTokens: expertTokens as number,
      ...(requests !== undefined ? { requests: requests as number } : {}),
    });
  }
  return { seq: seq as number, served: out };
}

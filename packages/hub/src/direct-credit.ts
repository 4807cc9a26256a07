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

/** How long one side's unmatched count waits for the other side's (ms). */
export const DIRECT_MATCH_WINDOW_MS = 15 * 60_000;
/** Entries in one worker report. */
export const MAX_SERVED_ENTRIES = 1024;
/** Pairs with something pending; past this the stalest are dropped. */
const MAX_PENDING = 100_000;

interface Pending {
  /** Expert-tokens the worker said it answered, not matched yet. */
  worker: number;
  /** Expert-tokens the backbone said it accepted beyond the relay's forwards, not matched yet. */
  backbone: number;
  /** The last time either side reported (hub clock); untouched past the window, dropped. */
  at: number;
}

/** One pair's result of a worker report. */
export interface DirectServedOutcome {
  /** false for a retry (seq not above the last one taken): nothing was counted again. */
  accepted: boolean;
  /** Expert-tokens credited now, by backbone and model. */
  credited: Array<{ backbone: string; model: string; expertTokens: number }>;
  /** Entries naming a backbone this hub never gave a ticket to this worker (not counted). */
  refused: Array<{ backbone: string; model: string }>;
}

export interface DirectCreditOptions {
  clock: () => number;
  /** Whether the hub minted `backbone` a ticket to `worker` (DirectKeys.ticketed). */
  ticketed(backbone: string, worker: string): boolean;
  windowMs?: number;
}

const key = (backbone: string, worker: string, model: string) => `${backbone}\0${worker}\0${model}`;

/** Both sides' unmatched counts per backbone, worker and model; credits their minimum. */
export class DirectCredit {
  readonly #o: DirectCreditOptions;
  readonly #windowMs: number;
  /** Insertion order is last-touched order (re-inserted on every report). */
  readonly #pending = new Map<string, Pending>();
  /** The last seq taken per worker. */
  readonly #seq = new Map<string, number>();

  constructor(options: DirectCreditOptions) {
    this.#o = options;
    this.#windowMs = options.windowMs ?? DIRECT_MATCH_WINDOW_MS;
  }

  /**
   * The backbone's half: expert-tokens it accepted from `worker` beyond what the relay forwarded.
   * Returns what is credited now (0 for a pair without a ticket: that excess is just cut).
   */
  fromBackbone(backbone: string, worker: string, model: string, expertTokens: number): number {
    if (!(expertTokens > 0) || !this.#o.ticketed(backbone, worker)) return 0;
    return this.#add(key(backbone, worker, model), "backbone", expertTokens);
  }

  /** The worker's half (its report, already parsed): what is credited now, per entry. */
  fromWorker(worker: string, report: DirectServedJson): DirectServedOutcome {
    const last = this.#seq.get(worker);
    if (last !== undefined && report.seq <= last) return { accepted: false, credited: [], refused: [] };
    this.#seq.set(worker, report.seq);
    const credited: DirectServedOutcome["credited"] = [];
    const refused: DirectServedOutcome["refused"] = [];
    for (const e of report.served) {
      if (!this.#o.ticketed(e.backbone, worker)) {
        refused.push({ backbone: e.backbone, model: e.model });
        continue;
      }
      const n = this.#add(key(e.backbone, worker, e.model), "worker", e.expertTokens);
      credited.push({ backbone: e.backbone, model: e.model, expertTokens: n });
    }
    return { accepted: true, credited, refused };
  }

  /** Unmatched counts of one pair (tests, diagnostics). */
  pending(backbone: string, worker: string, model: string): { worker: number; backbone: number } {
    this.#expire();
    const p = this.#pending.get(key(backbone, worker, model));
    return { worker: p?.worker ?? 0, backbone: p?.backbone ?? 0 };
  }

  #add(k: string, side: "worker" | "backbone", n: number): number {
    this.#expire();
    const now = this.#o.clock();
    const p = this.#pending.get(k) ?? { worker: 0, backbone: 0, at: now };
    this.#pending.delete(k);
    p[side] += n;
    p.at = now;
    const matched = Math.min(p.worker, p.backbone);
    p.worker -= matched;
    p.backbone -= matched;
    if (p.worker > 0 || p.backbone > 0) this.#pending.set(k, p);
    if (this.#pending.size > MAX_PENDING) this.#pending.delete(this.#pending.keys().next().value as string);
    return matched;
  }

  #expire(): void {
    const cutoff = this.#o.clock() - this.#windowMs;
    for (const [k, p] of this.#pending) {
      if (p.at >= cutoff) break; // last-touched order: the rest are newer
      this.#pending.delete(k);
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

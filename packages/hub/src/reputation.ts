// Reputation at the hub: a backbone that caught a worker answering wrong reports it with evidence
// (POST /api/models/:model/reports/quarantine); the hub keeps the quarantine (store-reports.ts)
// and applies it for every backbone: the worker's leases end, its registrations are withdrawn,
// its connection is closed, and its id may not say hello, register or claim again until an admin
// reinstates it. A new id comes only from a token the operator mints (tokens are bound to ids).
import { HubError, TransportError } from "@moeswarm/core";
import { isWorkerId } from "./market.js";
import type { QuarantineEvidence, QuarantineRecord, ReportStore } from "./store-reports.js";

/** Largest quarantine report body, bytes. */
export const MAX_REPORT_BYTES = 8 * 1024;

export interface ReputationOptions {
  reports: ReportStore;
  clock: () => number;
  /** Reports one backbone may file per minute (default 10). */
  reportsPerMinute?: number;
}

function bad(message: string): HubError {
  return new HubError("MOESWARM_HUB_BAD_REQUEST", `quarantine report: ${message}`);
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function summary(v: unknown, name: string): { norm?: number; cosine?: number } | undefined {
  if (v === undefined) return undefined;
  if (!isObject(v)) throw bad(`${name} must be an object {"norm"?, "cosine"?}`);
  const out: { norm?: number; cosine?: number } = {};
  for (const key of Object.keys(v)) {
    if (key !== "norm" && key !== "cosine") throw bad(`${name} has an unknown field ${JSON.stringify(key)}`);
  }
  if (v.norm !== undefined) {
    if (typeof v.norm !== "number" || !Number.isFinite(v.norm) || v.norm < 0)
      throw bad(`${name}.norm must be a finite number >= 0`);
    out.norm = v.norm;
  }
  if (v.cosine !== undefined) {
    if (typeof v.cosine !== "number" || !(v.cosine >= -1 && v.cosine <= 1))
      throw bad(`${name}.cosine must be a number in -1..1`);
    out.cosine = v.cosine;
  }
  return out;
}

/** Checks a report body: {worker, layer, reason, requestDigest, expected?, got?, at}. */
export function parseEvidence(body: unknown): QuarantineEvidence {
  if (!isObject(body)) throw bad("the body must be a JSON object");
  const { worker, layer, reason, requestDigest, at } = body;
  if (!isWorkerId(worker)) throw bad("worker must be an id of 1..128 bytes");
  if (!Number.isSafeInteger(layer) || (layer as number) < 0 || (layer as number) > 65_535)
    throw bad("layer must be an integer in 0..65535");
  if (typeof reason !== "string" || reason.length === 0 || Buffer.byteLength(reason) > 512)
    throw bad("reason must be a string of 1..512 bytes");
  if (typeof requestDigest !== "string" || !/^[0-9a-f]{64}$/.test(requestDigest))
    throw bad("requestDigest must be the sha256 of the dispatch payload, 64 lowercase hex digits");
  if (!Number.isSafeInteger(at) || (at as number) < 0) throw bad("at must be a time in unix ms");
  const evidence: QuarantineEvidence = {
    worker,
    layer: layer as number,
    reason,
    requestDigest,
    at: at as number,
  };
  const expected = summary(body.expected, "expected");
  const got = summary(body.got, "got");
  if (expected) evidence.expected = expected;
  if (got) evidence.got = got;
  return evidence;
}

export class Reputation {
  readonly #o: ReputationOptions;
  readonly #quarantined = new Map<string, QuarantineRecord>();
  /** Per backbone: times of its recent reports (a sliding minute). */
  readonly #recent = new Map<string, number[]>();

  constructor(options: ReputationOptions) {
    this.#o = options;
  }

  async load(): Promise<void> {
    for (const r of await this.#o.reports.list()) this.#quarantined.set(r.worker, r);
  }

  isQuarantined(worker: string): boolean {
    return this.#quarantined.has(worker);
  }

  get(worker: string): QuarantineRecord | undefined {
    const r = this.#quarantined.get(worker);
    return r && structuredClone(r);
  }

  list(): QuarantineRecord[] {
    return [...this.#quarantined.values()].map((r) => structuredClone(r));
  }

  /** Refuses a backbone past its rate (TransportError MOESWARM_TRANSPORT_LIMIT, answered 429). */
  #rate(backbone: string, now: number): void {
    const limit = this.#o.reportsPerMinute ?? 10;
    const times = (this.#recent.get(backbone) ?? []).filter((t) => now - t < 60_000);
    if (times.length >= limit) {
      throw new TransportError(
        "MOESWARM_TRANSPORT_LIMIT",
        `backbone ${backbone} filed ${limit} reports in the last minute`,
        {
          details: { limit },
        },
      );
    }
    times.push(now);
    this.#recent.set(backbone, times);
  }

  /** Records a quarantine (written before it is answered); the caller applies it. */
  async quarantine(backbone: string, model: string, evidence: QuarantineEvidence): Promise<QuarantineRecord> {
    const now = this.#o.clock();
    this.#rate(backbone, now);
    const record: QuarantineRecord = { worker: evidence.worker, at: now, by: backbone, model, evidence };
    await this.#o.reports.put(record);
    this.#quarantined.set(record.worker, record);
    return structuredClone(record);
  }

  /** Lifts a quarantine; false when the worker was not quarantined. */
  async reinstate(worker: string): Promise<boolean> {
    if (!this.#quarantined.has(worker)) return false;
    await this.#o.reports.delete(worker);
    this.#quarantined.delete(worker);
    return true;
  }

  close(): Promise<void> {
    return this.#o.reports.close();
  }
}

/** The error a quarantined id is refused with (hello, register, claims). */
export function bannedError(worker: string): HubError {
  return new HubError(
    "MOESWARM_HUB_BANNED",
    `worker ${JSON.stringify(worker)} is quarantined on this hub (a backbone reported wrong answers); an admin may reinstate it`,
  );
}

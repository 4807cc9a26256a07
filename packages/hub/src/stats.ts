import { HubError } from "@moeswarm/core";
import { isWorkerId, type MarketModel } from "./market.js";

/**
 * A backbone's periodic report (POST /api/models/:model/stats, JSON), checked against the
 * model. Field by field in README.md "Backbone stats".
 */
export interface StatsReport {
  /** The backbone's id when its token is not bound to one. */
  backbone?: string;
  /** Report sequence number of this backbone; a report whose seq is not above the last is a retry and ignored. */
  seq?: number;
  /** Tokens the backbone decoded (or prefilled) during the report's span. */
  tokens?: number;
  /** The span, ms. tokens/s = tokens / (ms / 1000). */
  ms?: number;
  /** Routing selections per MoE layer: one count per expert. */
  counts: Map<number, Uint32Array>;
  /** What each worker served the backbone during the span. */
  receipts: Map<string, Receipt>;
}

export interface Receipt {
  /** (token, expert) pairs the worker computed and returned. */
  expertTokens: number;
  /** Mean round trip the backbone measured, ms. */
  ms?: number;
}

/** Most workers one report may name. */
export const MAX_RECEIPTS = 4096;
const U32_MAX = 0xffff_ffff;

function bad(message: string): HubError {
  return new HubError("MOESWARM_HUB_BAD_REQUEST", `stats: ${message}`);
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function u32(v: unknown, what: string): number {
  if (!Number.isInteger(v) || (v as number) < 0 || (v as number) > U32_MAX) {
    throw bad(`${what} must be an integer in 0..${U32_MAX}`);
  }
  return v as number;
}

const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

function countsOf(value: unknown, n: number, layer: number): Uint32Array {
  if (typeof value === "string") {
    // base64 of n little-endian u32: 4/3 of the binary size, where a JSON array of large counts takes ~11 bytes each
    const expected = Math.ceil((4 * n) / 3) * 4;
    if (value.length !== expected || !BASE64.test(value)) {
      throw bad(
        `counts of layer ${layer}: a base64 string must hold ${n} little-endian uint32 (${expected} characters)`,
      );
    }
    const bytes = Buffer.from(value, "base64");
    if (bytes.byteLength !== 4 * n) throw bad(`counts of layer ${layer}: expected ${4 * n} bytes`);
    const out = new Uint32Array(n);
    for (let i = 0; i < n; i++) out[i] = bytes.readUInt32LE(4 * i);
    return out;
  }
  if (!Array.isArray(value)) throw bad(`counts of layer ${layer} must be an array or a base64 string`);
  if (value.length !== n) throw bad(`counts of layer ${layer} must have ${n} entries, not ${value.length}`);
  const out = new Uint32Array(n);
  for (let i = 0; i < n; i++) out[i] = u32(value[i], `counts[${layer}][${i}]`);
  return out;
}

/** Parses and checks a report body; HubError MOESWARM_HUB_BAD_REQUEST says what is wrong. */
export function parseStatsReport(body: unknown, model: MarketModel): StatsReport {
  if (!isObject(body)) throw bad("the body must be a JSON object");
  const report: StatsReport = { counts: new Map(), receipts: new Map() };
  if (body.backbone !== undefined) {
    if (!isWorkerId(body.backbone)) throw bad("backbone must be an id of 1..128 bytes");
    report.backbone = body.backbone;
  }
  if (body.seq !== undefined) {
    if (!Number.isSafeInteger(body.seq) || (body.seq as number) < 0) throw bad("seq must be an integer >= 0");
    report.seq = body.seq as number;
  }
  if (body.tokens !== undefined || body.ms !== undefined) {
    report.tokens = u32(body.tokens, "tokens");
    const ms = body.ms;
    if (typeof ms !== "number" || !Number.isFinite(ms) || ms <= 0 || ms > 86_400_000) {
      throw bad("ms (the span the report covers) must be a number in (0, 86400000] when tokens is given");
    }
    report.ms = ms;
  }
  if (body.counts !== undefined) {
    if (!isObject(body.counts)) throw bad('counts must be an object {"<layer>": [count per expert]}');
    const byLayer = new Map(model.layers.map((l) => [l.layer, l]));
    for (const [key, value] of Object.entries(body.counts)) {
      const layer = /^(0|[1-9][0-9]{0,8})$/.test(key) ? Number(key) : -1;
      const l = byLayer.get(layer);
      if (!l) throw bad(`counts: ${JSON.stringify(key.slice(0, 32))} is not a MoE layer of ${model.id}`);
      report.counts.set(layer, countsOf(value, l.nExpert, layer));
    }
  }
  if (body.receipts !== undefined) {
    if (!isObject(body.receipts))
      throw bad('receipts must be an object {"<worker id>": {"expertTokens": n}}');
    const entries = Object.entries(body.receipts);
    if (entries.length > MAX_RECEIPTS) throw bad(`receipts may name at most ${MAX_RECEIPTS} workers`);
    for (const [worker, r] of entries) {
      if (!isWorkerId(worker)) throw bad("receipts: worker ids are 1..128 bytes");
      if (!isObject(r)) throw bad(`receipts[${JSON.stringify(worker)}] must be an object`);
      const receipt: Receipt = {
        expertTokens: u32(r.expertTokens, `receipts[${JSON.stringify(worker)}].expertTokens`),
      };
      if (r.ms !== undefined) {
        if (typeof r.ms !== "number" || !Number.isFinite(r.ms) || r.ms < 0 || r.ms > 3_600_000) {
          throw bad(`receipts[${JSON.stringify(worker)}].ms must be a number of milliseconds`);
        }
        receipt.ms = r.ms;
      }
      report.receipts.set(worker, receipt);
    }
  }
  return report;
}

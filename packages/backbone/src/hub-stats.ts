import { AbortError, abortReason, linkedSignal, sleep } from "@moeswarm/core";
import { backoffDelay } from "@moeswarm/relay-client";
import { asError, type Emit, type HubLinkError, type StatsOutcome, stamp } from "./hub-events.js";
import { type HubHttp, isTransient } from "./hub-http.js";
import type { HubSettings } from "./hub-options.js";
import { isObject, REQUEST_TIMEOUT_MS } from "./hub-placement.js";
import type { BridgeStatsReport, StatsSource } from "./stats-report.js";

// The link's reports to the hub (`POST /api/models/:model/stats`): periodic, on demand, and a final
// one at close. One report at a time (`serialize`); a failed one stays pending and is sent again
// with the same seq, so the hub never counts it twice.

const U32_MAX = 0xffff_ffff;
const MAX_ANSWER_BYTES = 1024 * 1024;

const clampU32 = (v: number) => Math.min(U32_MAX, Math.max(0, Math.round(v)));

/** The hub's stats body, bounded to what it accepts. */
function reportBody(seq: number, backbone: string, r: BridgeStatsReport): Record<string, unknown> {
  const counts: Record<string, number[]> = {};
  for (const [layer, row] of Object.entries(r.counts)) counts[layer] = row.map(clampU32);
  const receipts: Record<string, { expertTokens: number; ms?: number }> = {};
  for (const [id, rec] of Object.entries(r.receipts)) {
    receipts[id] = {
      expertTokens: clampU32(rec.expertTokens),
      ...(rec.ms !== undefined && Number.isFinite(rec.ms)
        ? { ms: Math.min(3_600_000, Math.max(0, rec.ms)) }
        : {}),
    };
  }
  return {
    seq,
    backbone,
    tokens: clampU32(r.tokens),
    ms: Math.min(86_400_000, Math.max(0.001, r.ms)),
    counts,
    receipts,
  };
}

function isIdle(r: BridgeStatsReport): boolean {
  return r.tokens === 0 && Object.keys(r.counts).length === 0 && Object.keys(r.receipts).length === 0;
}

/** The hub's answer to a report, read leniently (a missing field is the default). */
function outcomeOf(seq: number, json: unknown): StatsOutcome {
  const a = (isObject(json) ? json : {}) as { accepted?: unknown; credited?: unknown; ignored?: unknown };
  const strings = (v: unknown) =>
    Array.isArray(v) ? v.filter((x): x is string => typeof x === "string") : [];
  return { seq, accepted: a.accepted !== false, credited: strings(a.credited), ignored: strings(a.ignored) };
}

export interface StatsReporterOptions {
  http: HubHttp;
  settings: HubSettings;
  emit: Emit;
  /** Routed experts per layer (the current placement's): the length of each counts row. */
  nExpert: () => number;
  /** Aborted when the link closes: the periodic loop ends, a report in flight is abandoned. */
  stop: AbortSignal;
}

export class StatsReporter {
  /** Where reports come from (the bridge sets itself); undefined: nothing to report. */
  source: StatsSource | undefined;
  readonly counters = {
    statsAccepted: 0,
    statsDuplicates: 0,
    statsErrors: 0,
    statsDropped: 0,
    lastStatsAt: undefined as number | undefined,
    lastStatsError: undefined as HubLinkError | undefined,
  };
  private lastSeq = 0;
  private pending: { seq: number; body: Record<string, unknown> } | undefined;
  private lastSentIdle = true;
  private chain: Promise<unknown> = Promise.resolve();

  constructor(private readonly o: StatsReporterOptions) {}

  /** The periodic reports, until `stop`; a failed one is retried with backoff. */
  async run(): Promise<void> {
    const { stop, settings } = this.o;
    let attempt = 0;
    while (!stop.aborted) {
      const delay = attempt === 0 ? settings.statsIntervalMs : backoffDelay(attempt, settings.retry);
      try {
        await sleep(delay, stop);
        await this.serialize(async () => {
          if (!this.pending && !this.take(true)) return;
          await this.send(stop);
        });
        attempt = 0;
      } catch {
        if (stop.aborted) return;
        attempt = this.pending ? attempt + 1 : 0;
      }
    }
  }

  /** What the source has now (after a report in flight, and a failed one first), on demand. */
  async report(signal: AbortSignal | undefined): Promise<StatsOutcome | undefined> {
    if (this.o.stop.aborted) throw new AbortError("the hub link is closed");
    const linked = linkedSignal([signal, this.o.stop]);
    try {
      return await this.serialize(() => this.flush(linked.signal, false));
    } finally {
      linked.dispose();
    }
  }

  /** At close: what is left, within `closeTimeoutMs`; a hub that is gone must not hold the shutdown. */
  async final(): Promise<void> {
    if (!this.source) return;
    const ms = this.o.settings.closeTimeoutMs;
    const bounded = linkedSignal([], { ms, reason: () => new AbortError(`gave up after ${ms} ms`) });
    try {
      await this.serialize(() => this.flush(bounded.signal, true));
    } catch {
      // counted in the metrics
    } finally {
      bounded.dispose();
    }
  }

  private serialize<T>(op: () => Promise<T>): Promise<T> {
    const run = this.chain.then(op, op);
    this.chain = run.catch(() => {});
    return run;
  }

  /** The pending report (a failed one), then what the source has now. */
  private async flush(signal: AbortSignal, skipIdle: boolean): Promise<StatsOutcome | undefined> {
    if (!this.source) return undefined;
    let outcome: StatsOutcome | undefined;
    if (this.pending) outcome = await this.send(signal);
    if (this.take(skipIdle)) outcome = await this.send(signal);
    return outcome;
  }

  // The wall clock in ms (or one more than the last): a restarted backbone with the same id
  // continues above the seq its previous process reached, so the hub does not take its first
  // reports for retries.
  private take(skipIdle: boolean): boolean {
    if (!this.source) return false;
    let r: BridgeStatsReport;
    try {
      r = this.source.takeStatsReport({ nExpert: this.o.nExpert() });
    } catch (error) {
      const e = asError(error);
      this.counters.statsErrors++;
      this.counters.statsDropped++;
      this.counters.lastStatsError = stamp(e);
      this.o.emit({ type: "error", source: "stats", error: e, dropped: true });
      throw e;
    }
    const idle = isIdle(r);
    // one idle report brings the hub's tokens/s to 0; more of them would say nothing new
    if (skipIdle && idle && this.lastSentIdle) return false;
    this.lastSeq = Math.max(this.lastSeq + 1, Date.now());
    this.pending = { seq: this.lastSeq, body: reportBody(this.lastSeq, this.o.settings.id, r) };
    this.lastSentIdle = idle;
    return true;
  }

  /** Sends the pending report; throws (leaving it pending when worth retrying) on failure. */
  private async send(signal: AbortSignal): Promise<StatsOutcome> {
    const p = this.pending!;
    try {
      const r = await this.o.http.request(`${this.o.settings.modelPath}/stats`, {
        method: "POST",
        body: p.body,
        signal,
        headersTimeoutMs: REQUEST_TIMEOUT_MS,
        maxBodyBytes: MAX_ANSWER_BYTES,
      });
      const outcome = outcomeOf(p.seq, r.json);
      this.pending = undefined;
      if (outcome.accepted) this.counters.statsAccepted++;
      else this.counters.statsDuplicates++;
      this.counters.lastStatsAt = Date.now();
      this.o.emit({ type: "stats", ...outcome });
      return outcome;
    } catch (error) {
      // an abort is no failure of the hub: the report stays pending, and a later try (the final
      // report at close) sends it again with the same seq, so the hub never counts it twice
      if (signal.aborted) throw abortReason(signal);
      const e = asError(error);
      this.counters.statsErrors++;
      this.counters.lastStatsError = stamp(e);
      const dropped = !isTransient(e) && !e.code.startsWith("MOESWARM_AUTH_");
      if (dropped) {
        this.counters.statsDropped++;
        this.pending = undefined;
      }
      this.o.emit({ type: "error", source: "stats", error: e, ...(dropped ? { dropped } : {}) });
      throw e;
    }
  }
}

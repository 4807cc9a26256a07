import type { VerificationEvent } from "@moeswarm/dispatch";
import { asError, type Emit } from "./hub-events.js";
import type { HubHttp } from "./hub-http.js";
import type { HubSettings } from "./hub-options.js";

// Quarantine reports (issue 14, "reputation at the hub"): a worker this backbone caught lying is
// reported with the evidence, `POST /api/models/:model/reports/quarantine`
// {worker, layer, reason, requestDigest, expected, got, at}; the hub persists it and takes the
// worker out of every backbone's placement. A hub that predates the endpoint answers 404: logged
// once as an event, never fatal (the local quarantine holds either way).

const REQUEST_TIMEOUT_MS = 10_000;

export interface QuarantineReportCounters {
  quarantineReports: number;
  quarantineReportErrors: number;
  /** The hub has no quarantine endpoint (404): reports are not sent any more. */
  quarantineReportsUnsupported: boolean;
}

/** The report body, as the hub checks it (reason at most 512 bytes, `at` integer unix ms). */
export function quarantineBody(e: VerificationEvent): Record<string, unknown> {
  let reason = e.reason;
  while (Buffer.byteLength(reason) > 512) reason = reason.slice(0, -16);
  return {
    worker: e.worker,
    layer: e.layer,
    reason,
    requestDigest: e.requestDigest,
    expected: { norm: e.expected.norm },
    got: { norm: e.got.norm, cosine: e.got.cosine },
    at: Math.floor(e.at),
  };
}

export class QuarantineReporter {
  readonly counters: QuarantineReportCounters = {
    quarantineReports: 0,
    quarantineReportErrors: 0,
    quarantineReportsUnsupported: false,
  };
  readonly #inFlight = new Set<Promise<void>>();

  constructor(private readonly o: { http: HubHttp; settings: HubSettings; emit: Emit; stop: AbortSignal }) {}

  /** Sends one report in the background; resolves when it settled (never rejects). */
  report(event: VerificationEvent): Promise<void> {
    if (this.counters.quarantineReportsUnsupported || this.o.stop.aborted) return Promise.resolve();
    const p = this.#send(event).finally(() => this.#inFlight.delete(p));
    this.#inFlight.add(p);
    return p;
  }

  /** Waits for the reports in flight (the link's close). */
  async settled(): Promise<void> {
    await Promise.all([...this.#inFlight]);
  }

  async #send(event: VerificationEvent): Promise<void> {
    try {
      await this.o.http.request(`${this.o.settings.modelPath}/reports/quarantine`, {
        method: "POST",
        body: quarantineBody(event),
        signal: this.o.stop,
        headersTimeoutMs: REQUEST_TIMEOUT_MS,
        maxBodyBytes: 64 * 1024,
      });
      this.counters.quarantineReports++;
      this.o.emit({ type: "quarantine-report", worker: event.worker, accepted: true });
    } catch (error) {
      if (this.o.stop.aborted) return;
      const e = asError(error);
      const status = (e.details as { status?: unknown } | undefined)?.status;
      if (status === 404) {
        this.counters.quarantineReportsUnsupported = true;
      }
      this.counters.quarantineReportErrors++;
      this.o.emit({ type: "error", source: "quarantine", error: e });
    }
  }
}

import { formatBytes, formatWorkerEvent, type WorkerEvent } from "@moeswarm/worker";
import cliProgress from "cli-progress";
import type { WorkerView } from "./workers.js";

// Events a person wants to see in the demo's log; the rest (polls, renewals, byte counts) would
// only scroll the interesting lines away.
const SHOWN = new Set<WorkerEvent["event"]>([
  "claimed",
  "cached",
  "claim-refused",
  "downloaded",
  "download-retry",
  "verified",
  "corrupt",
  "loaded",
  "registered",
  "serving",
  "error",
]);

export interface Progress {
  onEvent(worker: WorkerView, event: WorkerEvent): void;
  /** Stops the bars (on a terminal) so the next lines print below them. */
  done(): void;
}

/**
 * Shows the workers' lives: on a terminal one download bar per worker plus their log lines above
 * the bars; elsewhere (CI, a pipe) the log lines alone.
 */
export function createProgress(stream: NodeJS.WriteStream): Progress {
  const tty = stream.isTTY === true;
  const multi = tty
    ? new cliProgress.MultiBar(
        {
          stream,
          format: "  {worker} [{bar}] {percentage}% {received} / {total_h} {speed}",
          hideCursor: true,
          clearOnComplete: false,
          barsize: 30,
        },
        cliProgress.Presets.shades_classic,
      )
    : undefined;
  const bars = new Map<string, cliProgress.SingleBar>();
  const line = (text: string) => (multi ? multi.log(`${text}\n`) : stream.write(`${text}\n`));
  return {
    onEvent(worker, event) {
      if (multi && event.event === "download-start") {
        const total = event.bytes ?? 0;
        bars.set(
          worker.id,
          multi.create(total, event.resumeFrom, {
            worker: worker.id,
            received: formatBytes(event.resumeFrom),
            total_h: formatBytes(total),
            speed: "",
          }),
        );
      } else if (multi && event.event === "progress") {
        bars.get(worker.id)?.update(event.received, {
          received: formatBytes(event.received),
          speed: `${formatBytes(event.bytesPerSecond)}/s`,
        });
      }
      if (SHOWN.has(event.event)) line(`  [${worker.id}] ${formatWorkerEvent(event)}`);
    },
    done() {
      multi?.stop();
    },
  };
}

import { SingleBar } from "cli-progress";

/** Where a command writes: injectable so the CLI runs in-process too. */
export interface CliIo {
  stdout: NodeJS.WritableStream & { isTTY?: boolean };
  stderr: NodeJS.WritableStream & { isTTY?: boolean };
}

export interface Progress {
  update(done: number, total: number): void;
  stop(): void;
}

const NO_PROGRESS: Progress = { update() {}, stop() {} };

function mb(bytes: number): string {
  return (bytes / 1048576).toFixed(1);
}

/** A progress bar on stderr, drawn only on a terminal (never in --json mode or when piped). */
export function progressBar(io: CliIo, label: string, enabled: boolean): Progress {
  if (!enabled || !io.stderr.isTTY) return NO_PROGRESS;
  const bar = new SingleBar({
    format: `${label} [{bar}] {percentage}% | {doneMb}/{totalMb} MB | {eta_formatted}`,
    stream: io.stderr,
    hideCursor: true,
    clearOnComplete: true,
    etaBuffer: 50,
  });
  let started = false;
  return {
    update(done, total) {
      if (!started) {
        bar.start(total, done, { doneMb: mb(done), totalMb: mb(total) });
        started = true;
      } else {
        bar.setTotal(total);
        bar.update(done, { doneMb: mb(done), totalMb: mb(total) });
      }
    },
    stop() {
      if (started) bar.stop();
    },
  };
}

/** JSON with bigints as strings and typed arrays as arrays. */
export function toJson(value: unknown): string {
  return JSON.stringify(
    value,
    (_key, v: unknown) => {
      if (typeof v === "bigint") return v.toString();
      if (ArrayBuffer.isView(v) && !(v instanceof DataView)) {
        return Array.from(v as unknown as ArrayLike<number | bigint>, (x) =>
          typeof x === "bigint" ? x.toString() : x,
        );
      }
      if (v instanceof Map) return Object.fromEntries(v);
      return v;
    },
    2,
  );
}

export function formatBytes(bytes: number | bigint): string {
  const n = Number(bytes);
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${v.toFixed(v < 10 ? 2 : 1)} ${units[u]}`;
}

import { appendFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";

// Hop tracing for latency work: with MOESWARM_TRACE=<dir> in a process's environment, every
// traceHop() call of that process records (hop, CLOCK_MONOTONIC ns, tag) and the records go to
// <dir>/trace-<pid>.tsv (at exit, and whenever many are buffered). Node's hrtime and the native
// parts' clock_gettime(CLOCK_MONOTONIC) read the same clock, so the files of every process of one
// machine (plugin, bridge, hub, workers) merge into one timeline. Unset, a call costs one branch.
//
// Line format: `<hop>\t<ns>\t<tag>` (tag may be empty); the first line is `# pid <pid> <title>`.

const FLUSH_AT = 8192;

interface TraceState {
  file: string;
  lines: string[];
}

let state: TraceState | null | undefined;

function start(): TraceState | null {
  const dir = typeof process === "object" ? process.env?.MOESWARM_TRACE : undefined;
  if (!dir) return null;
  try {
    mkdirSync(dir, { recursive: true });
  } catch {
    return null;
  }
  const s: TraceState = { file: join(dir, `trace-${process.pid}.tsv`), lines: [] };
  s.lines.push(`# pid ${process.pid} ${process.title} ${process.argv.slice(1, 3).join(" ")}`);
  // only a process that traces gets the hook
  process.once("exit", () => flush(s));
  return s;
}

function flush(s: TraceState): void {
  if (s.lines.length === 0) return;
  const text = `${s.lines.join("\n")}\n`;
  s.lines.length = 0;
  try {
    appendFileSync(s.file, text);
  } catch {
    // tracing is best effort: a full disk must not fail a request
  }
}

/** Whether this process traces hops (MOESWARM_TRACE is set; read at the first call). */
export function traceEnabled(): boolean {
  if (state === undefined) state = start();
  return state !== null;
}

/**
 * Records that a request passed `hop` now (CLOCK_MONOTONIC nanoseconds), with an optional numeric
 * tag (a request id, a layer). A no-op unless MOESWARM_TRACE is set. Records are written at exit,
 * or by {@link traceFlush}.
 */
export function traceHop(hop: string, tag?: number): void {
  if (state === null) return;
  if (state === undefined) {
    state = start();
    if (state === null) return;
  }
  state.lines.push(`${hop}\t${process.hrtime.bigint()}\t${tag ?? ""}`);
  if (state.lines.length >= FLUSH_AT) flush(state);
}

/** Writes the buffered records now (a process about to be killed, a benchmark between runs). */
export function traceFlush(): void {
  if (state) flush(state);
}

// The few lines every moeswarm executable's main.ts ran: SIGINT/SIGTERM into an AbortSignal, the
// CLI's status into the process's exit code, --version.
import { readFileSync } from "node:fs";

/** The standard streams, as a CLI's `runCli(argv, io, signal)` takes them. */
export interface CliProcessIo {
  stdout: NodeJS.WriteStream;
  stderr: NodeJS.WriteStream;
}

export interface CliProcessOptions {
  /** The executable's name, before the line printed when `run` itself rejects. */
  name: string;
  /**
   * Abort with the signal's name ("SIGTERM") as the reason, for a CLI that says why it stops;
   * without it a plain `abort()` (its AbortError).
   */
  signalReason?: boolean;
  /**
   * End the process as soon as stdout is flushed, rather than when nothing is left to run: idle
   * keep-alive HTTP connections must not hold a finished command open.
   */
  exitWhenDone?: boolean;
  /**
   * The package version: `--version` (alone, or with `--json`) prints `<name> <version>` (or
   * `{"name", "version"}`) and exits 0 without running the CLI. Every moeswarm bin passes its own.
   */
  version?: string;
}

/** Handles `--version [--json]`; true when it did. */
function printVersion(argv: readonly string[], options: CliProcessOptions): boolean {
  if (options.version === undefined || !argv.includes("--version")) return false;
  const json = argv.includes("--json");
  process.stdout.write(
    json
      ? `${JSON.stringify({ name: options.name, version: options.version })}\n`
      : `${options.name} ${options.version}\n`,
  );
  return true;
}

/**
 * The `version` of the package.json at `url` (a bin passes `new URL("../package.json",
 * import.meta.url)`: bins are built to dist/, one folder below their package).
 */
export function readPackageVersion(url: URL): string {
  const pkg = JSON.parse(readFileSync(url, "utf8")) as { version?: unknown };
  return typeof pkg.version === "string" ? pkg.version : "0.0.0";
}

const SIGNAL_STATUS: Record<"SIGINT" | "SIGTERM", number> = { SIGINT: 130, SIGTERM: 143 };

/**
 * Runs a CLI as this process: `run` gets the arguments after node and the script, the standard
 * streams, and a signal that the first SIGINT or SIGTERM aborts (the CLI finishes or drains what
 * it holds); a second one means "now" and exits at once with 130 or 143. `run`'s number becomes
 * the exit code; a rejection prints `<name>: <error>` and exits 1.
 */
export function runCliProcess(
  run: (argv: readonly string[], io: CliProcessIo, signal: AbortSignal) => Promise<number>,
  options: CliProcessOptions,
): void {
  const argv = process.argv.slice(2);
  if (printVersion(argv, options)) return;
  const controller = new AbortController();
  let signals = 0;
  const onSignal = (name: "SIGINT" | "SIGTERM") => {
    signals++;
    if (signals > 1) process.exit(SIGNAL_STATUS[name]);
    if (options.signalReason) controller.abort(name);
    else controller.abort();
  };
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  const done = (code: number) => {
    process.removeListener("SIGINT", onSignal);
    process.removeListener("SIGTERM", onSignal);
    if (options.exitWhenDone) process.stdout.write("", () => process.exit(code));
    else process.exitCode = code;
  };
  run(argv, { stdout: process.stdout, stderr: process.stderr }, controller.signal).then(
    done,
    (error: unknown) => {
      process.stderr.write(`${options.name}: ${String(error)}\n`);
      done(1);
    },
  );
}

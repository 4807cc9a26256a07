#!/usr/bin/env node
// The `moeswarm-hub` executable: `serve` models and the relay, mint `token`s.
import { runCli } from "./run.js";

const controller = new AbortController();
const onSignal = () => controller.abort();
process.once("SIGINT", onSignal);
process.once("SIGTERM", onSignal);

runCli(process.argv.slice(2), { stdout: process.stdout, stderr: process.stderr }, controller.signal).then(
  (code) => {
    process.exitCode = code;
    process.removeListener("SIGINT", onSignal);
    process.removeListener("SIGTERM", onSignal);
  },
  (error: unknown) => {
    process.stderr.write(`moeswarm-hub: ${String(error)}\n`);
    process.exitCode = 1;
  },
);

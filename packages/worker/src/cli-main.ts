#!/usr/bin/env node
// The `moeswarm-worker` executable: joins a hub's swarm and serves until SIGINT/SIGTERM.
import { runWorkerCli } from "./cli.js";

const controller = new AbortController();
let signals = 0;
const onSignal = (name: NodeJS.Signals) => {
  signals++;
  // the first signal drains; a second one means "now"
  if (signals === 1) controller.abort(name);
  else process.exit(name === "SIGINT" ? 130 : 143);
};
process.on("SIGINT", onSignal);
process.on("SIGTERM", onSignal);

runWorkerCli(
  process.argv.slice(2),
  { stdout: process.stdout, stderr: process.stderr },
  controller.signal,
).then(
  (code) => {
    process.exitCode = code;
    process.removeListener("SIGINT", onSignal);
    process.removeListener("SIGTERM", onSignal);
  },
  (error: unknown) => {
    process.stderr.write(`moeswarm-worker: ${String(error)}\n`);
    process.exitCode = 1;
  },
);

#!/usr/bin/env node
// The `moeswarm-dispatcher` executable: the bridge beside a llama-server (or any llama.cpp with
// libggml-moeswarm.so loaded), with llama-cpu workers and the local fallback.
import { runDispatcherCli } from "./run.js";

const controller = new AbortController();
const onSignal = () => controller.abort();
process.once("SIGINT", onSignal);
process.once("SIGTERM", onSignal);

runDispatcherCli(
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
    process.stderr.write(`moeswarm-dispatcher: ${String(error)}\n`);
    process.exitCode = 1;
  },
);

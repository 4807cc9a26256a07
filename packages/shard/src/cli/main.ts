#!/usr/bin/env node
// The `moeswarm-shard` executable: inspect, slice, manifest, verify and synthesise GGUF models.
import { runCli } from "./run.js";

const controller = new AbortController();
// Ctrl-C aborts the work in progress: writers remove their temporary files, then we exit.
process.once("SIGINT", () => controller.abort());
process.once("SIGTERM", () => controller.abort());

// Exit once stdout is flushed: idle keep-alive HTTP connections must not hold the process open.
const exit = (code: number) => process.stdout.write("", () => process.exit(code));

runCli(process.argv.slice(2), { stdout: process.stdout, stderr: process.stderr }, controller.signal).then(
  exit,
  (error: unknown) => {
    process.stderr.write(`moeswarm-shard: ${String(error)}\n`);
    exit(1);
  },
);

#!/usr/bin/env node
// The `moeswarm-worker` executable: joins a hub's swarm and serves until SIGINT/SIGTERM (the first
// drains, its name in the drain's line; a second one exits at once).
import { readPackageVersion, runCliProcess, tuneHeapForFrames } from "@moeswarm/core";
import { runWorkerCli } from "./cli.js";

// it receives large frames at a high rate (core frame-heap.ts)
tuneHeapForFrames();

runCliProcess(runWorkerCli, {
  name: "moeswarm-worker",
  version: readPackageVersion(new URL("../package.json", import.meta.url)),
  signalReason: true,
});

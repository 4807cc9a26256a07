#!/usr/bin/env node
// The `moeswarm-hub` executable: `serve` models and the relay, mint `token`s.
import { readPackageVersion, runCliProcess, tuneHeapForFrames } from "@moeswarm/core";
import { runCli } from "./run.js";

// it receives large frames at a high rate (core frame-heap.ts)
tuneHeapForFrames();

runCliProcess(runCli, {
  name: "moeswarm-hub",
  version: readPackageVersion(new URL("../package.json", import.meta.url)),
});

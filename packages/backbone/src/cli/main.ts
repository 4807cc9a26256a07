#!/usr/bin/env node
// The `moeswarm-dispatcher` executable: the bridge beside a llama-server (or any llama.cpp with
// libggml-moeswarm.so loaded), with llama-cpu workers and the local fallback.
import { readPackageVersion, runCliProcess, tuneHeapForFrames } from "@moeswarm/core";
import { runDispatcherCli } from "./run.js";

// it receives large frames at a high rate (core frame-heap.ts)
tuneHeapForFrames();

runCliProcess(runDispatcherCli, {
  name: "moeswarm-dispatcher",
  version: readPackageVersion(new URL("../package.json", import.meta.url)),
});

#!/usr/bin/env node
// The `moeswarm-shard` executable: inspect, slice, manifest, verify and synthesise GGUF models.
// Ctrl-C aborts the work in progress: writers remove their temporary files, then it exits, once
// stdout is flushed (idle keep-alive HTTP connections must not hold the process open).
import { readPackageVersion, runCliProcess } from "@moeswarm/core";
import { runCli } from "./run.js";

runCliProcess(runCli, {
  name: "moeswarm-shard",
  version: readPackageVersion(new URL("../package.json", import.meta.url)),
  exitWhenDone: true,
});

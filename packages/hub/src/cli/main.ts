#!/usr/bin/env node
// The `moeswarm-hub` executable: `serve` models and the relay, mint `token`s.
import { readPackageVersion, runCliProcess } from "@moeswarm/core";
import { runCli } from "./run.js";

runCliProcess(runCli, {
  name: "moeswarm-hub",
  version: readPackageVersion(new URL("../package.json", import.meta.url)),
});

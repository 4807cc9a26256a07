// @moeswarm/testkit: what several packages' tests need, written once. Private; tests import it
// from source (vitest), nothing published depends on it.
import { afterAll, beforeAll, expect } from "vitest";

export { mulberry32 as rng } from "@moeswarm/core";

/**
 * Fails the file if any promise rejection went unhandled while its tests ran (a dropped promise in
 * a failover or hedge path is a bug even when the test's own assertions pass). `settleMs` lets late
 * rejections surface before the check.
 */
export function expectNoUnhandledRejections(settleMs = 150): void {
  const unhandled: unknown[] = [];
  const onUnhandled = (reason: unknown) => unhandled.push(reason);
  beforeAll(() => {
    process.on("unhandledRejection", onUnhandled);
  });
  afterAll(async () => {
    await new Promise((r) => setTimeout(r, settleMs));
    process.off("unhandledRejection", onUnhandled);
    expect(unhandled.map((e) => String(e))).toEqual([]);
  });
}
export { arm64Node, NODE_ARM64 } from "./arm64-node.js";
export { waitFor } from "./hub.js";
export { freePort, type LlamaServerProcess, startLlamaServer } from "./llama-server.js";
export { type CapturedStream, captureStream } from "./streams.js";
export { type TempDir, tempDir } from "./temp.js";

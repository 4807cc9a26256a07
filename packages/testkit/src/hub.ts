// Test helpers first written for the hub's tests (and copied there twice).
import { sleep } from "@moeswarm/core";

/**
 * Polls `check` every 10 ms until it returns true; fails after `timeoutMs` (a bound, not a
 * measurement) naming `what`.
 */
export async function waitFor(
  check: () => boolean | Promise<boolean>,
  what: string | (() => string),
  timeoutMs = 8000,
): Promise<void> {
  const start = Date.now();
  while (!(await check())) {
    if (Date.now() - start > timeoutMs) {
      throw new Error(`timed out waiting for ${typeof what === "function" ? what() : what}`);
    }
    await sleep(10);
  }
}

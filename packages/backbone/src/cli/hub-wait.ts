import { abortReason, sleep } from "@moeswarm/core";
import { backoffDelay, isTransient } from "@moeswarm/relay-client";

/** How the dispatcher waits for a hub that is not up yet: 1 s doubling to 30 s, for ever. */
export const HUB_WAIT_BACKOFF = {
  initialDelayMs: 1000,
  maxDelayMs: 30_000,
  factor: 2,
  jitter: 0.2,
  maxAttempts: Number.POSITIVE_INFINITY,
};

/**
 * Runs `start` (which connects to the hub) until it succeeds, waiting with backoff while the hub
 * cannot be reached (connection refused, 5xx, timeouts: `isTransient`), so that a dispatcher
 * started before its hub, or across a hub restart, comes up by itself. A refusal (a bad token, an
 * unknown model) is thrown at once: waiting would not change it. Ends with the signal's reason.
 */
export async function waitForHub<T>(
  start: () => Promise<T>,
  o: {
    signal: AbortSignal;
    onRetry: (error: Error, retryInMs: number, attempt: number) => void;
    backoff?: typeof HUB_WAIT_BACKOFF;
  },
): Promise<T> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await start();
    } catch (error) {
      if (o.signal.aborted) throw abortReason(o.signal);
      if (!isTransient(error)) throw error;
      const retryInMs = backoffDelay(attempt, o.backoff ?? HUB_WAIT_BACKOFF);
      o.onRetry(error as Error, retryInMs, attempt);
      await sleep(retryInMs, o.signal);
    }
  }
}

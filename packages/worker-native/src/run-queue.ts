import { abortReason, onAbort } from "@moeswarm/core";

/**
 * Runs tasks one after the other in submission order. An aborted task that has not started is
 * skipped; one that has started gets `onAbortRunning` (to stop the native work early) and its
 * caller is rejected at once with the signal's reason, while the queue still waits for the task
 * to settle before starting the next one.
 */
export class RunQueue {
  #tail: Promise<void> = Promise.resolve();
  #pending = 0;

  /** Tasks submitted and not yet settled (or skipped): 0 when the queue is idle. */
  get pending(): number {
    return this.#pending;
  }

  enqueue<T>(task: () => Promise<T>, signal?: AbortSignal, onAbortRunning?: () => void): Promise<T> {
    if (signal?.aborted) return Promise.reject(abortReason(signal));
    this.#pending++;
    return new Promise<T>((resolve, reject) => {
      let state: "queued" | "running" | "done" | "cancelled" = "queued";
      const registration = onAbort(signal, (reason) => {
        if (state === "queued") state = "cancelled";
        else if (state === "running") onAbortRunning?.();
        reject(reason);
      });
      this.#tail = this.#tail.then(async () => {
        if (state === "cancelled") {
          this.#pending--;
          return;
        }
        state = "running";
        try {
          resolve(await task());
        } catch (error) {
          reject(error);
        } finally {
          state = "done";
          this.#pending--;
          registration[Symbol.dispose]();
        }
      });
    });
  }

  /** Resolves when every task submitted so far has settled. */
  idle(): Promise<void> {
    return this.#tail;
  }
}

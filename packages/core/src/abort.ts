import { abortReason } from "./errors.js";

/**
 * Calls `listener` once when `signal` aborts (at once, in a microtask, if it already has) and
 * returns the registration as a Disposable, so a `using` block or a `finally` removes it: the one
 * place the add/remove pairing of abort listeners is written.
 */
export function onAbort(signal: AbortSignal | undefined, listener: (reason: unknown) => void): Disposable {
  if (signal === undefined) return { [Symbol.dispose]() {} };
  let live = true;
  const fire = () => {
    if (!live) return;
    live = false;
    signal.removeEventListener("abort", fire);
    listener(abortReason(signal));
  };
  if (signal.aborted) queueMicrotask(fire);
  else signal.addEventListener("abort", fire, { once: true });
  return {
    [Symbol.dispose]() {
      // after firing there is nothing left to remove
      if (!live) return;
      live = false;
      signal.removeEventListener("abort", fire);
    },
  };
}

/**
 * Resolves after `ms` milliseconds; rejects with the signal's reason (see {@link abortReason}) if it
 * aborts first, and then leaves no timer or listener behind. Fake timers drive it like any timer.
 */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) return Promise.reject(abortReason(signal));
  return new Promise<void>((resolve, reject) => {
    const registration = onAbort(signal, (reason) => {
      clearTimeout(timer);
      reject(reason);
    });
    const timer = setTimeout(() => {
      registration[Symbol.dispose]();
      resolve();
    }, ms);
  });
}

/**
 * A signal that aborts when any of `signals` does or, with `timeoutMs`, when the time runs out
 * (then with a TIMEOUT-style reason the caller supplies). The returned `dispose` clears the timer.
 */
export function linkedSignal(
  signals: readonly (AbortSignal | undefined)[],
  timeout?: { readonly ms: number; readonly reason: () => unknown },
): { readonly signal: AbortSignal; dispose(): void } {
  const controller = new AbortController();
  const registrations = signals.map((s) => onAbort(s, (reason) => controller.abort(reason)));
  const timer = timeout && setTimeout(() => controller.abort(timeout.reason()), timeout.ms);
  return {
    signal: controller.signal,
    dispose() {
      if (timer) clearTimeout(timer);
      for (const r of registrations) r[Symbol.dispose]();
    },
  };
}

/**
 * `promise`, unless `signal` aborts first: then a rejection with the signal's reason (see
 * {@link abortReason}). The listener is removed either way; the promise runs on, and a later
 * rejection of it counts as handled.
 */
export function abortable<T>(promise: PromiseLike<T>, signal: AbortSignal | undefined): Promise<T> {
  const settled = Promise.resolve(promise);
  if (signal === undefined) return settled;
  if (signal.aborted) {
    settled.catch(() => {});
    return Promise.reject(abortReason(signal));
  }
  return new Promise<T>((resolve, reject) => {
    const registration = onAbort(signal, reject);
    settled.then(
      (value) => {
        registration[Symbol.dispose]();
        resolve(value);
      },
      (error: unknown) => {
        registration[Symbol.dispose]();
        reject(error);
      },
    );
  });
}

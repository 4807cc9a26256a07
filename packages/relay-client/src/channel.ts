import { abortReason, onAbort } from "@moeswarm/core";

/**
 * A push-to-pull queue: producers push, any number of `iterate()` loops pull. Each value goes to
 * one consumer (a work queue), or to all when `broadcast` is set (an event stream). A bounded
 * buffer drops the oldest values rather than grow without bound when nobody is reading.
 */
export class Channel<T> {
  readonly #broadcast: boolean;
  readonly #limit: number;
  readonly #queues = new Set<Consumer<T>>();
  readonly #shared: T[] = [];
  #ended = false;

  constructor(options: { broadcast: boolean; limit: number }) {
    this.#broadcast = options.broadcast;
    this.#limit = options.limit;
  }

  get ended(): boolean {
    return this.#ended;
  }

  push(value: T): void {
    if (this.#ended) return;
    if (this.#broadcast) {
      for (const c of this.#queues) c.offer(value, this.#limit);
      return;
    }
    for (const c of this.#queues) {
      if (c.takeDirect(value)) return;
    }
    this.#shared.push(value);
    if (this.#shared.length > this.#limit) this.#shared.shift();
  }

  end(): void {
    if (this.#ended) return;
    this.#ended = true;
    for (const c of this.#queues) c.finish();
  }

  iterate(options: { signal?: AbortSignal; filter?: (value: T) => boolean } = {}): AsyncIterableIterator<T> {
    const consumer = new Consumer<T>(this.#broadcast ? [] : this.#shared, options.filter, () =>
      this.#queues.delete(consumer),
    );
    if (this.#ended) consumer.finish();
    else this.#queues.add(consumer);
    const signal = options.signal;
    if (signal) {
      if (signal.aborted) consumer.fail(abortReason(signal));
      else {
        const registration = onAbort(signal, (reason) => consumer.fail(reason));
        consumer.onDone = () => registration[Symbol.dispose]();
      }
    }
    return consumer;
  }
}

class Consumer<T> implements AsyncIterableIterator<T> {
  #waiter: { resolve(r: IteratorResult<T>): void; reject(e: unknown): void } | undefined;
  #done = false;
  #error: unknown;
  onDone: (() => void) | undefined;

  constructor(
    private readonly buffer: T[],
    private readonly filter: ((value: T) => boolean) | undefined,
    private readonly detach: () => void,
  ) {}

  takeDirect(value: T): boolean {
    if (!this.#waiter || (this.filter && !this.filter(value))) return false;
    const w = this.#waiter;
    this.#waiter = undefined;
    w.resolve({ value, done: false });
    return true;
  }

  offer(value: T, limit: number): void {
    if (this.takeDirect(value)) return;
    this.buffer.push(value);
    if (this.buffer.length > limit) this.buffer.shift();
  }

  finish(): void {
    this.#settle(undefined);
  }

  fail(error: unknown): void {
    this.#settle(error ?? new Error("aborted"));
  }

  #settle(error: unknown): void {
    if (this.#done) return;
    this.#done = true;
    this.#error = error;
    this.detach();
    this.onDone?.();
    const w = this.#waiter;
    this.#waiter = undefined;
    if (!w) return;
    if (error === undefined) w.resolve({ value: undefined, done: true });
    else w.reject(error);
  }

  next(): Promise<IteratorResult<T>> {
    while (this.buffer.length > 0) {
      const value = this.buffer.shift() as T;
      if (!this.filter || this.filter(value)) return Promise.resolve({ value, done: false });
    }
    if (this.#done) {
      if (this.#error !== undefined) {
        const e = this.#error;
        this.#error = undefined;
        return Promise.reject(e);
      }
      return Promise.resolve({ value: undefined, done: true });
    }
    return new Promise((resolve, reject) => {
      this.#waiter = { resolve, reject };
    });
  }

  return(): Promise<IteratorResult<T>> {
    this.#settle(undefined);
    return Promise.resolve({ value: undefined, done: true });
  }

  [Symbol.asyncIterator](): AsyncIterableIterator<T> {
    return this;
  }
}

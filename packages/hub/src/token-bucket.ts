/** A token bucket: `rate` tokens a second, at most `burst` saved up. */
export class TokenBucket {
  #tokens: number;
  #last: number;

  constructor(
    private readonly rate: number,
    private readonly burst: number,
    /** The clock, ms (injectable so tests need no wall-clock race). */
    private readonly now: () => number = () => performance.now(),
  ) {
    this.#tokens = burst;
    this.#last = now();
  }

  /** When it last took or refused a token (ms, its clock). */
  get lastUsed(): number {
    return this.#last;
  }

  take(): boolean {
    const t = this.now();
    this.#tokens = Math.min(this.burst, this.#tokens + ((t - this.#last) * this.rate) / 1000);
    this.#last = t;
    if (this.#tokens < 1) return false;
    this.#tokens -= 1;
    return true;
  }
}

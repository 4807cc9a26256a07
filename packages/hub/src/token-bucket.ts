/** A token bucket: `rate` tokens a second, at most `burst` saved up. */
export class TokenBucket {
  #tokens: number;
  #last = performance.now();

  constructor(
    private readonly rate: number,
    private readonly burst: number,
  ) {
    this.#tokens = burst;
  }

  take(): boolean {
    const t = performance.now();
    this.#tokens = Math.min(this.burst, this.#tokens + ((t - this.#last) * this.rate) / 1000);
    this.#last = t;
    if (this.#tokens < 1) return false;
    this.#tokens -= 1;
    return true;
  }
}

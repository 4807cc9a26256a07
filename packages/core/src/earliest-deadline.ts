const now = () => performance.now();
/** setTimeout's largest delay: a longer one fires at once (with a TimeoutOverflowWarning). */
const MAX_TIMER_MS = 0x7fff_ffff;

/** An entry of a table with deadlines: `due` is the performance.now() at which it expires. */
export interface Deadlined {
  readonly due: number;
}

/**
 * One timer for every deadline of a table (requests in flight, dispatches held, routes), armed for
 * the earliest: a timer per entry would cost a timer object, a timer-list insertion and a clock
 * read per request on the hottest paths. The table offers each entry as it adds it and sweeps
 * itself when the timer fires (`onFire`), offering the next earliest entry left.
 *
 * `onFire` is given the entry the timer was armed for, so that the table expires it whatever a
 * clock says, as a timer of its own would have (a timer may fire a little before
 * performance.now() reaches its deadline). A settled entry is `forget`-ten: the timer stays armed
 * (it sweeps whatever is due when it fires) but no longer holds the entry. A deadline beyond
 * setTimeout's limit (about 24.8 days) arms the timer at the limit and is swept when it is due.
 */
export class EarliestDeadline<T extends Deadlined> {
  readonly #onFire: (armedFor: T | undefined, at: number) => void;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #due = Number.POSITIVE_INFINITY;
  #armedFor: T | undefined;
  #holds: boolean;
  readonly #fire = () => {
    const armedFor = this.#armedFor;
    this.stop();
    this.#onFire(armedFor, now());
  };

  /**
   * `holds`: whether an armed timer keeps the process alive (default false); `hold()` changes it,
   * e.g. to hold the process only while requests wait.
   */
  constructor(onFire: (armedFor: T | undefined, at: number) => void, options: { holds?: boolean } = {}) {
    this.#onFire = onFire;
    this.#holds = options.holds === true;
  }

  /** The deadline the timer is armed for (+Infinity when it is not armed). */
  get due(): number {
    return this.#due;
  }

  /** Arms the timer for `entry` when it is due before the deadline armed; `at`: now. */
  offer(entry: T, at: number = now()): void {
    if (entry.due >= this.#due) return;
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    const delay = Math.max(0, entry.due - at);
    this.#due = entry.due;
    this.#armedFor = delay <= MAX_TIMER_MS ? entry : undefined;
    this.#timer = setTimeout(this.#fire, Math.min(delay, MAX_TIMER_MS));
    if (!this.#holds) this.#timer.unref?.();
  }

  /** `entry` is settled: the timer no longer holds it (nor keeps it alive). */
  forget(entry: T): void {
    if (this.#armedFor === entry) this.#armedFor = undefined;
  }

  /** Whether the armed timer, and the ones armed later, keep the process alive. */
  hold(holds: boolean): void {
    this.#holds = holds;
    if (holds) this.#timer?.ref?.();
    else this.#timer?.unref?.();
  }

  /** Disarms the timer: nothing fires until an entry is offered again. */
  stop(): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#due = Number.POSITIVE_INFINITY;
    this.#armedFor = undefined;
  }
}

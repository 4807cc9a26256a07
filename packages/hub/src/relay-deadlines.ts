import type { Peer, Route } from "./relay-peer.js";

const now = () => performance.now();
/** setTimeout's largest delay: a longer one fires at once (with a TimeoutOverflowWarning). */
const MAX_TIMER_MS = 0x7fff_ffff;

/**
 * When the relay forgets its routes: one timer for all of them, armed for the earliest deadline,
 * instead of a timer armed and cleared per forwarded dispatch (a timer object, a timer-list
 * insertion and a clock read per frame, on the relay's hottest path). The routes themselves stay
 * where the relay keeps them (each worker's `routes`): a route added or finished costs a compare,
 * no timer and no entry anywhere. When the timer fires it walks the workers' routes, expires each
 * one due by then (the route it was armed for whatever a clock says, as its own timer would have),
 * and is armed for the next.
 */
export class RouteDeadlines {
  readonly #workers: ReadonlyMap<string, Peer>;
  readonly #expire: (route: Route) => void;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #timerDue = Number.POSITIVE_INFINITY;
  #timerFor: Route | undefined;
  readonly #sweep = () => this.#fire();

  /**
   * `workers`: the relay's live workers, whose `routes` hold every route not yet finished;
   * `expire`: called for each route whose deadline passed.
   */
  constructor(workers: ReadonlyMap<string, Peer>, expire: (route: Route) => void) {
    this.#workers = workers;
    this.#expire = expire;
  }

  /** A route was forwarded (it is in its worker's `routes`). */
  add(route: Route): void {
    if (route.due < this.#timerDue) this.#arm(route, now());
  }

  /** A route is finished: it leaves its worker's `routes`, and is not kept alive by the timer. */
  delete(route: Route): void {
    if (this.#timerFor === route) this.#timerFor = undefined;
  }

  /** Stops the timer (the relay closes); routes left are not expired. */
  close(): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#timerDue = Number.POSITIVE_INFINITY;
    this.#timerFor = undefined;
  }

  #arm(route: Route, at: number): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    const delay = Math.max(0, route.due - at);
    this.#timerDue = route.due;
    // a deadline past setTimeout's limit is swept when due, not when the capped timer fires
    this.#timerFor = delay <= MAX_TIMER_MS ? route : undefined;
    this.#timer = setTimeout(this.#sweep, Math.min(delay, MAX_TIMER_MS));
    this.#timer.unref?.();
  }

  #fire(): void {
    const first = this.#timerFor;
    this.close();
    const at = now();
    let next: Route | undefined;
    const due: Route[] = [];
    for (const worker of this.#workers.values()) {
      for (const route of worker.routes.values()) {
        if (route === first || route.due <= at) due.push(route);
        else if (route.due < (next?.due ?? Number.POSITIVE_INFINITY)) next = route;
      }
    }
    if (next !== undefined) this.#arm(next, at);
    for (const route of due) this.#expire(route);
  }
}

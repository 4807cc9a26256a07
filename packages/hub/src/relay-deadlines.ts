import { EarliestDeadline } from "@moeswarm/core";
import type { Peer, Route } from "./relay-peer.js";

/**
 * When the relay forgets its routes: one timer for all of them (core's EarliestDeadline), instead
 * of a timer armed and cleared per forwarded dispatch on the relay's hottest path. The routes
 * stay where the relay keeps them (each worker's `routes`): a route added or finished costs a
 * compare, no timer and no entry anywhere. When the timer fires it walks the workers' routes,
 * expires each one due by then, and is armed for the next.
 */
export class RouteDeadlines {
  readonly #workers: ReadonlyMap<string, Peer>;
  readonly #expire: (route: Route) => void;
  readonly #timer = new EarliestDeadline<Route>((armedFor, at) => this.#sweep(armedFor, at));

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
    this.#timer.offer(route);
  }

  /** A route is finished: it leaves its worker's `routes`, and the timer does not keep it alive. */
  delete(route: Route): void {
    this.#timer.forget(route);
  }

  /** Stops the timer (the relay closes); routes left are not expired. */
  close(): void {
    this.#timer.stop();
  }

  #sweep(armedFor: Route | undefined, at: number): void {
    let next: Route | undefined;
    const due: Route[] = [];
    for (const worker of this.#workers.values()) {
      for (const route of worker.routes.values()) {
        if (route === armedFor || route.due <= at) due.push(route);
        else if (route.due < (next?.due ?? Number.POSITIVE_INFINITY)) next = route;
      }
    }
    if (next !== undefined) this.#timer.offer(next, at);
    for (const route of due) this.#expire(route);
  }
}

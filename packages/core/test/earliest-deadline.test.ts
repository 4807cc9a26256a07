// EarliestDeadline: one timer for a table's deadlines, under fake timers.
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { EarliestDeadline } from "../src/index.js";

interface Entry {
  id: number;
  due: number;
}

/** A table of entries swept as its owner would: what is due (or armed for) expires, the next is offered. */
function table(holds = false) {
  const entries = new Set<Entry>();
  const expired: number[] = [];
  const timer = new EarliestDeadline<Entry>(
    (armedFor, at) => {
      let next: Entry | undefined;
      for (const e of entries) {
        if (e === armedFor || e.due <= at) {
          entries.delete(e);
          expired.push(e.id);
        } else if (e.due < (next?.due ?? Number.POSITIVE_INFINITY)) next = e;
      }
      if (next) timer.offer(next, at);
    },
    { holds },
  );
  const add = (id: number, inMs: number) => {
    const e = { id, due: performance.now() + inMs };
    entries.add(e);
    timer.offer(e);
    return e;
  };
  const settle = (e: Entry) => {
    entries.delete(e);
    timer.forget(e);
  };
  return { timer, expired, add, settle };
}

describe("EarliestDeadline", () => {
  beforeEach(() => {
    vi.useFakeTimers({ toFake: ["setTimeout", "clearTimeout", "performance"] });
  });
  afterEach(() => {
    vi.useRealTimers();
  });

  it("fires at each deadline in order with one timer, re-armed only for an earlier one", () => {
    const { timer, expired, add } = table();
    add(1, 300);
    add(2, 100);
    add(3, 200);
    expect(vi.getTimerCount()).toBe(1);
    expect(timer.due).toBe(performance.now() + 100);
    vi.advanceTimersByTime(99);
    expect(expired).toEqual([]);
    vi.advanceTimersByTime(1);
    expect(expired).toEqual([2]);
    vi.advanceTimersByTime(200);
    expect(expired).toEqual([2, 3, 1]);
    expect(vi.getTimerCount()).toBe(0);
    expect(timer.due).toBe(Number.POSITIVE_INFINITY);
  });

  it("hands onFire the entry it was armed for, even when the clock reads a little early", () => {
    const { expired, add } = table();
    const e = add(7, 50);
    e.due += 0.5; // a timer may fire before performance.now() reaches the deadline
    vi.advanceTimersByTime(50);
    expect(expired).toEqual([7]);
  });

  it("expires no settled entry, and stop disarms it", () => {
    const { timer, expired, add, settle } = table();
    const a = add(1, 10);
    add(2, 20);
    settle(a);
    vi.advanceTimersByTime(15);
    expect(expired).toEqual([]);
    vi.advanceTimersByTime(10);
    expect(expired).toEqual([2]);
    add(3, 10);
    timer.stop();
    vi.advanceTimersByTime(100);
    expect(expired).toEqual([2]);
    expect(vi.getTimerCount()).toBe(0);
  });

  it("takes a deadline beyond setTimeout's limit without firing early", () => {
    // setTimeout(fn, 2^31) fires after 1 ms (TimeoutOverflowWarning): the timer is armed at the limit
    const { expired, add } = table();
    add(1, 30 * 24 * 3600 * 1000);
    vi.advanceTimersByTime(60_000);
    expect(expired).toEqual([]);
    vi.advanceTimersByTime(0x7fff_ffff);
    expect(expired).toEqual([]); // the limit passed, the deadline not yet: armed again
    vi.advanceTimersByTime(30 * 24 * 3600 * 1000);
    expect(expired).toEqual([1]);
  });
});

// The relay's route bookkeeping without sockets: RouteDeadlines (one timer for every route's
// deadline) under fake timers, and a worker's per-model slice count behind servesModel.
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { RouteDeadlines } from "../src/relay-deadlines.js";
import { Peer, type Route } from "../src/relay-peer.js";
import { TokenBucket } from "../src/token-bucket.js";

const peer = () => new Peer({} as never, "test", new TokenBucket(1, 1));

/** A relay's workers and their routes, as RouteDeadlines sees them, and what it expired. */
function relay(workerCount = 2) {
  const workers = new Map(Array.from({ length: workerCount }, (_, i) => [`w${i}`, peer()] as const));
  const expired: number[] = [];
  // as the relay's expireRoute does: the expired route leaves its worker
  const deadlines = new RouteDeadlines(workers, (r) => {
    r.worker.routes.delete(r.relayId);
    expired.push(r.relayId);
  });
  const add = (id: number, inMs: number): Route => {
    const worker = workers.get(`w${id % workerCount}`)!;
    const started = performance.now();
    const r: Route = { relayId: id, origId: id, backbone: peer(), worker, started, due: started + inMs };
    worker.routes.set(id, r);
    deadlines.add(r);
    return r;
  };
  const finish = (r: Route) => {
    r.worker.routes.delete(r.relayId);
    deadlines.delete(r);
  };
  return { deadlines, expired, add, finish };
}

describe("RouteDeadlines", () => {
  beforeEach(() => {
    vi.useFakeTimers({ toFake: ["setTimeout", "clearTimeout", "performance"] });
  });
  afterEach(() => {
    vi.useRealTimers();
  });

  it("expires each route at its deadline, in order, with one timer armed at a time", () => {
    const { expired, add } = relay();
    add(1, 300);
    add(2, 100); // earlier: the timer is armed again for it
    add(3, 200);
    expect(vi.getTimerCount()).toBe(1);
    vi.advanceTimersByTime(99);
    expect(expired).toEqual([]);
    vi.advanceTimersByTime(1);
    expect(expired).toEqual([2]);
    vi.advanceTimersByTime(100);
    expect(expired).toEqual([2, 3]);
    vi.advanceTimersByTime(100);
    expect(expired).toEqual([2, 3, 1]);
    expect(vi.getTimerCount()).toBe(0);
  });

  it("never expires a finished route, and keeps no timer per route", () => {
    const { expired, add, finish } = relay(3);
    const routes = Array.from({ length: 1000 }, (_, i) => add(i, 1000 + i));
    expect(vi.getTimerCount()).toBe(1);
    for (const r of routes) if (r.relayId !== 500) finish(r);
    vi.advanceTimersByTime(5000);
    expect(expired).toEqual([500]);
  });

  it("expires the route its timer was armed for even if the clock reads a little early", () => {
    const { expired, add } = relay();
    const r = add(7, 50);
    // a timer can fire before performance.now() reaches the deadline (ms granularity)
    r.due += 0.5;
    vi.advanceTimersByTime(50);
    expect(expired).toEqual([7]);
  });

  it("keeps a route with the largest deadline a dispatch may carry (2^32 - 1 ms), past setTimeout's limit", () => {
    // the relay's timer per route fired at once for such a deadline (setTimeout overflow)
    const { expired, add } = relay();
    add(1, 0xffff_ffff + 1000);
    vi.advanceTimersByTime(60_000);
    expect(expired).toEqual([]);
    vi.advanceTimersByTime(0xffff_ffff);
    expect(expired).toEqual([1]);
  });

  it("close stops the timer and expires nothing more", () => {
    const { deadlines, expired, add } = relay();
    add(1, 10);
    deadlines.close();
    vi.advanceTimersByTime(100);
    expect(expired).toEqual([]);
    expect(vi.getTimerCount()).toBe(0);
  });
});

describe("a worker's slices and servesModel", () => {
  it("serves a model while at least one of its slices is registered", () => {
    const p = peer();
    const slice = (model: string, layer: number) => ({ model, layers: [layer], experts: [0] });
    expect(p.servesModel("a")).toBe(false);
    p.setSlice("a0", slice("a", 0));
    p.setSlice("a1", slice("a", 1));
    p.setSlice("a1", slice("a", 1)); // the same slice again replaces itself: still two
    p.setSlice("b0", slice("b", 0));
    expect([p.servesModel("a"), p.servesModel("b")]).toEqual([true, true]);
    p.deleteSlice("a0");
    expect(p.servesModel("a")).toBe(true);
    p.deleteSlice("a1");
    p.deleteSlice("a1"); // gone already: no count below zero
    expect([p.servesModel("a"), p.servesModel("b")]).toEqual([false, true]);
    p.setSlice("a2", slice("a", 2));
    expect(p.servesModel("a")).toBe(true);
    p.clearSlices();
    expect([p.servesModel("a"), p.servesModel("b"), p.slices.size]).toEqual([false, false, 0]);
  });
});

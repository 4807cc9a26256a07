// The backbone's side of a direct link whose worker goes silent: the socket stops being read (no
// pong, no result) and the link's heartbeat cuts it after deadPeerMs; the request it held is sent
// again over the fallback, later requests go over the fallback straight away, and the link is
// dialed again after its back-off. Fake timers drive the heartbeat; the sockets are real.
import { afterEach, describe, expect, it, vi } from "vitest";
import { type DirectLinkEvent, DirectTransport, dialWebSocket } from "../src/index.js";
import { FakeRelay } from "./fake-relay.js";
import { Fallback, smallRequest } from "./fixtures.js";

// the fake echoes x in each slot: 1.. from the worker, -1 from the fallback
const req = () => smallRequest((i) => i + 1);

const open: Array<{ close(): Promise<void> }> = [];
afterEach(async () => {
  vi.useRealTimers();
  await Promise.all(open.splice(0).map((o) => o.close()));
});

/** Lets real socket I/O run while the fake clock stands still. */
const io = () => new Promise<void>((resolve) => setImmediate(resolve));

describe("a direct link whose worker goes silent", () => {
  it("is cut after deadPeerMs; the request it held and the next ones go over the fallback; it is redialed after the back-off", async () => {
    vi.useFakeTimers({
      toFake: ["setTimeout", "clearTimeout", "setInterval", "clearInterval", "performance", "Date"],
    });
    const relay = await FakeRelay.start(); // stands in for the worker's endpoint: accepts ticket "good"
    open.push(relay);
    const fallback = new Fallback(-1);
    const events: DirectLinkEvent[] = [];
    const t = new DirectTransport({
      fallback,
      id: "bb",
      ticket: async () => "good",
      heartbeatMs: 1000,
      deadPeerMs: 4000,
      backoff: { initialDelayMs: 10_000, jitter: 0 },
      // plain ws:// and no pin: this test is about liveness, pinning is tested in direct.test.ts
      dial: (url, d) => dialWebSocket(url, { ...d, pin: undefined }),
      onEvent: (e) => events.push(e),
    });
    open.push(t);
    t.update(new Map([["w1", { endpoints: [relay.url], fingerprint: "unused" }]]));
    expect(await t.linked("w1")).toBe(true);

    // answered directly while the worker is alive (the fake echoes x in each slot)
    const first = await t.request("w1", req(), { signal: new AbortController().signal, deadlineMs: 60_000 });
    expect(first.y[0]).toBe(1);
    expect(t.counters()).toMatchObject({ direct: 1, relay: 0 });

    // the worker stops reading its socket: no pong, no result, nothing
    relay.silent = true;
    (relay.last as unknown as { _socket: { pause(): void } })._socket.pause();
    const held = t.request("w1", req(), { signal: new AbortController().signal, deadlineMs: 60_000 });
    await io();
    // just short of deadPeerMs: still linked, the request still waits
    await vi.advanceTimersByTimeAsync(3000);
    expect(t.counters().linked).toEqual(["w1"]);
    expect(fallback.calls).toEqual([]);
    // past it: cut, the held request answered by the fallback within its deadline
    await vi.advanceTimersByTimeAsync(2000);
    const r = await held;
    expect([...r.y].every((v) => v === -1)).toBe(true);
    expect(fallback.calls).toEqual(["w1"]);
    expect(t.counters()).toMatchObject({ direct: 1, relay: 1, retried: 1, linked: [] });
    const lost = events.find((e) => e.type === "lost");
    expect(lost).toMatchObject({ type: "lost", worker: "w1", retryInMs: 10_000 });
    expect((lost as { error?: { code?: string; message: string } }).error).toMatchObject({
      code: "MOESWARM_TRANSPORT_TIMEOUT",
      // the worker and its link went silent, not the relay (which may be fine)
      message: expect.stringMatching(/ for \d+ ms \(deadPeerMs 4000\)$/),
    });
    expect((lost as { error: Error }).error.message).toContain(
      `no frame from worker w1 on its direct link ${relay.url} for `,
    );

    // backing off: the next request goes over the fallback at once, no dial
    const dials = t.counters().dials;
    await t.request("w1", req(), { signal: new AbortController().signal, deadlineMs: 60_000 });
    expect(t.counters()).toMatchObject({ relay: 2, dials });

    // the worker is back; after the back-off the next request redials, and the one after goes direct
    relay.silent = false;
    await vi.advanceTimersByTimeAsync(10_001);
    await t.request("w1", req(), { signal: new AbortController().signal, deadlineMs: 60_000 });
    expect(t.counters().dials).toBe(dials + 1);
    expect(await t.linked("w1")).toBe(true);
    const again = await t.request("w1", req(), { signal: new AbortController().signal, deadlineMs: 60_000 });
    expect(again.y[0]).toBe(1);
    expect(t.counters()).toMatchObject({ direct: 2, relay: 3, linked: ["w1"] });
  });
});

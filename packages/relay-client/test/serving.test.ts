import {
  type DispatchFrame,
  decodeFrame,
  type ErrorFrame,
  InvalidArgumentError,
  PROTOCOL_VERSION,
  type ResultFrame,
  TransportError,
} from "@moeswarm/core";
import { expectNoUnhandledRejections } from "@moeswarm/testkit";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import type { DispatchHandler, IncomingDispatch } from "../src/connection-types.js";
import { FrameWriter } from "../src/frame-writer.js";
import type { FrameLink } from "../src/link.js";
import { WorkerServing } from "../src/serving.js";

// The worker's table of dispatches it holds, which has one deadline timer for all of them, makes
// no AbortController until a handler reads `signal` and answers a synchronous handler without
// promise jobs: every deadline still aborts its own dispatch at its own time (whatever order they
// came in), a lost link aborts all, a signal read late is already aborted with the same reason,
// handler errors (thrown or rejected) are error frames with their codes, and an answer after the
// deadline or the link's loss is not sent. Fake timers and clock; frames as the link gets them.

expectNoUnhandledRejections(0);
beforeEach(() => {
  vi.useFakeTimers({ toFake: ["setTimeout", "clearTimeout", "performance", "Date"] });
});
afterEach(() => {
  vi.useRealTimers();
});

type Sent = ResultFrame | ErrorFrame;

function fakeLink(sent: Sent[]): FrameLink {
  return {
    callsSent: true,
    bufferedBytes: 0,
    send: (bytes, done) => {
      sent.push(decodeFrame(bytes) as Sent);
      done?.();
    },
    close: () => {},
    destroy: () => {},
  };
}

/** A serving table on a fake link; `handler` undefined: dispatches are read from dispatches(). */
function setup(handler?: DispatchHandler) {
  const sent: Sent[] = [];
  let link: FrameLink | undefined = fakeLink(sent);
  const first = link;
  const writer = new FrameWriter(1 << 20);
  const serving = new WorkerServing({
    id: "w",
    maxIncoming: 1000,
    onDispatch: handler,
    send: (l, frame) => writer.send(l, frame),
    link: () => link,
  });
  const accept = (id: number, deadline?: number, extra: Partial<DispatchFrame> = {}) =>
    serving.accept(first, dispatchOf(id, deadline, extra));
  /** The link drops, as the connection reports it. */
  const drop = () => {
    link = undefined;
    serving.abortAll(new TransportError("MOESWARM_TRANSPORT_CLOSED", "socket closed"));
  };
  return { sent, serving, accept, drop };
}

const EMBD = 4;
const dispatchOf = (id: number, deadline?: number, extra: Partial<DispatchFrame> = {}) =>
  ({
    t: "dispatch",
    v: PROTOCOL_VERSION,
    id,
    from: "bb",
    model: "m",
    layer: 1,
    n: 1,
    embd: EMBD,
    dtype: "f32",
    x: new Float32Array(EMBD),
    k: 2,
    ids: Int32Array.of(0, 1),
    w: Float32Array.of(0.5, 0.5),
    mode: "sum",
    ...(deadline !== undefined ? { deadline } : {}),
    ...extra,
  }) as DispatchFrame;

const answerOf = (id: number) => ({ y: Float32Array.from({ length: EMBD }, (_, i) => id * 10 + i), ms: 1 });
/** Runs the promise jobs queued so far (vi.waitFor would advance the fake clock). */
async function flush(): Promise<void> {
  for (let i = 0; i < 10; i++) await Promise.resolve();
}
const codeOf = (signal: AbortSignal) => (signal.reason as { code?: string } | undefined)?.code;

/** Dispatches as a handler that keeps them (answered later by the test) sees them. */
function holding() {
  const held: IncomingDispatch[] = [];
  const handler: DispatchHandler = (req) => {
    held.push(req);
    return new Promise(() => {}); // answered by the test through respond()
  };
  return { held, handler };
}

describe("WorkerServing", () => {
  it("aborts each dispatch at its own deadline, in whatever order they came, with one timer", () => {
    const { held, handler } = holding();
    const { serving, accept, sent } = setup(handler);
    accept(1, 300);
    accept(2, 100);
    accept(3, 200);
    accept(4); // no deadline
    expect(serving.size).toBe(4);
    expect(vi.getTimerCount()).toBe(1);
    const signals = held.map((d) => d.signal); // read before the deadlines
    vi.advanceTimersByTime(99);
    expect(signals.map((s) => s.aborted)).toEqual([false, false, false, false]);
    vi.advanceTimersByTime(1);
    expect(signals.map((s) => s.aborted)).toEqual([false, true, false, false]);
    expect(codeOf(signals[1] as AbortSignal)).toBe("MOESWARM_TRANSPORT_TIMEOUT");
    vi.advanceTimersByTime(99);
    expect(signals[2]?.aborted).toBe(false);
    vi.advanceTimersByTime(1);
    expect(signals.map((s) => s.aborted)).toEqual([false, true, true, false]);
    vi.advanceTimersByTime(100);
    expect(signals.map((s) => s.aborted)).toEqual([true, true, true, false]);
    expect(String((signals[0] as AbortSignal).reason.message)).toContain("dispatch 1 outlived its deadline");
    expect(serving.size).toBe(1);
    expect(vi.getTimerCount()).toBe(0); // nothing left with a deadline
    // answers after their deadline are not sent; the one without a deadline is
    expect(held.map((d) => d.respond(answerOf(d.id)))).toEqual([false, false, false, true]);
    expect(sent.map((f) => [f.t, f.id])).toEqual([["result", 4]]);
    expect(serving.size).toBe(0);
  });

  it("makes the signal when it is first read: one read after the deadline is already aborted, with the same reason", () => {
    const { held, handler } = holding();
    const { serving, accept } = setup(handler);
    accept(1, 50);
    accept(2, 50);
    const early = (held[1] as IncomingDispatch).signal;
    expect(early).toBe((held[1] as IncomingDispatch).signal); // the same signal on every read
    vi.advanceTimersByTime(50);
    const late = (held[0] as IncomingDispatch).signal; // never read before
    expect(late.aborted).toBe(true);
    expect(codeOf(late)).toBe("MOESWARM_TRANSPORT_TIMEOUT");
    expect(early.aborted).toBe(true);
    expect(codeOf(early)).toBe("MOESWARM_TRANSPORT_TIMEOUT");
    expect(serving.size).toBe(0);
  });

  it("an answer before the deadline leaves the dispatch's signal alone; the timer sweeps the rest on time", () => {
    const { held, handler } = holding();
    const { serving, accept, sent } = setup(handler);
    accept(1, 100);
    accept(2, 150);
    const [a, b] = held.map((d) => d.signal);
    expect((held[0] as IncomingDispatch).respond(answerOf(1))).toBe(true);
    vi.advanceTimersByTime(100); // the timer armed for dispatch 1 fires: nothing is due yet
    expect(a?.aborted).toBe(false);
    expect(b?.aborted).toBe(false);
    expect(serving.size).toBe(1);
    vi.advanceTimersByTime(50);
    expect(b?.aborted).toBe(true);
    expect(sent.map((f) => [f.t, f.id])).toEqual([["result", 1]]);
    expect((held[0] as IncomingDispatch).respond(answerOf(1))).toBe(false); // answered once
    expect(sent).toHaveLength(1);
  });

  it("a dispatch that arrives with an earlier deadline than the armed one re-arms the timer", () => {
    const { held, handler } = holding();
    const { accept } = setup(handler);
    accept(1, 1000);
    vi.advanceTimersByTime(500);
    accept(2, 100); // due at 600, before dispatch 1's 1000
    const [a, b] = held.map((d) => d.signal);
    vi.advanceTimersByTime(100);
    expect([a?.aborted, b?.aborted]).toEqual([false, true]);
    vi.advanceTimersByTime(399);
    expect(a?.aborted).toBe(false);
    vi.advanceTimersByTime(1);
    expect(a?.aborted).toBe(true);
    expect(vi.getTimerCount()).toBe(0);
  });

  it("a deadline beyond setTimeout's limit is not cut short", () => {
    const { held, handler } = holding();
    const { serving, accept } = setup(handler);
    accept(1, 0xffff_ffff);
    vi.advanceTimersByTime(60_000);
    expect((held[0] as IncomingDispatch).signal.aborted).toBe(false);
    expect(serving.size).toBe(1);
    vi.advanceTimersByTime(0x7fff_ffff); // the timer fires at its limit: still not due
    expect((held[0] as IncomingDispatch).signal.aborted).toBe(false);
    vi.advanceTimersByTime(0xffff_ffff - 0x7fff_ffff - 60_000);
    expect((held[0] as IncomingDispatch).signal.aborted).toBe(true);
  });

  it("a lost link aborts every dispatch held, read or not, and their answers are not sent", async () => {
    const { held, handler } = holding();
    const { serving, accept, sent, drop } = setup(handler);
    accept(1, 100);
    accept(2);
    const read = (held[0] as IncomingDispatch).signal;
    drop();
    expect(read.aborted).toBe(true);
    expect(codeOf(read)).toBe("MOESWARM_TRANSPORT_CLOSED");
    const unread = (held[1] as IncomingDispatch).signal;
    expect(unread.aborted).toBe(true);
    expect(codeOf(unread)).toBe("MOESWARM_TRANSPORT_CLOSED");
    expect(String(unread.reason.cause?.message)).toBe("socket closed");
    expect(serving.size).toBe(0);
    expect(vi.getTimerCount()).toBe(0);
    expect(held.map((d) => d.respond(answerOf(d.id)))).toEqual([false, false]);
    expect((held[1] as IncomingDispatch).fail(new Error("x"))).toBe(false);
    vi.advanceTimersByTime(200);
    await Promise.resolve();
    expect(sent).toEqual([]);
  });

  it("answers a synchronous handler before accept returns, an async one after its promise", async () => {
    const sync = setup((req) => answerOf(req.id));
    sync.accept(7, 100);
    expect(sync.sent.map((f) => [f.t, f.id])).toEqual([["result", 7]]);
    expect(Array.from((sync.sent[0] as ResultFrame).y)).toEqual([70, 71, 72, 73]);
    expect((sync.sent[0] as ResultFrame).ms).toBe(1);
    expect(sync.serving.size).toBe(0);

    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const later = setup(async (req) => {
      await gate;
      return { y: answerOf(req.id).y }; // no ms: the handler's time
    });
    later.accept(8, 100);
    await Promise.resolve();
    expect(later.sent).toEqual([]);
    vi.advanceTimersByTime(30);
    release();
    await flush();
    expect(later.sent).toHaveLength(1);
    const r = later.sent[0] as ResultFrame;
    expect([r.t, r.id, Array.from(r.y)]).toEqual(["result", 8, [80, 81, 82, 83]]);
    expect(r.ms).toBe(30);
  });

  it("a handler's { fill } is written into the frame, synchronously or not, with the fill's ms", async () => {
    const fill = (req: IncomingDispatch) => ({
      fill: (y: Float32Array) => {
        y.set(answerOf(req.id).y);
        return 2.5;
      },
    });
    const sync = setup(fill);
    sync.accept(3, 100);
    const async = setup(async (req) => fill(req));
    async.accept(4, 100);
    expect(sync.sent).toHaveLength(1);
    await flush();
    expect(async.sent).toHaveLength(1);
    for (const [s, id] of [
      [sync, 3],
      [async, 4],
    ] as const) {
      const r = s.sent[0] as ResultFrame;
      expect([r.t, r.id, Array.from(r.y), r.ms]).toEqual(["result", id, Array.from(answerOf(id).y), 2.5]);
    }
  });

  it("turns a handler's exception, thrown or rejected, into an error frame with its code", async () => {
    const thrown = setup(() => {
      throw new TransportError("MOESWARM_TRANSPORT_DRAINING", "worker w is draining");
    });
    thrown.accept(1, 100);
    expect(thrown.sent).toEqual([
      expect.objectContaining({
        t: "error",
        id: 1,
        code: "MOESWARM_TRANSPORT_DRAINING",
        msg: "worker w is draining",
      }),
    ]);
    const rejected = setup(async () => {
      throw new InvalidArgumentError("model x is not served here");
    });
    rejected.accept(2, 100);
    await flush();
    expect(rejected.sent).toHaveLength(1);
    expect(rejected.sent[0]).toEqual(
      expect.objectContaining({
        t: "error",
        id: 2,
        code: "MOESWARM_INVALID_ARGUMENT",
        msg: "model x is not served here",
      }),
    );
    // a fill that throws is the answer's error too
    const badFill = setup(() => ({
      fill: () => {
        throw new InvalidArgumentError("the compute closed");
      },
    }));
    badFill.accept(3, 100);
    expect(badFill.sent).toEqual([
      expect.objectContaining({
        t: "error",
        id: 3,
        code: "MOESWARM_INVALID_ARGUMENT",
        msg: "the compute closed",
      }),
    ]);
    // and an answer of the wrong length a protocol error
    const short = setup(() => ({ y: new Float32Array(1) }));
    short.accept(4, 100);
    expect(short.sent).toEqual([
      expect.objectContaining({ t: "error", id: 4, code: "MOESWARM_PROTOCOL_BAD_LENGTH" }),
    ]);
    for (const s of [thrown, rejected, badFill, short]) expect(s.serving.size).toBe(0);
  });

  it("does not send an async answer that comes after the deadline, and aborts its signal on time", async () => {
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    let signal: AbortSignal | undefined;
    const { sent, serving, accept } = setup(async (req) => {
      signal = req.signal;
      await gate;
      return answerOf(req.id);
    });
    accept(1, 100);
    await Promise.resolve();
    vi.advanceTimersByTime(100);
    expect(signal?.aborted).toBe(true);
    expect(serving.size).toBe(0);
    release();
    await gate;
    await flush();
    expect(sent).toEqual([]);
    // a rejection after the deadline is not sent either
    const late = setup(async () => {
      await gate;
      vi.advanceTimersByTime(0);
      throw new Error("late");
    });
    late.accept(2, 0);
    vi.advanceTimersByTime(1);
    await flush();
    expect(late.sent).toEqual([]);
  });

  it("dispatches() skips those aborted while they waited, without making their signals", async () => {
    const { accept, serving } = setup();
    accept(1, 10);
    accept(2);
    vi.advanceTimersByTime(20);
    const it = serving.dispatches();
    const next = await it.next();
    expect((next.value as IncomingDispatch).id).toBe(2);
    serving.end();
    expect((await it.next()).done).toBe(true);
  });

  it("holds no timer per dispatch: 500 in flight, then answered, leave at most one", () => {
    const { held, handler } = holding();
    const { serving, accept, sent } = setup(handler);
    for (let i = 0; i < 500; i++) accept(i, 1000 + (i % 7) * 10);
    expect(vi.getTimerCount()).toBe(1);
    for (const d of held) d.respond(answerOf(d.id));
    expect(sent).toHaveLength(500);
    expect(serving.size).toBe(0);
    expect(vi.getTimerCount()).toBeLessThanOrEqual(1);
    vi.advanceTimersByTime(2000);
    expect(vi.getTimerCount()).toBe(0);
  });
});

import { getEventListeners } from "node:events";
import { type DispatchFrame, decodeFrame, PROTOCOL_VERSION, type ResultFrame } from "@moeswarm/core";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { FrameWriter } from "../src/frame-writer.js";
import type { FrameLink } from "../src/link.js";
import { RequestTable } from "../src/requests.js";

// The backbone's table of requests in flight, which has one deadline timer for all of them and no
// closure per request: every deadline still expires at its own time (whatever order they were
// sent in), answers, errors, aborts and a lost link settle each request once, and nothing is left
// behind (no listener on a shared signal, no entry). Fake timers and clock.

beforeEach(() => {
  vi.useFakeTimers({ toFake: ["setTimeout", "clearTimeout", "performance", "Date"] });
});
afterEach(() => {
  vi.useRealTimers();
});

function setup(bufferedBytes = 0) {
  const sent: DispatchFrame[] = [];
  const link = {
    callsSent: true,
    bufferedBytes,
    send: (bytes: Uint8Array, done?: () => void) => {
      sent.push(decodeFrame(bytes) as DispatchFrame);
      done?.();
    },
    close: () => {},
    destroy: () => {},
  } as unknown as FrameLink;
  const table = new RequestTable(new FrameWriter(1 << 20));
  const send = (deadlineMs: number, signal?: AbortSignal, to = "w") =>
    table.send({ link, to, request: request(), deadlineMs, maxQueueBytes: 1 << 20, signal });
  return { sent, table, send };
}

const request = () => ({
  model: "m",
  layer: 1,
  n: 1,
  embd: 4,
  x: new Float32Array(4),
  k: 2,
  ids: Int32Array.of(0, 1),
  w: Float32Array.of(0.5, 0.5),
  mode: "sum" as const,
});

const result = (id: number, extra: Partial<ResultFrame> = {}): ResultFrame => ({
  t: "result",
  v: PROTOCOL_VERSION,
  id,
  from: "w",
  mode: "sum",
  n: 1,
  k: 2,
  embd: 4,
  y: Float32Array.of(1, 2, 3, 4),
  ms: 0.5,
  ...extra,
});

/** The outcome of each promise so far: its value's `from`, its error's code, or "waiting". */
function outcomes(promises: Promise<unknown>[]): () => string[] {
  const seen = promises.map(() => "waiting");
  for (const [i, p] of promises.entries()) {
    p.then(
      (r) => {
        seen[i] = `ok ${(r as { from: string }).from}`;
      },
      (e) => {
        seen[i] = (e as { code?: string }).code ?? String(e);
      },
    );
  }
  return () => [...seen];
}

describe("RequestTable", () => {
  it("times each request out at its own deadline, in whatever order they were sent", async () => {
    const { send, table } = setup();
    const a = send(100);
    const b = send(50);
    await vi.advanceTimersByTimeAsync(20);
    const c = send(100); // due at 120
    const seen = outcomes([a, b, c]);
    await vi.advanceTimersByTimeAsync(29);
    expect(seen()).toEqual(["waiting", "waiting", "waiting"]);
    await vi.advanceTimersByTimeAsync(1); // t=50
    expect(seen()).toEqual(["waiting", "MOESWARM_TRANSPORT_TIMEOUT", "waiting"]);
    await vi.advanceTimersByTimeAsync(50); // t=100
    expect(seen()).toEqual(["MOESWARM_TRANSPORT_TIMEOUT", "MOESWARM_TRANSPORT_TIMEOUT", "waiting"]);
    await vi.advanceTimersByTimeAsync(19);
    expect(seen()[2]).toBe("waiting");
    await vi.advanceTimersByTimeAsync(1); // t=120
    expect(seen()[2]).toBe("MOESWARM_TRANSPORT_TIMEOUT");
    await expect(a).rejects.toMatchObject({ details: { to: "w", deadlineMs: 100 } });
    await expect(a).rejects.toThrow("w did not answer within 100 ms");
    expect(table.size).toBe(0);
  });

  it("waits out a deadline beyond setTimeout's limit (about 24.8 days) instead of timing out at once", async () => {
    const { send } = setup();
    const month = 30 * 24 * 3600 * 1000;
    const seen = outcomes([send(month)]);
    await vi.advanceTimersByTimeAsync(60_000);
    expect(seen()).toEqual(["waiting"]);
    await vi.advanceTimersByTimeAsync(month - 60_000);
    expect(seen()).toEqual(["MOESWARM_TRANSPORT_TIMEOUT"]);
  });

  it("resolves answered requests once: a late answer or timer changes nothing, and later deadlines still hold", async () => {
    const { send, table, sent } = setup();
    const a = send(100);
    const b = send(100);
    const seen = outcomes([a, b]);
    table.result(result(sent[0]!.id));
    await vi.advanceTimersByTimeAsync(0);
    expect(seen()).toEqual(["ok w", "waiting"]);
    await expect(a).resolves.toMatchObject({ y: Float32Array.of(1, 2, 3, 4), ms: 0.5, from: "w" });
    // the timer was armed for a's deadline; b (sent at the same time) expires with it
    await vi.advanceTimersByTimeAsync(100);
    expect(seen()).toEqual(["ok w", "MOESWARM_TRANSPORT_TIMEOUT"]);
    table.result(result(sent[1]!.id));
    expect(seen()).toEqual(["ok w", "MOESWARM_TRANSPORT_TIMEOUT"]);
    // a request after all that: its own full deadline
    const c = send(30);
    const later = outcomes([c]);
    await vi.advanceTimersByTimeAsync(29);
    expect(later()).toEqual(["waiting"]);
    await vi.advanceTimersByTimeAsync(1);
    expect(later()).toEqual(["MOESWARM_TRANSPORT_TIMEOUT"]);
  });

  it("rejects a result of the wrong shape, an error frame with its typed error, and all on a lost link", async () => {
    const { send, table, sent } = setup();
    const ps = [send(1000), send(1000), send(1000), send(1000)];
    const seen = outcomes(ps);
    table.result(result(sent[0]!.id, { n: 2, y: new Float32Array(8) }));
    table.error({
      t: "error",
      v: PROTOCOL_VERSION,
      id: sent[1]!.id,
      code: "MOESWARM_NATIVE_COMPUTE",
      msg: "no",
    });
    table.failAll(new Error("gone"));
    await vi.advanceTimersByTimeAsync(0);
    expect(seen()).toEqual([
      "MOESWARM_PROTOCOL_BAD_LENGTH",
      "MOESWARM_NATIVE_COMPUTE",
      "MOESWARM_TRANSPORT_CLOSED",
      "MOESWARM_TRANSPORT_CLOSED",
    ]);
    await expect(ps[1]).rejects.toMatchObject({ details: { from: "w" } });
    expect(table.size).toBe(0);
    // nothing fires later
    await vi.advanceTimersByTimeAsync(2000);
    expect(seen()[3]).toBe("MOESWARM_TRANSPORT_CLOSED");
  });

  it("an abort rejects with the signal's reason, and a shared signal keeps no listener of a settled request", async () => {
    const { send, table, sent } = setup();
    const shared = new AbortController();
    const reqs = [send(1000, shared.signal), send(1000, shared.signal), send(1000, shared.signal)];
    const seen = outcomes(reqs);
    expect(getEventListeners(shared.signal, "abort")).toHaveLength(3);
    table.result(result(sent[0]!.id));
    await vi.advanceTimersByTimeAsync(1000); // the second and third time out
    expect(seen()).toEqual(["ok w", "MOESWARM_TRANSPORT_TIMEOUT", "MOESWARM_TRANSPORT_TIMEOUT"]);
    expect(getEventListeners(shared.signal, "abort")).toHaveLength(0);
    const own = new AbortController();
    const d = send(1000, own.signal);
    const reason = new Error("caller stopped");
    own.abort(reason);
    await expect(d).rejects.toBe(reason);
    expect(table.size).toBe(0);
    expect(getEventListeners(own.signal, "abort")).toHaveLength(0);
    // an aborted signal: refused at once, nothing sent
    const before = sent.length;
    expect(() => send(1000, own.signal)).toThrow(reason);
    expect(sent.length).toBe(before);
  });

  it("refuses a send over the queue limit at once, leaving nothing pending", () => {
    const { table } = setup(1 << 20);
    const link = { callsSent: true, bufferedBytes: 1 << 20, send: () => {} } as unknown as FrameLink;
    expect(() =>
      table.send({
        link,
        to: "w",
        request: request(),
        deadlineMs: 100,
        maxQueueBytes: 1 << 20,
        signal: undefined,
      }),
    ).toThrow(expect.objectContaining({ code: "MOESWARM_TRANSPORT_BACKPRESSURE" }));
    expect(table.size).toBe(0);
    expect(vi.getTimerCount()).toBe(0);
  });
});

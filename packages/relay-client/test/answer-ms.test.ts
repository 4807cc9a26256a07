import { type DispatchFrame, PROTOCOL_VERSION } from "@moeswarm/core";
import { expectNoUnhandledRejections, waitFor } from "@moeswarm/testkit";
import { afterEach, describe, expect, it } from "vitest";
import { connectRelay, type DispatchHandler, type RelayConnection } from "../src/index.js";
import { FakeRelay } from "./fake-relay.js";

// A worker whose `fill` computes the answer (the compute runs while the result frame is written)
// returns the compute's time: that is the frame's `ms`, on a plain and on a compact answer; a
// handler's own `ms` wins; a fill that returns nothing still gets an ms that covers the fill.
// Real WebSocket sockets to a fake relay, which decodes what arrives.

expectNoUnhandledRejections(0);
let relay: FakeRelay;
const open: RelayConnection[] = [];

afterEach(async () => {
  await Promise.all(open.splice(0).map((c) => c.close()));
  await relay?.close();
});

const dispatchOf = (id: number, extra: Partial<DispatchFrame> = {}) =>
  ({
    t: "dispatch",
    v: PROTOCOL_VERSION,
    id,
    from: "bb",
    model: "m",
    layer: 1,
    n: 2,
    embd: 8,
    dtype: "f32",
    x: new Float32Array(16),
    k: 2,
    ids: Int32Array.from([0, -1, 2, 3]),
    mode: "sum",
    w: new Float32Array(4).fill(0.5),
    ...extra,
  }) as DispatchFrame;

async function worker(onDispatch: DispatchHandler): Promise<void> {
  relay = await FakeRelay.start();
  open.push(await connectRelay(relay.url, { role: "worker", id: "w", token: "good", onDispatch }));
}

/** Holds the thread for `ms` (a compute's stand-in; read off the monotonic clock, not raced). */
function busy(ms: number): void {
  const end = performance.now() + ms;
  while (performance.now() < end) {}
}

describe("the ms of an answer written into the frame", () => {
  it("is what fill returns, on a plain and on a compact answer; a handler's ms wins", async () => {
    await worker((req) => ({
      ...(req.id === 3 ? { ms: 9.5 } : {}),
      fill: (y) => {
        y.fill(req.id);
        return 0.375 + req.id;
      },
    }));
    relay.send(relay.last, dispatchOf(1));
    relay.send(relay.last, dispatchOf(2, { mode: "each", compact: true, w: undefined }));
    relay.send(relay.last, dispatchOf(3));
    await waitFor(() => relay.framesOf("result").length === 3, "results");
    const results = relay.framesOf("result").sort((a, b) => a.id - b.id);
    expect(results.map((r) => [r.id, r.ms, r.compact])).toEqual([
      [1, 1.375, undefined],
      [2, 2.375, true],
      [3, 9.5, undefined],
    ]);
    // the compact answer: the filled slots' rows (3 of 4), each of the computed values
    expect(Array.from(results[1]!.y as Float32Array)).toEqual(new Array(24).fill(2));
    expect(Array.from(results[0]!.y as Float32Array)).toEqual(new Array(16).fill(1));
  });

  it("covers the fill when fill returns nothing, and a fill that returns a bad ms is answered with an error", async () => {
    await worker((req) => ({
      fill: (y) => {
        y.fill(1);
        if (req.id === 2) return -1;
        busy(3);
      },
    }));
    relay.send(relay.last, dispatchOf(1));
    relay.send(relay.last, dispatchOf(2));
    await waitFor(
      () => relay.framesOf("result").length === 1 && relay.framesOf("error").length === 1,
      "answers",
    );
    expect(relay.framesOf("result")[0]!.ms).toBeGreaterThanOrEqual(3);
    expect(relay.framesOf("error")[0]).toMatchObject({ id: 2, code: "MOESWARM_INVALID_ARGUMENT" });
  });
});

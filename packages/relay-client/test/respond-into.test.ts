import { type DispatchFrame, decodeFrame, PROTOCOL_VERSION, type ResultFrame } from "@moeswarm/core";
import { expectNoUnhandledRejections, waitFor } from "@moeswarm/testkit";
import { afterEach, describe, expect, it } from "vitest";
import { connectRelay, type IncomingDispatch, type RelayConnection } from "../src/index.js";
import { FakeRelay } from "./fake-relay.js";
import { recordingDialer } from "./fixtures.js";

// respondInto: the answer's y written by the worker's compute straight into the result frame's
// memory. Each frame must carry exactly the computed y, bit for bit; the memory lent to `fill` is
// the frame's (no copy of y of its own), and it is never reused while a send still holds it: a
// link that calls sent gets the connection's reused memory, one that keeps its bytes gets
// memory of each frame's own. Real WebSocket sockets to a fake relay, which decodes what arrives.

expectNoUnhandledRejections(0);
let relay: FakeRelay;
const open: RelayConnection[] = [];

afterEach(async () => {
  await Promise.all(open.splice(0).map((c) => c.close()));
  await relay?.close();
});

const bitsOf = (a: Float32Array) => Buffer.from(a.buffer, a.byteOffset, a.byteLength).toString("hex");

/** The answer a compute gives a dispatch: distinct per request, with -0, NaN bits and denormals. */
function computed(req: IncomingDispatch): Float32Array {
  const y = new Float32Array((req.mode === "each" ? req.n * req.k : req.n) * req.embd);
  for (let i = 0; i < y.length; i++) y[i] = req.id * 1000 + i + 0.25;
  y[0] = -0;
  if (y.length > 2) {
    new Uint32Array(y.buffer, 4, 2).set([0x7fc0_1234, 0x0000_0001]);
  }
  return y;
}

const dispatchOf = (id: number, n: number, embd: number, extra: Partial<DispatchFrame> = {}) =>
  ({
    t: "dispatch",
    v: PROTOCOL_VERSION,
    id,
    from: "bb",
    model: "m",
    layer: 1,
    n,
    embd,
    dtype: "f32",
    x: new Float32Array(n * embd),
    k: 2,
    ids: Int32Array.from({ length: n * 2 }, (_, i) => (i % 3 === 1 ? -1 : i)),
    mode: "sum",
    w: new Float32Array(n * 2).fill(0.5),
    ...extra,
  }) as DispatchFrame;

async function worker(
  sent: Uint8Array[],
  callsSent: boolean,
  onFill: (req: IncomingDispatch, y: Float32Array) => void = (req, y) => y.set(computed(req)),
): Promise<{ views: Float32Array[] }> {
  relay = await FakeRelay.start();
  const views: Float32Array[] = [];
  const conn = await connectRelay(relay.url, {
    role: "worker",
    id: "w",
    token: "good",
    dial: recordingDialer(sent, callsSent),
  });
  open.push(conn);
  (async () => {
    for await (const req of conn.dispatches()) {
      req.respondInto({
        ms: 2,
        fill: (y) => {
          views.push(y);
          onFill(req, y);
        },
      });
    }
  })();
  return { views };
}

/** Falling sizes: each frame is written over the last one's memory when that is reused. */
const SIZES = [64, 17, 8, 3, 1];

describe("respondInto", () => {
  it("sends each computed y bit for bit, written in the connection's reused memory on a link that calls sent", async () => {
    const sent: Uint8Array[] = [];
    const { views } = await worker(sent, true);
    // one at a time: each answer is written (and its memory taken back) before the next is encoded
    for (const [i, n] of SIZES.entries()) {
      relay.send(relay.last, dispatchOf(i + 1, n, 96));
      await waitFor(() => relay.framesOf("result").length === i + 1, "result");
    }
    const results = relay.framesOf("result");
    const expected = results.map((r) =>
      bitsOf(computed({ id: r.id, mode: "sum", n: r.n, k: 2, embd: 96 } as IncomingDispatch)),
    );
    expect(results.map((r) => bitsOf(r.y as Float32Array))).toEqual(expected);
    expect(results.map((r) => [r.id, r.ms, r.to])).toEqual(SIZES.map((_, i) => [i + 1, 2, "bb"]));
    // y was written into the frame itself: each view lies inside the bytes that were sent
    const frames = sent.filter((b) => b.byteLength > 300);
    expect(frames).toHaveLength(SIZES.length);
    for (const [i, view] of views.entries()) {
      expect(view.buffer).toBe(frames[i]!.buffer);
      expect(view.byteOffset).toBeGreaterThan(frames[i]!.byteOffset);
      expect(view.byteOffset % 8).toBe(0);
    }
    // and every frame was lent out of one piece of memory, taken back after each write
    expect(new Set(frames.map((b) => b.buffer)).size).toBe(1);
  });

  it("never reuses memory a link still holds: each kept frame is still its own y after later answers", async () => {
    const sent: Uint8Array[] = [];
    await worker(sent, false);
    for (const [i, n] of SIZES.entries()) relay.send(relay.last, dispatchOf(i + 1, n, 96));
    await waitFor(() => relay.framesOf("result").length === SIZES.length, "results");
    const kept = sent.map((b) => decodeFrame(b)).filter((f): f is ResultFrame => f.t === "result");
    expect(kept).toHaveLength(SIZES.length);
    for (const r of kept) {
      const y = computed({ id: r.id, mode: "sum", n: r.n, k: 2, embd: 96 } as IncomingDispatch);
      expect(bitsOf(r.y)).toBe(bitsOf(y));
    }
  });

  it("sends the filled slots' rows of a compact dispatch, and an error frame when fill throws", async () => {
    const sent: Uint8Array[] = [];
    await worker(sent, true, (req, y) => {
      if (req.layer === 9) throw new Error("compute failed");
      y.set(computed(req));
    });
    relay.send(relay.last, dispatchOf(1, 2, 4, { mode: "each", compact: true, w: undefined }));
    relay.send(relay.last, dispatchOf(2, 2, 4, { layer: 9 }));
    await waitFor(
      () => relay.framesOf("result").length === 1 && relay.framesOf("error").length === 1,
      "answers",
    );
    const [result] = relay.framesOf("result");
    const full = computed({ id: 1, mode: "each", n: 2, k: 2, embd: 4 } as IncomingDispatch);
    // ids [0, -1, 2, 3]: slots 0, 2 and 3 filled
    // (copied as floats, not through JS numbers, which would canonicalise the NaN's payload)
    const rows = new Float32Array(12);
    for (const [r, s] of [0, 2, 3].entries()) rows.set(full.subarray(s * 4, s * 4 + 4), r * 4);
    expect(result).toMatchObject({ id: 1, compact: true });
    expect(bitsOf(result!.y as Float32Array)).toBe(bitsOf(rows));
    expect(relay.framesOf("error")[0]).toMatchObject({ id: 2, msg: "compute failed" });
  });

  it("answers a fill that is not a function with an error frame", async () => {
    relay = await FakeRelay.start();
    const conn = await connectRelay(relay.url, { role: "worker", id: "w", token: "good" });
    open.push(conn);
    relay.send(relay.last, dispatchOf(5, 1, 4));
    const inbox = conn.dispatches();
    const req = (await inbox.next()).value as IncomingDispatch;
    expect(req.respondInto({} as never)).toBe(true);
    await waitFor(() => relay.framesOf("error").length === 1, "error");
    expect(relay.framesOf("error")[0]).toMatchObject({ id: 5, code: "MOESWARM_INVALID_ARGUMENT" });
  });

  it("takes { fill } from an onDispatch handler too", async () => {
    relay = await FakeRelay.start();
    const conn = await connectRelay(relay.url, {
      role: "worker",
      id: "w",
      token: "good",
      onDispatch: async (req) => ({ fill: (y) => y.set(computed(req)) }),
    });
    open.push(conn);
    relay.send(relay.last, dispatchOf(3, 4, 32));
    await waitFor(() => relay.framesOf("result").length === 1, "result");
    const [r] = relay.framesOf("result");
    expect(bitsOf(r!.y as Float32Array)).toBe(
      bitsOf(computed({ id: 3, mode: "sum", n: 4, k: 2, embd: 32 } as IncomingDispatch)),
    );
    expect(r!.ms).toBeGreaterThanOrEqual(0);
  });
});

import { DispatchError, TransportError } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import {
  createReferenceWorker,
  dispatchExperts,
  dispatchExpertsDetailed,
  Placement,
  WorkerThreadTransport,
} from "../src/index.js";
import { randomHidden, randomRouting, sameBits, tinyModel } from "./helpers.js";

// The threads run test/fixtures/thread-worker.mjs, which imports the built dist/ (build first).
const script = new URL("./fixtures/thread-worker.mjs", import.meta.url);
const model = tinyModel(21, { nExpert: 6, nEmbd: 8, nFf: 4 });
const experts = Array.from({ length: 6 }, (_, e) => model.expert(0, e));
const spec = (behaviour?: string) => ({ script, workerData: { nEmbd: 8, experts, behaviour } });
const hidden = randomHidden(22, 7, 8);
const routing = randomRouting(23, 7, 3, 6);
const local = createReferenceWorker(model);

const placementOf = (workers: Record<string, number[]>) =>
  Placement.fromRegistrations(
    Object.entries(workers).map(([id, e]) => ({ id, model: "tiny", layers: [0], experts: e })),
  );

describe("WorkerThreadTransport", () => {
  it("gives bit-identical results to in-process workers, tensors transferred both ways", async () => {
    await using transport = new WorkerThreadTransport({ a: spec(), b: spec() });
    const placement = placementOf({ a: [0, 1, 2], b: [3, 4, 5] });
    const viaThreads = await dispatchExperts(hidden, routing, { layer: 0, placement, transport });
    const single = placementOf({ solo: [0, 1, 2, 3, 4, 5] });
    const { InProcessTransport } = await import("../src/index.js");
    const inproc = await dispatchExperts(hidden, routing, {
      layer: 0,
      placement: single,
      transport: new InProcessTransport({ solo: local }),
    });
    expect(sameBits(viaThreads, inproc)).toBe(true);
    const sum = await dispatchExperts(hidden, routing, { layer: 0, placement, transport, mode: "sum" });
    expect(sum).toHaveLength(hidden.length);
  });

  it("copies a request's Buffer view before transferring it: the caller's buffer stays whole", async () => {
    await using transport = new WorkerThreadTransport({ a: spec() });
    const memory = Buffer.alloc(4096, 7);
    const x = memory.subarray(100, 134); // one q8_0 block, as a Buffer view
    const request = {
      model: "tiny",
      layer: 0,
      n: 1,
      embd: 32,
      dtype: "q8_0" as const,
      x,
      k: 1,
      ids: new Int32Array([0]),
      mode: "each" as const,
    };
    // the reference worker takes no q8_0: the answer does not matter here, the caller's memory does
    await transport.request("a", request, { signal: new AbortController().signal }).catch(() => {});
    expect(memory.byteLength).toBe(4096);
    expect(x.byteLength).toBe(34);
    expect(x[0]).toBe(7);
  });

  it("a thread that crashes, throws, hangs or answers garbage fails over to the fallback", async () => {
    const want = await dispatchExperts(hidden, routing, {
      layer: 0,
      placement: placementOf({ solo: [0, 1, 2, 3, 4, 5] }),
      transport: new (await import("../src/index.js")).InProcessTransport({ solo: local }),
    });
    for (const behaviour of ["crash", "throw", "hang", "garbage"]) {
      await using transport = new WorkerThreadTransport({ bad: spec(behaviour) });
      const r = await dispatchExpertsDetailed(hidden, routing, {
        layer: 0,
        placement: placementOf({ bad: [0, 1, 2, 3, 4, 5] }),
        transport,
        fallback: local,
        deadlineMs: 600,
      });
      expect(sameBits(r.output, want), behaviour).toBe(true);
      expect(r.metrics.fallbacks).toBe(1);
    }
  });

  it("rejects typed errors for unknown or crashed threads and after close", async () => {
    const transport = new WorkerThreadTransport({ c: spec("crash") });
    const signal = new AbortController().signal;
    const req = {
      model: "tiny",
      layer: 0,
      n: 1,
      embd: 8,
      dtype: "f32" as const,
      x: new Float32Array(8),
      k: 1,
      ids: Int32Array.from([0]),
      mode: "each" as const,
    };
    await expect(transport.request("nope", req, { signal })).rejects.toBeInstanceOf(TransportError);
    await expect(transport.request("c", req, { signal })).rejects.toMatchObject({
      code: "MOESWARM_TRANSPORT_CLOSED",
    });
    await expect(transport.request("c", req, { signal })).rejects.toMatchObject({
      code: "MOESWARM_TRANSPORT_CLOSED",
    });
    await transport.close();
    await expect(transport.request("c", req, { signal })).rejects.toBeInstanceOf(TransportError);
    const e = await dispatchExperts(hidden, routing, {
      layer: 0,
      placement: placementOf({ c: [0, 1, 2, 3, 4, 5] }),
      transport,
    }).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(DispatchError);
  });
});

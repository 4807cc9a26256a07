// quantizingTransport with a stand-in quantizer and owners that take, refuse or cannot check q8:
// what goes out, what is sent again in f32, and what is remembered per owner and layer.
import {
  type ActivationQuantizer,
  type ExpertRequest,
  type ExpertResult,
  type ExpertTransport,
  NativeError,
  ProtocolError,
} from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import { quantizingTransport } from "../src/index.js";

const EMBD = 64;

function request(layer: number): ExpertRequest {
  return {
    model: "m",
    layer,
    n: 1,
    embd: EMBD,
    dtype: "f32",
    x: new Float32Array(EMBD).fill(0.5),
    k: 1,
    ids: new Int32Array([0]),
    mode: "each",
  };
}

/** Layer 0 travels as q8_0, layer 1 as f32; `roundTrips` as told. */
function quantizer(roundTrips: () => boolean): ActivationQuantizer {
  return {
    wireDtype: (layer) => (layer === 0 ? "q8_0" : undefined),
    quantize: (_dtype, x, embd) => new Uint8Array((x.length / embd) * (embd / 32) * 34),
    roundTrips: () => roundTrips(),
  };
}

/** Records each request's dtype; `refuse(owner, req)` returns an error to throw, or undefined. */
function recorder(refuse: (owner: string, req: ExpertRequest) => Error | undefined) {
  const seen: Array<{ owner: string; dtype: string }> = [];
  const transport: ExpertTransport = {
    trusted: false,
    async request(owner, req): Promise<ExpertResult> {
      seen.push({ owner, dtype: req.dtype });
      const e = refuse(owner, req);
      if (e) throw e;
      return { mode: "each", n: 1, k: 1, embd: EMBD, y: new Float32Array(EMBD) };
    },
  };
  return { seen, transport };
}

const signal = new AbortController().signal;

describe("quantizingTransport", () => {
  it("q8 where the layer allows it, f32 elsewhere; the f32 bytes it saved", async () => {
    const { seen, transport } = recorder(() => undefined);
    const t = quantizingTransport(
      transport,
      quantizer(() => true),
    );
    expect(t.trusted).toBe(false);
    await t.request("a", request(0), { signal });
    await t.request("a", request(1), { signal });
    expect(seen.map((s) => s.dtype)).toEqual(["q8_0", "f32"]);
    expect(t.metrics()).toMatchObject({ quantized: 1, bytesQuantized: 68, bytesF32: 256, refusedDtype: 0 });
  });

  it("an owner that cannot take q8 (WIRE_DTYPE) gets f32 again, and f32 from then on for that layer", async () => {
    const { seen, transport } = recorder((owner, req) =>
      owner === "gpu" && req.dtype !== "f32"
        ? new NativeError("MOESWARM_NATIVE_WIRE_DTYPE", "f32 only")
        : undefined,
    );
    const t = quantizingTransport(
      transport,
      quantizer(() => true),
    );
    await t.request("gpu", request(0), { signal });
    await t.request("gpu", request(0), { signal });
    await t.request("cpu", request(0), { signal });
    expect(seen.map((s) => `${s.owner}:${s.dtype}`)).toEqual(["gpu:q8_0", "gpu:f32", "gpu:f32", "cpu:q8_0"]);
    expect(t.metrics().refusedDtype).toBe(1);
  });

  it("an old codec (BAD_FIELD) is remembered for the whole owner", async () => {
    const { seen, transport } = recorder((_owner, req) =>
      req.dtype !== "f32" ? new ProtocolError("MOESWARM_PROTOCOL_BAD_FIELD", "dispatch.dtype") : undefined,
    );
    const t = quantizingTransport(
      transport,
      quantizer(() => true),
    );
    await t.request("old", request(0), { signal });
    await t.request("old", request(0), { signal });
    expect(seen.map((s) => s.dtype)).toEqual(["q8_0", "f32", "f32"]);
  });

  it("repacked weights (WIRE_INEXACT): sent again in f32, then checked here before each request", async () => {
    let trips = false;
    const { seen, transport } = recorder((_owner, req) =>
      req.dtype !== "f32" && !trips ? new NativeError("MOESWARM_NATIVE_WIRE_INEXACT", "row 0") : undefined,
    );
    const t = quantizingTransport(
      transport,
      quantizer(() => trips),
    );
    await t.request("rp", request(0), { signal });
    await t.request("rp", request(0), { signal }); // does not round-trip: f32 at once
    trips = true;
    await t.request("rp", request(0), { signal }); // round-trips: q8
    expect(seen.map((s) => s.dtype)).toEqual(["q8_0", "f32", "f32", "q8_0"]);
    expect(t.metrics()).toMatchObject({ refusedInexact: 1, sentF32Inexact: 1, quantized: 1 });
  });

  it("advertised dtypes: q8 from the first request to an owner that lists it, f32 at once to one that lists others", async () => {
    const { seen, transport } = recorder((owner, req) =>
      owner === "gpu" && req.dtype !== "f32"
        ? new NativeError("MOESWARM_NATIVE_WIRE_DTYPE", "f32 only")
        : undefined,
    );
    const advertised: Record<string, readonly string[]> = {
      cpu: ["f32", "f16", "bf16", "q8_0", "q8_K"],
      gpu: ["f32", "f16", "bf16"],
    };
    const t = quantizingTransport(
      transport,
      quantizer(() => true),
      { dtypes: (owner) => advertised[owner] },
    );
    for (let i = 0; i < 3; i++) {
      await t.request("cpu", request(0), { signal });
      await t.request("gpu", request(0), { signal });
    }
    // not one refusal, not one resend: each owner saw its dtype from its first request on
    expect(seen.map((s) => `${s.owner}:${s.dtype}`)).toEqual([
      "cpu:q8_0",
      "gpu:f32",
      "cpu:q8_0",
      "gpu:f32",
      "cpu:q8_0",
      "gpu:f32",
    ]);
    expect(t.metrics()).toMatchObject({
      quantized: 3,
      quantizedByDtype: { q8_0: 3, q8_K: 0 },
      refusedDtype: 0,
      refusedAdvertised: 0,
      sentF32Unadvertised: 3,
    });
  });

  it("an owner that said nothing (an older worker) is tried once per layer and learnt from, as before", async () => {
    const { seen, transport } = recorder((owner, req) =>
      owner === "old" && req.dtype !== "f32"
        ? new NativeError("MOESWARM_NATIVE_WIRE_DTYPE", "f32 only")
        : undefined,
    );
    const t = quantizingTransport(
      transport,
      quantizer(() => true),
      { dtypes: (owner) => (owner === "new" ? ["f32", "q8_0"] : undefined) },
    );
    await t.request("old", request(0), { signal });
    await t.request("old", request(0), { signal });
    expect(seen.map((s) => `${s.owner}:${s.dtype}`)).toEqual(["old:q8_0", "old:f32", "old:f32"]);
    expect(t.metrics()).toMatchObject({ refusedDtype: 1, refusedAdvertised: 0, sentF32Unadvertised: 0 });
  });

  it("an owner that advertises q8 and refuses it costs one resend, then gets f32 on every layer", async () => {
    const twoLayers: ActivationQuantizer = {
      ...quantizer(() => true),
      wireDtype: (layer) => (layer <= 1 ? "q8_0" : undefined),
    };
    const { seen, transport } = recorder((owner, req) =>
      owner === "liar" && req.dtype !== "f32"
        ? new NativeError("MOESWARM_NATIVE_WIRE_DTYPE", "f32 only after all")
        : undefined,
    );
    const t = quantizingTransport(transport, twoLayers, { dtypes: () => ["f32", "q8_0", "q8_K"] });
    await t.request("liar", request(0), { signal });
    await t.request("liar", request(0), { signal });
    await t.request("liar", request(1), { signal }); // another layer: its word is not taken again
    await t.request("honest", request(1), { signal });
    expect(seen.map((s) => `${s.owner}:${s.dtype}`)).toEqual([
      "liar:q8_0",
      "liar:f32",
      "liar:f32",
      "liar:f32",
      "honest:q8_0",
    ]);
    expect(t.metrics()).toMatchObject({ refusedDtype: 1, refusedAdvertised: 1, quantized: 1 });
  });

  it("other failures pass through untouched (failover is dispatch's)", async () => {
    const { transport } = recorder(() => new NativeError("MOESWARM_NATIVE_COMPUTE", "boom"));
    const t = quantizingTransport(
      transport,
      quantizer(() => true),
    );
    await expect(t.request("a", request(0), { signal })).rejects.toMatchObject({
      code: "MOESWARM_NATIVE_COMPUTE",
    });
  });
});

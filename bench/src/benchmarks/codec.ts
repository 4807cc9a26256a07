import {
  type DispatchFrame,
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  FrameEncoder,
  rerouteFrame,
} from "@moeswarm/core";
import { type Benchmark, gbPerSecond, measure, type Row } from "../harness.js";

// Encode + decode of a dispatch frame (f32 activations, n_embd 3072, k = 8 with ids and router
// weights) against a plain Buffer.copy of the same number of bytes, measured in the same run.
// The figure is codec GB/s / copy GB/s: 0.5 would mean the codec costs two copies of the frame.
// Two encoders: encodeFrame (fresh memory per frame: the bytes are the caller's for good) and a
// FrameEncoder (its memory reused: the relay client keeps a few and lends each frame's bytes until
// its socket has written them).

const EMBD = 3072;
const K = 8;
const TOKENS = [1, 8, 64];

function frameFor(n: number): DispatchFrame {
  const x = new Float32Array(n * EMBD);
  for (let i = 0; i < x.length; i++) x[i] = Math.sin(i) * 3;
  const ids = new Int32Array(n * K);
  const w = new Float32Array(n * K);
  for (let i = 0; i < ids.length; i++) {
    ids[i] = (i * 37) % 128;
    w[i] = 1 / K;
  }
  return dispatchFrame({
    id: 123456,
    model: "qwen3-30b-a3b",
    layer: 17,
    n,
    embd: EMBD,
    dtype: "f32",
    x,
    k: K,
    ids,
    w,
    mode: "sum",
    deadline: 5000,
  });
}

export const codec: Benchmark = {
  name: "codec",
  description: `dispatch frame encode+decode (f32, n_embd ${EMBD}, k ${K}) vs Buffer.copy of the same bytes`,
  async run() {
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    const notes: string[] = [];
    for (const n of TOKENS) {
      const frame = frameFor(n);
      const payload = encodeFrame(frame);
      const bytes = payload.byteLength;
      const decoded = decodeFrame(payload) as DispatchFrame;
      if (decoded.x.length !== frame.x.length || decoded.x[5] !== frame.x[5])
        throw new Error("codec mismatch");
      const xView = decoded.x.buffer === payload.buffer;
      // enough calls per sample that timer overhead does not dominate the small frames
      const batch = Math.max(1, Math.floor(4_000_000 / bytes));
      const src = Buffer.alloc(bytes, 1);
      const dst = Buffer.alloc(bytes);
      const copy = await measure(`copy n=${n}`, () => src.copy(dst), { batch, warmup: 20 });
      // a second reference: the same copy into fresh memory, as any codec that returns new
      // buffers must pay for
      const allocCopy = await measure(`alloc+copy n=${n}`, () => src.copy(Buffer.allocUnsafeSlow(bytes)), {
        batch,
        warmup: 20,
      });
      const encode = await measure(`encode n=${n}`, () => encodeFrame(frame), { batch, warmup: 20 });
      const decode = await measure(`decode n=${n}`, () => decodeFrame(payload), { batch, warmup: 20 });
      const both = await measure(`encode+decode n=${n}`, () => decodeFrame(encodeFrame(frame)), {
        batch,
        warmup: 20,
      });
      const encoder = new FrameEncoder();
      const lent = encoder.encode(frame, (b) => Buffer.from(b));
      if (!lent.equals(Buffer.from(payload))) throw new Error("FrameEncoder differs from encodeFrame");
      const reusedEncode = await measure(`encode (reused) n=${n}`, () => encoder.encode(frame, (b) => b[0]), {
        batch,
        warmup: 20,
      });
      const reusedBoth = await measure(
        `encode (reused)+decode n=${n}`,
        () => encoder.encode(frame, (b) => decodeFrame(b)),
        { batch, warmup: 20 },
      );
      // the relay's forwarding of this frame as received (at an odd offset, as a socket delivers
      // it): before, decoded and re-encoded with new routing fields; now, validated without
      // decoding x and rerouted (routing fields rewritten, the rest copied once)
      const received = new Uint8Array(bytes + 1).subarray(1);
      received.set(payload);
      const max = 64 * 1024 * 1024;
      const reencode = await measure(
        `relay re-encode n=${n}`,
        () => {
          const f = decodeFrame(received, { maxFrameBytes: max }) as DispatchFrame;
          return encodeFrame({ ...f, id: 7, from: "bb", to: "w" }, { maxFrameBytes: max });
        },
        { batch, warmup: 20 },
      );
      const reroute = await measure(
        `relay reroute n=${n}`,
        () => {
          decodeFrame(received, { maxFrameBytes: max, raw: true });
          return rerouteFrame(received, { id: 7, from: "bb", to: "w" }, max);
        },
        { batch, warmup: 20 },
      );
      const copyGbs = gbPerSecond(bytes, copy.medianNs);
      const allocCopyGbs = gbPerSecond(bytes, allocCopy.medianNs);
      const bothGbs = gbPerSecond(bytes, both.medianNs);
      const reusedBothGbs = gbPerSecond(bytes, reusedBoth.medianNs);
      rows.push({
        tokens: n,
        bytes,
        "encode GB/s": gbPerSecond(bytes, encode.medianNs),
        "decode GB/s": gbPerSecond(bytes, decode.medianNs),
        "enc+dec GB/s": bothGbs,
        "enc+dec us": both.medianNs / 1000,
        "copy GB/s": copyGbs,
        "alloc+copy GB/s": allocCopyGbs,
        "codec/copy": bothGbs / copyGbs,
        "codec/alloc+copy": bothGbs / allocCopyGbs,
        "reused enc GB/s": gbPerSecond(bytes, reusedEncode.medianNs),
        "reused enc+dec us": reusedBoth.medianNs / 1000,
        "reused codec/copy": reusedBothGbs / copyGbs,
        "relay re-encode us": reencode.medianNs / 1000,
        "relay reroute us": reroute.medianNs / 1000,
      });
      ratios[`relay forward re-encode/reroute n=${n}`] = reencode.medianNs / reroute.medianNs;
      ratios[`relay reroute/alloc+copy n=${n}`] = reroute.medianNs / allocCopy.medianNs;
      ratios[`codec/copy n=${n}`] = bothGbs / copyGbs;
      ratios[`codec/alloc+copy n=${n}`] = bothGbs / allocCopyGbs;
      ratios[`codec reused/copy n=${n}`] = reusedBothGbs / copyGbs;
      notes.push(
        `n=${n}: decoded x is ${xView ? "a view over the payload" : "a copy (its bin is not 4-byte aligned in this payload; FrameReader aligns received frames)"}`,
      );
    }
    notes.push(
      "GB/s counts the frame's payload bytes; the figure is (encode+decode) GB/s over Buffer.copy GB/s into a warm buffer; codec/alloc+copy compares with a copy into fresh memory; reused: a FrameEncoder (memory reused, bytes lent until the send is done with them, as the relay client lends them until the socket has written the frame; goal >= 0.5 at 64 tokens).",
    );
    return { rows, ratios, notes };
  },
};

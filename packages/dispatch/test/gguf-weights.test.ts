import { encodeF16 } from "@moeswarm/core";
import {
  bufferSource,
  GgmlType,
  type GgufMetadataValue,
  GgufValueType,
  ggufByteStream,
  ggufValue,
  readGguf,
  SLICE_KEYS,
} from "@moeswarm/shard";
import { describe, expect, it } from "vitest";
import { createReferenceWorker, loadExpertWeightsFromGguf, referenceMoe } from "../src/index.js";
import { randomHidden, randomRouting, tinyModel } from "./helpers.js";

const N_EMBD = 4;
const N_FF = 3;
const N_EXPERT = 3;

async function bytesOf(stream: AsyncIterable<Uint8Array>): Promise<Uint8Array> {
  const parts: Uint8Array[] = [];
  for await (const p of stream) parts.push(p);
  return Buffer.concat(parts);
}

/** A GGUF holding `model`'s experts of layer 1: gate in F16, up/down in F32, a down scale per expert. */
async function gguf(
  model: ReturnType<typeof tinyModel>,
  experts: number[],
  slice = false,
): Promise<Uint8Array> {
  const stack = (pick: (e: number) => Float64Array) =>
    Float32Array.from(experts.flatMap((e) => [...pick(e)]));
  const m = (e: number) => model.expert(1, e);
  const f32 = (a: Float32Array) => new Uint8Array(a.buffer);
  const metadata: Record<string, GgufMetadataValue> = {
    "general.architecture": ggufValue.str("qwen3moe"),
    "qwen3moe.expert_count": ggufValue.u32(N_EXPERT),
    "qwen3moe.expert_used_count": ggufValue.u32(2),
  };
  if (slice) metadata[SLICE_KEYS.experts] = ggufValue.array(GgufValueType.UINT32, Uint32Array.from(experts));
  return bytesOf(
    ggufByteStream({
      metadata,
      tensors: [
        {
          name: "blk.1.ffn_gate_exps.weight",
          type: GgmlType.F16,
          shape: [N_EMBD, N_FF, experts.length],
          data: new Uint8Array(encodeF16(stack((e) => m(e).gate!)).buffer),
        },
        {
          name: "blk.1.ffn_up_exps.weight",
          type: GgmlType.F32,
          shape: [N_EMBD, N_FF, experts.length],
          data: f32(stack((e) => m(e).up!)),
        },
        {
          name: "blk.1.ffn_down_exps.weight",
          type: GgmlType.F32,
          shape: [N_FF, N_EMBD, experts.length],
          data: f32(stack((e) => m(e).down)),
        },
        {
          name: "blk.1.ffn_down_exps.scale",
          type: GgmlType.F32,
          shape: [experts.length],
          data: f32(Float32Array.from(experts, (e) => e + 0.5)),
        },
      ],
    }),
  );
}

describe("loadExpertWeightsFromGguf", () => {
  // f16-exact gate values: multiples of 1/64 in [-0.5, 0.5)
  const model = tinyModel(31, { nExpert: N_EXPERT, nEmbd: N_EMBD, nFf: N_FF, layers: 2 });
  for (let e = 0; e < N_EXPERT; e++) {
    const g = model.expert(1, e).gate!;
    for (let i = 0; i < g.length; i++) g[i] = Math.round(g[i]! * 64) / 64;
  }

  it("dequantises each expert's slabs into the oracle's layout", async () => {
    const bytes = await gguf(model, [0, 1, 2]);
    const header = await readGguf(bytes);
    const w = await loadExpertWeightsFromGguf(bufferSource(bytes), header, { experts: [2, 0] });
    expect(w).toMatchObject({ nEmbd: N_EMBD, layers: [1], experts: [2, 0] });
    for (const e of [0, 2]) {
      const got = w.expert(1, e);
      const want = model.expert(1, e);
      expect([...got.gate!]).toEqual([...want.gate!]);
      expect([...got.up!]).toEqual([...want.up!]);
      expect([...got.down]).toEqual([...want.down]);
      expect(got.downScale).toBe(e + 0.5);
    }
    expect(() => w.expert(1, 1)).toThrow(/not loaded/);
    // the oracle runs on it: scaled down projection, same as the arrays with the scale
    const hidden = randomHidden(1, 2, N_EMBD);
    const routing = { ...randomRouting(2, 2, 1, 1), ids: Int32Array.from([2, 0]) };
    const scaled = {
      nEmbd: N_EMBD,
      expert: (l: number, e: number) => ({ ...model.expert(l, e), downScale: e + 0.5 }),
    };
    expect([...referenceMoe(hidden, routing, w, { layer: 1 })]).toEqual([
      ...referenceMoe(hidden, routing, scaled, { layer: 1 }),
    ]);
    const worker = createReferenceWorker(w);
    expect(worker).toBeTypeOf("function");
  });

  it("maps a slice's slabs to the global expert ids it lists", async () => {
    const bytes = await gguf(model, [1, 2], true);
    const header = await readGguf(bytes);
    const w = await loadExpertWeightsFromGguf(bufferSource(bytes), header);
    expect(w.experts).toEqual([1, 2]);
    expect([...w.expert(1, 2).down]).toEqual([...model.expert(1, 2).down]);
    await expect(loadExpertWeightsFromGguf(bufferSource(bytes), header, { experts: [0] })).rejects.toThrow(
      /not in this GGUF/,
    );
  });
});

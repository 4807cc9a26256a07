// Plain llama.cpp against llama.cpp + plugin + swarm with the activations on the wire as q8_0 /
// q8_K (the bridge's `wire`: loadActivationQuantizer of the backbone's GGUF): the same greedy
// tokens and the same logits, byte for byte, and the requests really carried q8 rows (the bridge's
// wire metrics: requests quantized, their bytes against f32's). Q8_0 experts (q8_0 rows), Q4_K
// experts (q8_K rows; llama.cpp repacks Q4_K on AVX2, so the workers check each row's round trip
// and refuse the requests whose rows would not survive it, which go again in f32), MXFP4 (q8_0,
// repacked) and llama4 (weighted input: f32 only).

import { loadActivationQuantizer } from "@moeswarm/worker-native";
import { afterAll, describe, expect, it } from "vitest";
import { equivalenceRun, type ModelCase } from "./equivalence-run.js";
import { nativeMissing, tempDir } from "./helpers.js";

const missing = nativeMissing();
const MODEL_ID = "wire";

interface Case extends Omit<ModelCase, "workers"> {
  /** The dtype the requests must travel in, or null (f32 only). */
  wire: "q8_0" | "q8_K" | null;
}

const CASES: Case[] = [
  { preset: "small", arch: "qwen3moe", nPredict: 32, expertTensors: 3, wire: "q8_0" },
  { preset: "tiny", arch: "minimax-m2", nPredict: 32, expertTensors: 3, wire: "q8_K" },
  { preset: "tiny", arch: "gpt-oss", nPredict: 32, expertTensors: 6, wire: "q8_0" },
  { preset: "tiny", arch: "llama4", nPredict: 16, expertTensors: 3, wire: null },
];

describe.skipIf(Boolean(missing))("q8 activations on the wire: plain llama.cpp vs the swarm", () => {
  const tmp = tempDir("mswb-wire-");
  afterAll(() => tmp.remove());

  for (const c of CASES) {
    describe(`${c.preset} ${c.arch}, 2 workers, every MoE layer remote`, () => {
      const tag = `wire-${c.arch}-${c.preset}`;
      const eq = equivalenceRun({
        case: { ...c, workers: 2 },
        tag,
        dir: tmp.dir,
        modelId: MODEL_ID,
        bridge: async (model) => ({ wire: await loadActivationQuantizer(model) }),
        setupTimeoutMs: 600_000,
      });

      it("identical tokens, bit-identical logits, and the requests carried q8 rows", async () => {
        await eq.expectSwarmEquivalent();
        const m = eq.bridge.metrics();
        const wire = m.wire!;
        console.log(`${tag}: ${JSON.stringify(wire)} of ${m.dispatch.requests} requests`);
        expect(wire.refusedDtype).toBe(0);
        if (c.wire === null) {
          expect(wire.quantized).toBe(0);
          return;
        }
        // most requests went as q8 (a repacked layer sends in f32 the ones whose rows do not round-trip)
        expect(wire.quantized).toBeGreaterThan(m.dispatch.requests / 2);
        expect(wire.bytesF32 / wire.bytesQuantized).toBeGreaterThan(3.5);
        // what went as q8 is the dtype the layer converts to
        for (const layer of eq.info.layers)
          expect((await loadActivationQuantizer(eq.model)).wireDtype(layer)).toBe(c.wire);
      }, 600_000);
    });
  }
});

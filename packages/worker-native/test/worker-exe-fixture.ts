// Shared by worker-answers.test.ts and worker-robustness.test.ts: the prebuilt moeswarm-expert-worker
// executable (or why its tests skip) and the Q4_K slice both files serve.
import { join } from "node:path";
import { GgmlType } from "@moeswarm/shard";
import { expertWorkerPath, probeNative } from "../src/index.js";
import { type Fixture, writeModel, writeSlice } from "./fixtures.js";

export let binary: string | undefined;
export let missing: string | undefined;
try {
  binary = expertWorkerPath({ target: "linux-x64" });
} catch (error) {
  missing = (error as Error).message;
}
if (process.platform !== "linux" || process.arch !== "x64")
  missing = `the prebuilt executable is linux-x64, this is ${process.platform}-${process.arch}`;
if (missing) {
  if (process.env.CI) throw new Error(`CI must build moeswarm-expert-worker: ${missing}`);
  console.warn(`skipping the executable tests: ${missing}`);
}
export const native = await probeNative();

export const N_EMBD = 256;
export const N_FF = 256;
export const K = 4;
export const sliceExperts = [5, 0, 2, 7];

/** Writes the synthetic model (layers 1 and 2, 8 experts) and the slice of `sliceExperts` into `dir`. */
export async function writeTestSlice(dir: string): Promise<{ model: Fixture; slicePath: string }> {
  const model = await writeModel(
    { type: GgmlType.Q4_K, nEmbd: N_EMBD, nFf: N_FF, nExpert: 8, layers: [1, 2], seed: 77 },
    dir,
  );
  const slicePath = join(dir, "slice.gguf");
  await writeSlice(model, sliceExperts, [1, 2], slicePath);
  return { model, slicePath };
}

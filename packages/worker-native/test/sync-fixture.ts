// What the tests of the synchronous path (sync-run: runSync against the thread pool; sync-run-into:
// runSync writing into the caller's memory) share: the addon, or the printed reason it is absent
// (CI must have built it), and small random models of a few ggml types (256 wide, 8 experts, MoE
// layers 0 and 2) written before a file's tests and removed after them.
import type { GgmlType } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll } from "vitest";
import { type NativeStatus, probeNative } from "../src/index.js";
import { type NativeAddon, requireNative } from "../src/native-binding.js";
import { type Fixture, writeModel } from "./fixtures.js";

export const N_EMBD = 256;
export const N_FF = 256;
export const N_EXPERT = 8;
export const K = 4;
export const EXPERTS = [...Array(N_EXPERT).keys()];

/** The addon, or undefined with the reason printed ("skipping <what>"); in CI its absence throws. */
export async function nativeOrSkip(
  what: string,
): Promise<{ status: NativeStatus; addon: NativeAddon | undefined }> {
  const status = await probeNative();
  if (!status.available) {
    if (process.env.CI) throw new Error(`CI must build the native addon:\n${status.message}`);
    console.warn(`skipping ${what}:\n${status.message}`);
  }
  return { status, addon: status.available ? await requireNative() : undefined };
}

/**
 * One model of each type in `types` (seeded `seed + type`), written in the calling describe's
 * `beforeAll` into a temp dir removed in its `afterAll`; the map fills when `beforeAll` runs.
 */
export function useSyncModels(
  prefix: string,
  types: readonly GgmlType[],
  seed: number,
): Map<GgmlType, Fixture> {
  const tmp = tempDir(prefix);
  const models = new Map<GgmlType, Fixture>();
  beforeAll(async () => {
    for (const type of types) {
      models.set(
        type,
        await writeModel(
          { type, nEmbd: N_EMBD, nFf: N_FF, nExpert: N_EXPERT, layers: [0, 2], seed: seed + type },
          tmp.dir,
        ),
      );
    }
  });
  afterAll(() => tmp.remove());
  return models;
}

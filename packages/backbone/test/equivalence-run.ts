// The equivalence tests' one set-up (equivalence, equivalence-families, equivalence-wire): a model,
// llama-cpu workers on its experts, a bridge to them, and plain llama.cpp's greedy run of it; then
// the same run with every MoE layer sent to the swarm, checked against the plain one.
import { join } from "node:path";
import {
  ensureSyntheticModel,
  ggmlTypeName,
  type SyntheticArch,
  type SyntheticPreset,
} from "@moeswarm/shard";
import { ggmlQuantize } from "@moeswarm/worker-native";
import { afterAll, beforeAll, expect } from "vitest";
import type {
  BackboneBridge,
  BackboneBridgeOptions,
  LogitsHarnessOptions,
  LogitsHarnessResult,
} from "../src/index.js";
import {
  decodeLogits,
  expectEquivalent,
  MODEL_CACHE,
  type ModelInfo,
  modelInfo,
  type Swarm,
  startSplitSwarm,
  swarmBridge,
  syntheticModel,
} from "./helpers.js";

/**
 * A synthetic model quantised by ggml's own quantiser (the same bytes as shard's, many times
 * faster): for K-quants (minimax-m2) and the shape-true preset's size.
 */
export async function ggmlQuantizedModel(preset: SyntheticPreset, arch: SyntheticArch): Promise<string> {
  const model = await ensureSyntheticModel(preset, {
    cacheDir: MODEL_CACHE,
    arch,
    quantize: (type, values, ne0) => ggmlQuantize(ggmlTypeName(type), values, ne0),
  });
  return model.path;
}

/** The prompt every equivalence case decodes. */
export const EQUIVALENCE_PROMPT = "The swarm computes every expert";

/** A synthetic model and a swarm on it, as the equivalence tests' case tables list them. */
export interface ModelCase {
  preset: SyntheticPreset;
  arch: SyntheticArch;
  /** Workers, the experts cut into this many contiguous ranges (`w0`, `w1`...). */
  workers: number;
  nPredict: number;
  /** Expert tensors llama.cpp hands the plugin per layer: gate/up/down (gpt-oss: and their biases). */
  expertTensors: number;
}

/**
 * The case's model from the cache: ggml-quantised for K-quants (minimax-m2) and the shape-true
 * preset, shard's own quantisers otherwise.
 */
export function caseModel(c: Pick<ModelCase, "preset" | "arch">): Promise<string> {
  return c.preset === "shape" || c.arch === "minimax-m2"
    ? ggmlQuantizedModel(c.preset, c.arch)
    : syntheticModel(c.preset, c.arch);
}

export interface EquivalenceOptions {
  case: ModelCase;
  /** Names the case's files in `dir`: `<tag>-plain.bin`, `<tag>-swarm.bin`, `<tag>.sock`. */
  tag: string;
  dir: string;
  /** The model id the workers are placed under and the plugin asks for. */
  modelId: string;
  /** The model's path (default {@link caseModel}). */
  model?(): Promise<string>;
  /** The bridge's options beyond the swarm (a wire quantiser...), for the model. */
  bridge?(model: string): Promise<Partial<BackboneBridgeOptions>>;
  /** The workers' start (a large slice loads for minutes). */
  spawn?: { startTimeoutMs?: number };
  /** Harness options for every decode of the case (a large model's timeout). */
  harness?: Partial<LogitsHarnessOptions>;
  /** The set-up's time limit (default: the package's hook timeout). */
  setupTimeoutMs?: number;
}

/** What {@link equivalenceRun} set up, once its beforeAll has run. */
export interface EquivalenceRun {
  readonly model: string;
  readonly info: ModelInfo;
  readonly swarm: Swarm;
  readonly bridge: BackboneBridge;
  /** Plain llama.cpp's run (no plugin) and its logits. */
  readonly plain: LogitsHarnessResult;
  readonly plainLogits: Buffer;
  /** A greedy run of the prompt, its logits in `<tag>-<name>.bin`, with `extra` harness options. */
  decode(name: string, extra?: Partial<LogitsHarnessOptions>): Promise<Decoded>;
  /**
   * The run with every MoE layer remote through the bridge, checked against the plain one
   * ({@link expectEquivalent}: the same tokens and logits, one split per layer and ubatch, every
   * expert tensor dropped, no fallback). Its run and logits.
   */
  expectSwarmEquivalent(): Promise<Decoded>;
}

type Decoded = { run: LogitsHarnessResult; logits: Buffer };

/**
 * Registers, in the calling describe block, the case's set-up (model, workers, bridge, and the
 * plain run, which must succeed without the plugin) and its teardown; returns what they set up.
 */
export function equivalenceRun(o: EquivalenceOptions): EquivalenceRun {
  const c = o.case;
  const spec = (model: string) => ({ model, prompt: EQUIVALENCE_PROMPT, nPredict: c.nPredict, dir: o.dir });
  const decodeWith = (model: string, name: string, extra?: Partial<LogitsHarnessOptions>) =>
    decodeLogits(spec(model), `${o.tag}-${name}`, { ...o.harness, ...extra });
  const eq = {
    decode: (name, extra) => decodeWith(eq.model, name, extra),
    async expectSwarmEquivalent() {
      const { bridge } = eq;
      const before = bridge.metrics().requests;
      const { run, logits } = await eq.decode("swarm", {
        plugin: { bridge: bridge.address, layers: "all", model: o.modelId },
      });
      expectEquivalent({
        run,
        logits,
        plainTokens: eq.plain.tokens,
        plainLogits: eq.plainLogits,
        nPredict: c.nPredict,
        layers: eq.info.layers,
        expertTensors: c.expertTensors,
        bridge,
        requestsBefore: before,
      });
      return { run, logits };
    },
  } as EquivalenceRun;
  let swarm: Swarm | undefined;
  let bridge: BackboneBridge | undefined;

  beforeAll(async () => {
    const t0 = performance.now();
    const model = await (o.model ?? (() => caseModel(c)))();
    console.log(`${o.tag}: model ready in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    const info = await modelInfo(model);
    swarm = await startSplitSwarm(model, info, c.workers, o.dir, o.modelId, "w", o.spawn ?? {});
    bridge = await swarmBridge(swarm, join(o.dir, `${o.tag}.sock`), (await o.bridge?.(model)) ?? {});
    const { run: plain, logits: plainLogits } = await decodeWith(model, "plain");
    expect(plain.ok, plain.stderr).toBe(true);
    expect(plain.plugin).toBeNull();
    Object.assign(eq, { model, info, swarm, bridge, plain, plainLogits });
  }, o.setupTimeoutMs);
  afterAll(async () => {
    await bridge?.close();
    await swarm?.close();
  });
  return eq;
}

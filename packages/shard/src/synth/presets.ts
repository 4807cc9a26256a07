import { createHash } from "node:crypto";
import { mkdir, stat } from "node:fs/promises";
import { homedir } from "node:os";
import { join } from "node:path";
import { GgufError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import {
  type ResolvedSyntheticOptions,
  resolveSyntheticOptions,
  SYNTH_GENERATOR_VERSION,
  SYNTHETIC_ARCHS,
  type SyntheticArch,
  type SyntheticMoeOptions,
} from "./spec.js";
import {
  planSyntheticModel,
  type SynthesizeProgress,
  type SynthQuantizer,
  synthesizeMoeModel,
} from "./synthesize.js";

export const SYNTHETIC_PRESETS = ["tiny", "small", "medium", "shape", "small-draft", "medium-draft"] as const;
export type SyntheticPreset = (typeof SYNTHETIC_PRESETS)[number];

type PresetTable = Partial<Record<SyntheticArch, SyntheticMoeOptions>>;

/** The key order the presets print in (`synth --header-only --json`), whatever order they are built in. */
const KEY_ORDER: readonly (keyof SyntheticMoeOptions)[] = [
  "arch",
  "seed",
  "nLayer",
  "nEmbd",
  "nHead",
  "nHeadKv",
  "headDim",
  "nFfExp",
  "nExpert",
  "nExpertUsed",
  "nFfShared",
  "vocab",
  "contextLength",
  "ropeFreqBase",
  "linear",
  "mla",
  "types",
  "mix",
  "weights",
];

/** Every tiny preset: 64 wide, 4 query and 2 KV heads, 8 experts of 128 with 2 used, 512 tokens. */
const TINY_BASE = {
  seed: 1,
  nLayer: 2,
  nEmbd: 64,
  nHead: 4,
  nHeadKv: 2,
  nFfExp: 128,
  nExpert: 8,
  nExpertUsed: 2,
  vocab: 512,
  types: { experts: "Q8_0", attention: "F16" },
} as const satisfies Omit<SyntheticMoeOptions, "arch">;

/** Experts in Q8_0, attention and the shared expert in F16. */
const Q8_SHARED_TYPES = { experts: "Q8_0", attention: "F16", sharedExpert: "F16" } as const;

function tiny(arch: SyntheticArch, overrides: Partial<SyntheticMoeOptions> = {}): SyntheticMoeOptions {
  const merged: Partial<SyntheticMoeOptions> = { ...TINY_BASE, arch, ...overrides };
  const ordered: Partial<Record<keyof SyntheticMoeOptions, unknown>> = {};
  for (const key of KEY_ORDER) if (merged[key] !== undefined) ordered[key] = merged[key];
  return ordered as SyntheticMoeOptions;
}

// tiny ~1 MB (unit tests), small ~50-60 MB, medium ~460 MB (benchmarks, qwen3moe only). Experts
// in Q8_0, the type most MoE GGUFs ship their experts in at these sizes. `shape`: a real model's
// per-layer dimensions and llama-quantize's Q4_K_M types with few layers and a small vocabulary,
// so one layer costs what a real layer costs (qwen35moe: Qwen3.5-122B-A10B's layers, ~5.9 GB).
const PRESETS: Record<Exclude<SyntheticPreset, `${string}-draft`>, PresetTable> = {
  tiny: {
    qwen3moe: tiny("qwen3moe", { headDim: 32 }),
    qwen2moe: tiny("qwen2moe", { nFfShared: 256, types: Q8_SHARED_TYPES }),
    mixtral: tiny("mixtral"),
    // One full-attention layer after three Gated DeltaNet layers, as in Qwen3.5.
    qwen35moe: tiny("qwen35moe", {
      nLayer: 4,
      headDim: 32,
      nFfShared: 128,
      linear: { keyHeads: 2, valueHeads: 4, headDim: 16 },
      types: Q8_SHARED_TYPES,
    }),
    // Experts in MXFP4, as gpt-oss ships them; heads of 16 so n_head * head_dim = n_embd.
    "gpt-oss": tiny("gpt-oss", { headDim: 16, types: { experts: "MXFP4", attention: "F16" } }),
    // Layer 0 dense, layers 1-2 MoE with one shared expert.
    glm4moe: tiny("glm4moe", { nLayer: 3, headDim: 32, nFfShared: 128, types: Q8_SHARED_TYPES }),
    // Latent attention; 8 experts in 4 groups of which the router keeps 2; one shared expert.
    deepseek2: tiny("deepseek2", {
      nLayer: 3,
      nHeadKv: 1,
      headDim: 48,
      nFfShared: 128,
      mla: {
        qLoraRank: 32,
        kvLoraRank: 32,
        ropeDim: 16,
        nopeDim: 32,
        vHeadDim: 32,
        groups: 4,
        groupsUsed: 2,
      },
      types: Q8_SHARED_TYPES,
    }),
    // Layers 1 and 3 MoE (top-1 of 8, input-weighted), 0 and 2 dense, as Llama 4 Maverick.
    // Seed 2: with seed 1 the greedy continuation of llama-load's first prompt ends at once (EOS).
    llama4: tiny("llama4", { seed: 2, nLayer: 4, nExpertUsed: 1, types: Q8_SHARED_TYPES }),
    // llama-quantize's Q4_K_M types, 256 wide so that the experts are real K-quants (Q4_K gate
    // and up, Q6_K down on use_more_bits layers) rather than a row-length fallback; 4 experts, not
    // 8, to stay under ~1.5 MB and out of llama-quantize's 8-expert (Mixtral) attention bump,
    // which MiniMax-M2's 256 experts do not get either.
    "minimax-m2": tiny("minimax-m2", { nEmbd: 256, headDim: 64, nFfExp: 256, nExpert: 4, mix: "Q4_K_M" }),
  },
  small: {
    qwen3moe: {
      arch: "qwen3moe",
      seed: 1,
      nLayer: 4,
      nEmbd: 256,
      nHead: 8,
      nHeadKv: 4,
      headDim: 64,
      nFfExp: 256,
      nExpert: 64,
      nExpertUsed: 8,
      vocab: 2048,
      types: { experts: "Q8_0", attention: "F16", embeddings: "F16", output: "F16" },
    },
    qwen2moe: {
      arch: "qwen2moe",
      seed: 1,
      nLayer: 4,
      nEmbd: 256,
      nHead: 8,
      nHeadKv: 4,
      nFfExp: 256,
      nExpert: 60,
      nExpertUsed: 4,
      nFfShared: 1024,
      vocab: 2048,
      types: { experts: "Q8_0", attention: "F16", sharedExpert: "F16", embeddings: "F16", output: "F16" },
    },
    mixtral: {
      arch: "mixtral",
      seed: 1,
      nLayer: 4,
      nEmbd: 256,
      nHead: 8,
      nHeadKv: 2,
      nFfExp: 2048,
      nExpert: 8,
      nExpertUsed: 2,
      vocab: 2048,
      types: { experts: "Q8_0", attention: "F16", embeddings: "F16", output: "F16" },
    },
    qwen35moe: {
      arch: "qwen35moe",
      seed: 1,
      nLayer: 4,
      nEmbd: 256,
      nHead: 8,
      nHeadKv: 2,
      headDim: 64,
      nFfExp: 256,
      nExpert: 64,
      nExpertUsed: 8,
      nFfShared: 256,
      vocab: 2048,
      linear: { keyHeads: 2, valueHeads: 4, headDim: 64 },
      types: { experts: "Q8_0", attention: "F16", sharedExpert: "F16", embeddings: "F16", output: "F16" },
    },
  },
  shape: {
    // Qwen/Qwen3.5-122B-A10B (config.json text_config): hidden 3072, 32 query and 2 KV heads of
    // 256, Gated DeltaNet with 16 key and 64 value heads of 128, 256 experts of 1024 with 8
    // used, a shared expert of 1024; 4 of its 48 layers and a 4096-token vocabulary.
    qwen35moe: {
      arch: "qwen35moe",
      seed: 1,
      nLayer: 4,
      nEmbd: 3072,
      nHead: 32,
      nHeadKv: 2,
      headDim: 256,
      nFfExp: 1024,
      nExpert: 256,
      nExpertUsed: 8,
      nFfShared: 1024,
      vocab: 4096,
      contextLength: 262_144,
      ropeFreqBase: 10_000_000,
      linear: { keyHeads: 16, valueHeads: 64, headDim: 128, convKernel: 4, fullAttentionInterval: 4 },
      mix: "Q4_K_M",
      // 9.7 G routed-expert values: random valid blocks, not a quantiser (minutes, not hours)
      weights: "direct",
    },
  },
  medium: {
    qwen3moe: {
      arch: "qwen3moe",
      seed: 1,
      nLayer: 8,
      nEmbd: 512,
      nHead: 8,
      nHeadKv: 4,
      headDim: 128,
      nFfExp: 512,
      nExpert: 64,
      nExpertUsed: 8,
      vocab: 4096,
      types: { experts: "Q8_0", attention: "F16", embeddings: "F16", output: "F16" },
    },
  },
};

/**
 * A draft model for speculative decoding (llama-server `-md`) of a qwen3moe preset: the same seed,
 * vocabulary and width, so the same tokenizer and the same language model in token_embd/output
 * (which dominates the logits), but one layer of 8 small experts: it runs locally in a fraction of
 * the target's time and agrees with the target where the target's layers do not move the bigram's
 * choice, so its acceptance rate is a realistic one rather than 0 or 1.
 */
function draftOf(target: SyntheticMoeOptions): SyntheticMoeOptions {
  return {
    ...target,
    nLayer: 1,
    nFfExp: 64,
    nExpert: 8,
    nExpertUsed: 2,
    types: { ...target.types },
  };
}
const ALL_PRESETS: Record<SyntheticPreset, PresetTable> = {
  ...PRESETS,
  "small-draft": { qwen3moe: draftOf(PRESETS.small.qwen3moe!) },
  "medium-draft": { qwen3moe: draftOf(PRESETS.medium.qwen3moe!) },
};

/** The options of a preset (a copy: change what you like and synthesise it yourself). */
export function syntheticPreset(
  preset: SyntheticPreset,
  arch: SyntheticArch = "qwen3moe",
): SyntheticMoeOptions {
  if (!SYNTHETIC_PRESETS.includes(preset)) {
    throw new InvalidArgumentError(
      `preset must be one of ${SYNTHETIC_PRESETS.join(", ")}, got ${String(preset)}`,
    );
  }
  if (!SYNTHETIC_ARCHS.includes(arch)) {
    throw new InvalidArgumentError(`arch must be one of ${SYNTHETIC_ARCHS.join(", ")}, got ${String(arch)}`);
  }
  const options = ALL_PRESETS[preset][arch];
  if (!options) {
    const archs = Object.keys(ALL_PRESETS[preset]).join(", ");
    throw new InvalidArgumentError(`preset ${preset} exists for ${archs}, not ${arch}`);
  }
  const copy: SyntheticMoeOptions = { ...options, types: { ...options.types } };
  if (options.linear) copy.linear = { ...options.linear };
  if (options.mla) copy.mla = { ...options.mla };
  return copy;
}

/** A stable identity for synthetic options: sha256 of the generator version and the resolved options. */
export function syntheticModelKey(options: SyntheticMoeOptions | ResolvedSyntheticOptions): string {
  const resolved = resolveSyntheticOptions(options);
  const canonical = (value: unknown): unknown =>
    typeof value === "object" && value !== null
      ? Object.fromEntries(
          Object.keys(value)
            .sort()
            .map((k) => [k, canonical((value as Record<string, unknown>)[k])]),
        )
      : value;
  return createHash("sha256")
    .update(JSON.stringify({ generator: SYNTH_GENERATOR_VERSION, options: canonical(resolved) }))
    .digest("hex");
}

export interface EnsureSyntheticModelOptions {
  /** Where models are kept (default `$MOESWARM_CACHE_DIR`, else ~/.cache/moeswarm/models). */
  cacheDir?: string;
  arch?: SyntheticArch;
  /** Overrides the preset's seed. */
  seed?: number;
  signal?: AbortSignal;
  onProgress?: (progress: SynthesizeProgress) => void;
  /** A faster encoder writing the same bytes (see SynthesizeOptions.quantize). */
  quantize?: SynthQuantizer;
}

export interface EnsuredSyntheticModel {
  readonly path: string;
  /** True when this call generated the file, false when it was already there. */
  readonly created: boolean;
  readonly size: number;
  readonly options: ResolvedSyntheticOptions;
}

const inFlight = new Map<string, Promise<EnsuredSyntheticModel>>();

export function defaultModelCacheDir(): string {
  return process.env.MOESWARM_CACHE_DIR ?? join(homedir(), ".cache", "moeswarm", "models");
}

/**
 * The path of a preset's model in `cacheDir`, generating it the first time. Files are named by
 * preset, architecture and a key of the options and generator version, so a changed generator
 * never reuses a stale file; generation writes beside the file and renames it when complete.
 */
export async function ensureSyntheticModel(
  preset: SyntheticPreset,
  options: EnsureSyntheticModelOptions = {},
): Promise<EnsuredSyntheticModel> {
  throwIfAborted(options.signal);
  const base = syntheticPreset(preset, options.arch ?? "qwen3moe");
  const synthOptions = options.seed === undefined ? base : { ...base, seed: options.seed };
  const { spec, plan } = planSyntheticModel(synthOptions);
  const key = syntheticModelKey(spec.options).slice(0, 16);
  const dir = options.cacheDir ?? defaultModelCacheDir();
  const path = join(dir, `${spec.options.arch}-${preset}-${key}.gguf`);
  const size = Number(plan.totalSize);
  const existing = await stat(path).catch(() => undefined);
  if (existing?.isFile() && existing.size === size) {
    return { path, created: false, size, options: spec.options };
  }
  const running = inFlight.get(path);
  if (running) return running;
  const job = (async () => {
    try {
      await mkdir(dir, { recursive: true });
    } catch (error) {
      throw new GgufError("MOESWARM_GGUF_IO", `cannot create ${dir}: ${(error as Error).message}`, {
        cause: error,
      });
    }
    await synthesizeMoeModel(synthOptions, path, {
      signal: options.signal,
      onProgress: options.onProgress,
      quantize: options.quantize,
    });
    return { path, created: true, size, options: spec.options };
  })();
  inFlight.set(path, job);
  try {
    return await job;
  } finally {
    inFlight.delete(path);
  }
}

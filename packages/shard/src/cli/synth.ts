import { SYNTHETIC_PRESETS, type SyntheticPreset, syntheticPreset } from "../synth/presets.js";
import { SYNTHETIC_ARCHS, type SyntheticArch } from "../synth/spec.js";
import { synthesizeMoeModel, writeSyntheticHeader } from "../synth/synthesize.js";
import { type Command, stringFlag, usageError, write } from "./command.js";
import { formatBytes, progressBar, toJson } from "./io.js";

// ---- synth ------------------------------------------------------------------------------------

export const synth: Command = {
  name: "synth",
  summary: "write a deterministic synthetic MoE model that llama.cpp loads",
  usage: `synth --preset ${SYNTHETIC_PRESETS.join("|")} [--arch ${SYNTHETIC_ARCHS.join("|")}] [--seed n] [--header-only] -o model.gguf [--json]`,
  options: {
    preset: { type: "string", description: `size preset: ${SYNTHETIC_PRESETS.join(", ")}` },
    arch: { type: "string", description: `architecture: ${SYNTHETIC_ARCHS.join(", ")} (default qwen3moe)` },
    seed: { type: "string", description: "uint32 seed (default the preset's)" },
    output: { type: "string", short: "o", description: "the model file to write" },
    "header-only": {
      type: "boolean",
      description: "write the header only, the data a sparse hole (for `plan`: no weights, no disk)",
    },
  },
  async run(ctx) {
    if (ctx.positionals.length > 0)
      throw usageError(`unexpected argument ${JSON.stringify(ctx.positionals[0])}`);
    const preset = stringFlag(ctx, "preset");
    if (!preset) throw usageError("--preset is required");
    const output = stringFlag(ctx, "output");
    if (!output) throw usageError("-o/--output is required");
    const arch = (stringFlag(ctx, "arch") ?? "qwen3moe") as SyntheticArch;
    const options = syntheticPreset(preset as SyntheticPreset, arch);
    const seedText = stringFlag(ctx, "seed");
    if (seedText !== undefined) {
      if (!/^\d{1,10}$/.test(seedText) || Number(seedText) > 0xffff_ffff)
        throw usageError(`--seed must be a uint32, got ${seedText}`);
      options.seed = Number(seedText);
    }
    const started = performance.now();
    if (ctx.flags["header-only"] === true) {
      const { plan } = await writeSyntheticHeader(options, output, { signal: ctx.signal });
      const seconds = (performance.now() - started) / 1000;
      const size = Number(plan.totalSize);
      if (ctx.json) write(ctx, toJson({ output, size, headerOnly: true, seconds, options }));
      else
        write(
          ctx,
          `wrote ${output}: ${arch} ${preset} header, ${formatBytes(size)} sparse, in ${seconds.toFixed(2)} s`,
        );
      return;
    }
    const bar = progressBar(ctx.io, "synth", !ctx.json);
    let result: Awaited<ReturnType<typeof synthesizeMoeModel>>;
    try {
      result = await synthesizeMoeModel(options, output, {
        signal: ctx.signal,
        onProgress: (p) => bar.update(p.bytesWritten, p.totalBytes),
      });
    } finally {
      bar.stop();
    }
    const seconds = (performance.now() - started) / 1000;
    if (ctx.json)
      write(
        ctx,
        toJson({ output, size: result.size, sha256: result.sha256, seconds, options: result.options }),
      );
    else
      write(
        ctx,
        `wrote ${output}: ${arch} ${preset}, ${formatBytes(result.size)}, sha256 ${result.sha256} in ${seconds.toFixed(2)} s`,
      );
  },
};

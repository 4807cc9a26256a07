import { readFile, unlink } from "node:fs/promises";
import { GgufError } from "@moeswarm/core";
import { readGguf } from "../gguf-reader.js";
import { loadOrBuildManifest, parseManifest, type SliceManifest } from "../manifest.js";
import { findExpertTensors } from "../moe-tensors.js";
import { sliceExperts } from "../slice.js";
import { verifySlice } from "../slice-verify.js";
import {
  type Command,
  compact,
  openInput,
  parseIndexList,
  positional,
  stringFlag,
  usageError,
  write,
} from "./command.js";
import { formatBytes, progressBar, toJson } from "./io.js";

// ---- slice ------------------------------------------------------------------------------------

async function readManifestFile(path: string): Promise<SliceManifest> {
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (error) {
    throw new GgufError("MOESWARM_GGUF_IO", `cannot read ${path}: ${(error as Error).message}`, {
      cause: error,
    });
  }
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (error) {
    throw new GgufError("MOESWARM_SLICE_MISMATCH", `${path} is not JSON: ${(error as Error).message}`, {
      cause: error,
    });
  }
  return parseManifest(value);
}

export const slice: Command = {
  name: "slice",
  summary: "cut chosen layers x experts out of a MoE model into a slice GGUF (byte copy)",
  usage: "slice <model> --layers a:b --experts c:d -o out.gguf [--manifest m.json] [--json]",
  options: {
    layers: { type: "string", description: "layers: a:b (half-open), a single index, or a comma list" },
    experts: { type: "string", description: "global expert ids, same syntax (default: all)" },
    output: { type: "string", short: "o", description: "the slice file to write" },
    manifest: {
      type: "string",
      description: "the model's manifest (its slab sha256s go into the slice; else hashed now)",
    },
  },
  async run(ctx) {
    const model = positional(ctx, "model");
    const layersText = stringFlag(ctx, "layers");
    if (!layersText) throw usageError("--layers is required");
    const output = stringFlag(ctx, "output");
    if (!output) throw usageError("-o/--output is required");
    const layers = parseIndexList(layersText, "layer");
    const manifestPath = stringFlag(ctx, "manifest");
    const manifest = manifestPath ? await readManifestFile(manifestPath) : undefined;
    const source = await openInput(model, ctx.signal);
    try {
      let experts: number[];
      const expertsText = stringFlag(ctx, "experts");
      if (expertsText) experts = parseIndexList(expertsText, "expert");
      else {
        const header = await readGguf(source, { signal: ctx.signal });
        const layout = findExpertTensors(header);
        const n = layout.expertCount ?? layout.layers[0]?.nExpert ?? 0;
        experts = Array.from({ length: n }, (_, i) => i);
      }
      const started = performance.now();
      const sliced = await sliceExperts(source, { layers, experts, manifest, signal: ctx.signal });
      const bar = progressBar(ctx.io, "slice", !ctx.json);
      try {
        await sliced.write(output, {
          signal: ctx.signal,
          onProgress: (p) => bar.update(p.bytesWritten, p.totalBytes),
        });
      } finally {
        bar.stop();
        await sliced.close();
      }
      const seconds = (performance.now() - started) / 1000;
      const summary = {
        output,
        bytes: sliced.length,
        layers: sliced.layers,
        experts: sliced.experts,
        tensors: sliced.header.tensors.length,
        seconds,
      };
      if (ctx.json) write(ctx, toJson(summary));
      else {
        write(
          ctx,
          `wrote ${output}: ${formatBytes(sliced.length)}, layers ${compact(sliced.layers)}, experts ${compact(sliced.experts)}, ${sliced.header.tensors.length} tensors in ${seconds.toFixed(2)} s`,
        );
      }
    } finally {
      await source.close();
    }
  },
};

// ---- manifest ---------------------------------------------------------------------------------

export const manifestCommand: Command = {
  name: "manifest",
  summary: "build (or load the cached) manifest of a model: per-expert slab sha256 and byte ranges",
  usage: "manifest <model> [-o model.manifest.json] [--rebuild] [--json]",
  options: {
    output: {
      type: "string",
      short: "o",
      description: "where to keep the manifest (default <model>.manifest.json)",
    },
    rebuild: { type: "boolean", description: "ignore a cached manifest" },
  },
  async run(ctx) {
    const model = positional(ctx, "model");
    if (/^https?:\/\//i.test(model)) throw usageError("manifest needs a local model file");
    const manifestPath = stringFlag(ctx, "output") ?? `${model}.manifest.json`;
    if (ctx.flags.rebuild === true) {
      await unlink(manifestPath).catch(() => undefined);
    }
    const bar = progressBar(ctx.io, "manifest", !ctx.json);
    const started = performance.now();
    let loaded: Awaited<ReturnType<typeof loadOrBuildManifest>>;
    try {
      loaded = await loadOrBuildManifest(model, {
        manifestPath,
        signal: ctx.signal,
        onProgress: (p) => bar.update(p.bytesDone, p.bytesTotal),
      });
    } finally {
      bar.stop();
    }
    const { manifest, cached } = loaded;
    const slabs = manifest.layers.reduce((n, l) => n + l.nExpert * l.tensors.length, 0);
    const bytes = manifest.layers.reduce((n, l) => n + l.nExpert * l.bytesPerExpert, 0);
    const summary = {
      manifestPath: loaded.manifestPath,
      cached,
      source: manifest.source,
      layers: manifest.layers.length,
      experts: manifest.expertCount,
      slabs,
      expertBytes: bytes,
      seconds: (performance.now() - started) / 1000,
    };
    if (ctx.json) write(ctx, toJson(summary));
    else {
      write(
        ctx,
        `${cached ? "cached" : "built"} ${loaded.manifestPath}: ${manifest.layers.length} layers, ${slabs} slabs, ${formatBytes(bytes)} of experts hashed${cached ? "" : ` in ${summary.seconds.toFixed(2)} s`}`,
      );
    }
  },
};

// ---- verify -----------------------------------------------------------------------------------

export const verify: Command = {
  name: "verify",
  summary: "check every slab of a slice against its embedded sha256s and the model's manifest",
  usage: "verify <slice> [--manifest m.json] [--json]",
  options: {
    manifest: {
      type: "string",
      description: "the model's manifest (without it, only the slice's own sha256s are checked)",
    },
  },
  async run(ctx) {
    const path = positional(ctx, "slice");
    const manifestPath = stringFlag(ctx, "manifest");
    const manifest = manifestPath ? await readManifestFile(manifestPath) : undefined;
    const source = await openInput(path, ctx.signal);
    try {
      const result = await verifySlice(source, manifest, { signal: ctx.signal });
      if (ctx.json) write(ctx, toJson({ ok: true, manifest: manifestPath ?? null, ...result }));
      else {
        write(
          ctx,
          `ok: ${result.slabs} slabs (${formatBytes(result.bytes)}) of layers ${compact(result.layers)}, experts ${compact(result.experts)} match ${manifest ? "the manifest" : "the slice's sha256s"}`,
        );
      }
    } finally {
      await source.close();
    }
  },
};

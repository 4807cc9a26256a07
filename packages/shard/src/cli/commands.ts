import { readFile, unlink } from "node:fs/promises";
import { GgufError, InvalidArgumentError, parseRange, type Range } from "@moeswarm/core";
import { type ByteSource, fileSource, httpSource } from "../byte-source.js";
import { ggmlTypeName } from "../ggml-type.js";
import { GgufValueType, ggufValueTypeName } from "../gguf-constants.js";
import type { GgufMetadataValue } from "../gguf-metadata.js";
import { type GgufHeader, readGguf } from "../gguf-reader.js";
import { loadOrBuildManifest, parseManifest, type SliceManifest } from "../manifest.js";
import { findExpertTensors, SLICE_KEYS } from "../moe-tensors.js";
import { sliceContents, sliceExperts } from "../slice.js";
import { verifySlice } from "../slice-verify.js";
import { SYNTHETIC_PRESETS, type SyntheticPreset, syntheticPreset } from "../synth/presets.js";
import { SYNTHETIC_ARCHS, type SyntheticArch } from "../synth/spec.js";
import { synthesizeMoeModel } from "../synth/synthesize.js";
import { type CliIo, formatBytes, progressBar, toJson } from "./io.js";
import { planCommand } from "./plan.js";

/** Parsed flags of one command (from node:util parseArgs). */
export type Flags = Record<string, string | boolean | undefined>;

export interface CommandContext {
  readonly io: CliIo;
  readonly positionals: readonly string[];
  readonly flags: Flags;
  readonly json: boolean;
  readonly signal: AbortSignal;
}

export interface CommandOption {
  readonly type: "string" | "boolean";
  readonly short?: string;
  readonly description: string;
}

/** One subcommand: `moeswarm-shard <name> ...`. Add an entry to COMMANDS to add a subcommand. */
export interface Command {
  readonly name: string;
  readonly summary: string;
  readonly usage: string;
  readonly options: Readonly<Record<string, CommandOption>>;
  run(ctx: CommandContext): Promise<void>;
}

/** A mistake in the command line (exit status 2), as opposed to a failure of the work (1). */
export function usageError(message: string): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT", message, { details: { usage: true } });
}

export function isUsageError(error: unknown): boolean {
  return (
    error instanceof InvalidArgumentError &&
    (error.code === "MOESWARM_INVALID_RANGE" ||
      (error.details as { usage?: unknown } | undefined)?.usage === true)
  );
}

function positional(ctx: CommandContext, what: string): string {
  const [value, ...rest] = ctx.positionals;
  if (value === undefined) throw usageError(`missing <${what}>`);
  if (rest.length > 0) throw usageError(`unexpected argument ${JSON.stringify(rest[0])}`);
  return value;
}

function stringFlag(ctx: CommandContext, name: string): string | undefined {
  const v = ctx.flags[name];
  return typeof v === "string" ? v : undefined;
}

function write(ctx: CommandContext, text: string): void {
  ctx.io.stdout.write(text.endsWith("\n") ? text : `${text}\n`);
}

/** `0:8`, `3`, or a comma list of them (`0:4,10:12`): the sorted distinct indices. */
export function parseIndexList(text: string, what: string): number[] {
  const out = new Set<number>();
  for (const part of text.split(",")) {
    const r: Range = parseRange(part);
    if (r.end - r.start > 1 << 20) throw usageError(`${what} range ${part} is too large`);
    for (let i = r.start; i < r.end; i++) out.add(i);
  }
  return [...out].sort((a, b) => a - b);
}

async function openInput(input: string, signal: AbortSignal): Promise<ByteSource> {
  if (/^https?:\/\//i.test(input)) return httpSource(input, { signal });
  return fileSource(input, { signal });
}

// ---- inspect -----------------------------------------------------------------------------------

const ARRAY_PREVIEW = 8;

function describeValue(value: GgufMetadataValue, full: boolean): unknown {
  if (value.type !== GgufValueType.ARRAY)
    return typeof value.value === "bigint" ? value.value.toString() : value.value;
  const items = value.value as ArrayLike<unknown>;
  const list = (xs: ArrayLike<unknown>) =>
    Array.from(xs, (x) =>
      typeof x === "bigint"
        ? x.toString()
        : typeof x === "object" && x !== null
          ? describeValue(x as GgufMetadataValue, full)
          : x,
    );
  if (full || items.length <= ARRAY_PREVIEW * 4) return list(items);
  return {
    type: `arr[${ggufValueTypeName(value.itemType)}]`,
    length: items.length,
    head: list(Array.prototype.slice.call(items, 0, ARRAY_PREVIEW) as unknown[]),
  };
}

function textValue(value: GgufMetadataValue): string {
  if (value.type !== GgufValueType.ARRAY) {
    return value.type === GgufValueType.STRING ? JSON.stringify(value.value) : String(value.value);
  }
  const items = value.value as ArrayLike<unknown>;
  const head = Array.prototype.slice
    .call(items, 0, ARRAY_PREVIEW)
    .map((x: unknown) =>
      typeof x === "string" ? JSON.stringify(x) : typeof x === "object" ? "[...]" : String(x),
    );
  const more = items.length > ARRAY_PREVIEW ? `, ... (${items.length} items)` : "";
  return `[${ggufValueTypeName(value.itemType)}] ${head.join(", ")}${more}`;
}

function moeSummary(header: GgufHeader) {
  const layout = findExpertTensors(header);
  const expertBytes = layout.layers.reduce((s, l) => s + l.bytesPerExpert * BigInt(l.nExpert), 0n);
  return {
    arch: layout.arch ?? null,
    blockCount: layout.blockCount ?? null,
    expertCount: layout.expertCount ?? null,
    expertUsedCount: layout.expertUsedCount ?? null,
    expertBytes: Number(expertBytes),
    layers: layout.layers.map((l) => ({
      layer: l.layer,
      nExpert: l.nExpert,
      bytesPerExpert: Number(l.bytesPerExpert),
      tensors: l.tensors.map((t) => ({
        name: t.name,
        type: ggmlTypeName(t.info.type),
        shape: t.info.shape,
        slabBytes: Number(t.slabBytes),
      })),
    })),
  };
}

const inspect: Command = {
  name: "inspect",
  summary: "metadata, tensors and MoE layout of a GGUF file or URL",
  usage: "inspect <file|url> [--tensors] [--full] [--json]",
  options: {
    tensors: { type: "boolean", description: "list every tensor (text mode lists a summary by type)" },
    full: { type: "boolean", description: "print metadata arrays in full (default: the first items)" },
  },
  async run(ctx) {
    const input = positional(ctx, "file|url");
    const source = await openInput(input, ctx.signal);
    let header: GgufHeader;
    try {
      header = await readGguf(source, { signal: ctx.signal });
    } finally {
      await source.close();
    }
    const full = ctx.flags.full === true;
    const moe = moeSummary(header);
    const slice = header.metadata.has(SLICE_KEYS.experts) ? sliceContents(header) : undefined;
    const byType = new Map<string, { count: number; bytes: bigint }>();
    for (const t of header.tensors) {
      const k = ggmlTypeName(t.type);
      const e = byType.get(k) ?? { count: 0, bytes: 0n };
      e.count++;
      e.bytes += t.nbytes;
      byType.set(k, e);
    }
    if (ctx.json) {
      write(
        ctx,
        toJson({
          source: source.description,
          version: header.version,
          fileSize: header.fileSize,
          headerSize: header.headerSize,
          alignment: header.alignment,
          dataOffset: header.dataOffset,
          metadata: Object.fromEntries([...header.metadata].map(([k, v]) => [k, describeValue(v, full)])),
          tensorCount: header.tensors.length,
          tensors: header.tensors.map((t) => ({
            name: t.name,
            type: ggmlTypeName(t.type),
            shape: t.shape,
            offset: t.absoluteOffset,
            nbytes: t.nbytes,
          })),
          moe,
          slice: slice ?? null,
        }),
      );
      return;
    }
    const lines: string[] = [];
    lines.push(
      `${source.description}: GGUF v${header.version}, ${formatBytes(header.fileSize ?? 0n)}, header ${formatBytes(header.headerSize)}, alignment ${header.alignment}`,
    );
    lines.push("", `metadata (${header.metadata.size} keys):`);
    for (const [k, v] of header.metadata) lines.push(`  ${k} = ${textValue(v)}`);
    lines.push("", `tensors: ${header.tensors.length}`);
    for (const [k, v] of [...byType].sort((a, b) => (b[1].bytes > a[1].bytes ? 1 : -1))) {
      lines.push(`  ${k.padEnd(8)} ${String(v.count).padStart(6)} tensors  ${formatBytes(v.bytes)}`);
    }
    if (ctx.flags.tensors === true) {
      for (const t of header.tensors) {
        lines.push(
          `  ${t.name}  ${ggmlTypeName(t.type)}  [${t.shape.join(", ")}]  @${t.absoluteOffset}  ${formatBytes(t.nbytes)}`,
        );
      }
    }
    lines.push("");
    if (moe.layers.length === 0) {
      lines.push("MoE: no routed-expert tensors");
    } else {
      const counts = [...new Set(moe.layers.map((l) => l.nExpert))].join("/");
      lines.push(
        `MoE: ${moe.arch ?? "?"}, ${moe.layers.length} of ${moe.blockCount ?? "?"} layers with experts, ${counts} experts per layer` +
          `${moe.expertUsedCount ? `, ${moe.expertUsedCount} used per token` : ""}, experts ${formatBytes(moe.expertBytes)}` +
          `${header.fileSize ? ` (${((100 * moe.expertBytes) / Number(header.fileSize)).toFixed(1)}% of the file)` : ""}`,
      );
      for (const l of moe.layers) {
        lines.push(
          `  layer ${String(l.layer).padStart(3)}: ${l.nExpert} experts x ${formatBytes(l.bytesPerExpert)} (${l.tensors
            .map((t) => `${t.name.split(".").slice(2).join(".")} ${t.type}`)
            .join(", ")})`,
        );
      }
    }
    if (slice) {
      lines.push(
        `slice of ${slice.source} (${slice.sourceSha256.slice(0, 12)}...): layers ${slice.layers.join(",")}, experts ${compact(slice.experts)}`,
      );
    }
    write(ctx, lines.join("\n"));
  },
};

function compact(values: readonly number[]): string {
  const parts: string[] = [];
  let i = 0;
  while (i < values.length) {
    let j = i;
    while (j + 1 < values.length && values[j + 1] === values[j]! + 1) j++;
    parts.push(j > i ? `${values[i]}:${values[j]! + 1}` : String(values[i]));
    i = j + 1;
  }
  return parts.join(",");
}

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

const slice: Command = {
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

const manifestCommand: Command = {
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

const verify: Command = {
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

// ---- synth ------------------------------------------------------------------------------------

const synth: Command = {
  name: "synth",
  summary: "write a deterministic synthetic MoE model that llama.cpp loads",
  usage: `synth --preset ${SYNTHETIC_PRESETS.join("|")} [--arch ${SYNTHETIC_ARCHS.join("|")}] [--seed n] -o model.gguf [--json]`,
  options: {
    preset: { type: "string", description: `size preset: ${SYNTHETIC_PRESETS.join(", ")}` },
    arch: { type: "string", description: `architecture: ${SYNTHETIC_ARCHS.join(", ")} (default qwen3moe)` },
    seed: { type: "string", description: "uint32 seed (default the preset's)" },
    output: { type: "string", short: "o", description: "the model file to write" },
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
    const bar = progressBar(ctx.io, "synth", !ctx.json);
    const started = performance.now();
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

/** Every subcommand, in help order. */
export const COMMANDS: readonly Command[] = [inspect, slice, manifestCommand, verify, synth, planCommand];

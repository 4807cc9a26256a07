import { ggmlTypeName } from "../ggml-type.js";
import { GgufValueType, ggufValueTypeName } from "../gguf-constants.js";
import type { GgufMetadataValue } from "../gguf-metadata.js";
import { type GgufHeader, readGguf } from "../gguf-reader.js";
import { findExpertTensors, SLICE_KEYS } from "../moe-tensors.js";
import { sliceContents } from "../slice.js";
import {
  type Command,
  compact,
  FILE_SIZE_OPTION,
  fileSizeFlag,
  openInput,
  positional,
  write,
} from "./command.js";
import { formatBytes, toJson } from "./io.js";

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

type MoeSummary = ReturnType<typeof moeSummary>;
type SliceSummary = ReturnType<typeof sliceContents>;

function inspectJson(
  description: string,
  header: GgufHeader,
  full: boolean,
  moe: MoeSummary,
  slice: SliceSummary | undefined,
): string {
  return toJson({
    source: description,
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
  });
}

function tensorsByType(header: GgufHeader): Map<string, { count: number; bytes: bigint }> {
  const byType = new Map<string, { count: number; bytes: bigint }>();
  for (const t of header.tensors) {
    const k = ggmlTypeName(t.type);
    const e = byType.get(k) ?? { count: 0, bytes: 0n };
    e.count++;
    e.bytes += t.nbytes;
    byType.set(k, e);
  }
  return byType;
}

function moeLines(header: GgufHeader, moe: MoeSummary): string[] {
  if (moe.layers.length === 0) return ["MoE: no routed-expert tensors"];
  const lines: string[] = [];
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
  return lines;
}

function inspectText(
  description: string,
  header: GgufHeader,
  listTensors: boolean,
  moe: MoeSummary,
  slice: SliceSummary | undefined,
): string {
  const lines: string[] = [];
  lines.push(
    `${description}: GGUF v${header.version}, ${formatBytes(header.fileSize ?? 0n)}, header ${formatBytes(header.headerSize)}, alignment ${header.alignment}`,
  );
  lines.push("", `metadata (${header.metadata.size} keys):`);
  for (const [k, v] of header.metadata) lines.push(`  ${k} = ${textValue(v)}`);
  lines.push("", `tensors: ${header.tensors.length}`);
  for (const [k, v] of [...tensorsByType(header)].sort((a, b) => (b[1].bytes > a[1].bytes ? 1 : -1))) {
    lines.push(`  ${k.padEnd(8)} ${String(v.count).padStart(6)} tensors  ${formatBytes(v.bytes)}`);
  }
  if (listTensors) {
    for (const t of header.tensors) {
      lines.push(
        `  ${t.name}  ${ggmlTypeName(t.type)}  [${t.shape.join(", ")}]  @${t.absoluteOffset}  ${formatBytes(t.nbytes)}`,
      );
    }
  }
  lines.push("", ...moeLines(header, moe));
  if (slice) {
    lines.push(
      `slice of ${slice.source} (${slice.sourceSha256.slice(0, 12)}...): layers ${slice.layers.join(",")}, experts ${compact(slice.experts)}`,
    );
  }
  return lines.join("\n");
}

export const inspect: Command = {
  name: "inspect",
  summary: "metadata, tensors and MoE layout of a GGUF file or URL",
  usage: "inspect <file|url> [--tensors] [--full] [--file-size <bytes>] [--json]",
  options: {
    tensors: { type: "boolean", description: "list every tensor (text mode lists a summary by type)" },
    full: { type: "boolean", description: "print metadata arrays in full (default: the first items)" },
    "file-size": FILE_SIZE_OPTION,
  },
  async run(ctx) {
    const input = positional(ctx, "file|url");
    const fileSize = fileSizeFlag(ctx);
    const source = await openInput(input, ctx.signal);
    let header: GgufHeader;
    try {
      header = await readGguf(source, {
        signal: ctx.signal,
        ...(fileSize === undefined ? {} : { fileSize }),
      });
    } finally {
      await source.close();
    }
    const moe = moeSummary(header);
    const slice = header.metadata.has(SLICE_KEYS.experts) ? sliceContents(header) : undefined;
    if (ctx.json) write(ctx, inspectJson(source.description, header, ctx.flags.full === true, moe, slice));
    else write(ctx, inspectText(source.description, header, ctx.flags.tensors === true, moe, slice));
  },
};

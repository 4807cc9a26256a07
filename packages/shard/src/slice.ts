import { checkRange, GgufError, InvalidArgumentError, type Range, throwIfAborted } from "@moeswarm/core";
import { writeAll, writeFileAtomically } from "./atomic-file.js";
import { type ByteSource, type ByteSourceInput, openByteSource } from "./byte-source.js";
import { GgufValueType } from "./gguf-constants.js";
import { type GgufMetadataValue, ggufValue } from "./gguf-metadata.js";
import { type GgufHeader, type GgufTensorInfo, readGguf } from "./gguf-reader.js";
import { type GgufPlan, ggufByteStream, planGguf } from "./gguf-writer.js";
import { modelName, type SliceManifest, sourceHeaderSha256 } from "./manifest.js";
import {
  type ExpertLayer,
  type ExpertTensor,
  findExpertTensors,
  type MoeLayout,
  SLICE_KEYS,
} from "./moe-tensors.js";
import {
  type ByteRange,
  checkChunkSize,
  concatRangesSource,
  readRanges,
  runsOf,
  SlabHasher,
} from "./slice-io.js";

/** Layers or experts: a half-open range, a list, or one index. */
export type IndexSelection = Range | readonly number[] | number;

export interface SliceExpertsOptions {
  layers: IndexSelection;
  /** Global expert ids; the slice holds them in ascending order. */
  experts: IndexSelection;
  signal?: AbortSignal;
  /**
   * The source's manifest: its slab sha256s go into the slice header, so nothing is read before
   * streaming. Without it, the selected slabs are read and hashed once up front.
   */
  manifest?: SliceManifest;
  /** `moeswarm.slice.source` (default: the manifest's name, `general.name`, or the file name). */
  sourceId?: string;
  /** Largest chunk a stream yields (default 8 MiB). */
  chunkSize?: number;
}

export interface SliceStreamOptions {
  signal?: AbortSignal;
}

export interface SliceWriteOptions extends SliceStreamOptions {
  onProgress?: (progress: { bytesWritten: number; totalBytes: number }) => void;
}

/** A slice ready to stream: its exact length and header are known before any weight is read. */
export interface ExpertSlice extends AsyncDisposable {
  /** Bytes of the whole slice file. */
  readonly length: number;
  /** The slice's own GGUF header, as `readGguf` will read it back. */
  readonly header: GgufHeader;
  readonly plan: GgufPlan;
  readonly layers: readonly number[];
  /** Global expert ids, ascending: slab i of each tensor is expert experts[i]. */
  readonly experts: readonly number[];
  /** The whole slice, in chunks; each call streams afresh from the source. */
  stream(options?: SliceStreamOptions): AsyncIterable<Uint8Array>;
  /** Bytes `[start, end)` of the slice (HTTP Range answers), without producing what comes before. */
  range(start: number, end: number, options?: SliceStreamOptions): AsyncIterable<Uint8Array>;
  /** Writes the slice to `path` (beside it first, renamed when complete). */
  write(path: string, options?: SliceWriteOptions): Promise<void>;
  /** Closes the source when this call opened it (a path or URL); a ByteSource stays open. */
  close(): Promise<void>;
}

function invalidRange(message: string, details?: Record<string, unknown>): InvalidArgumentError {
  return new InvalidArgumentError("MOESWARM_INVALID_RANGE", message, details ? { details } : {});
}

/** Sorted distinct indices of a selection, each below `limit`. */
export function selectIndices(selection: IndexSelection, what: string, limit: number): number[] {
  let values: number[];
  if (typeof selection === "number") values = [selection];
  else if (Array.isArray(selection)) values = [...(selection as readonly number[])];
  else if (
    typeof selection === "object" &&
    selection !== null &&
    "start" in selection &&
    "end" in selection
  ) {
    const r = checkRange(selection as Range, { max: limit });
    if (r.end - r.start > 1 << 24) throw invalidRange(`${what} range ${r.start}:${r.end} is too large`);
    values = [];
    for (let i = r.start; i < r.end; i++) values.push(i);
  } else {
    throw new InvalidArgumentError(`${what} must be a range {start, end}, an array or a number`);
  }
  if (values.length === 0) throw invalidRange(`no ${what} selected`);
  for (const v of values) {
    if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
      throw invalidRange(`${what} must be non-negative integers, got ${String(v)}`);
    }
    if (v >= limit)
      throw invalidRange(`${what} ${v} is out of range: the model has ${limit}`, { [what]: v, limit });
  }
  values.sort((a, b) => a - b);
  for (let i = 1; i < values.length; i++) {
    if (values[i] === values[i - 1]) throw invalidRange(`${what} ${values[i]} is selected twice`);
  }
  return values;
}

interface SliceTensorPlan {
  readonly tensor: ExpertTensor;
  readonly ranges: ByteRange[];
  readonly shape: number[];
  readonly nbytes: bigint;
}

function sliceMetadata(
  source: GgufHeader,
  extra: {
    sourceId: string;
    sourceSha256: string;
    layers: number[];
    experts: number[];
    slabs: readonly string[];
  },
): Map<string, GgufMetadataValue> {
  const md = new Map<string, GgufMetadataValue>();
  for (const [key, value] of source.metadata) {
    // The tokenizer's arrays are most of a header and no use to an expert worker.
    if (key.startsWith("tokenizer.") && value.type === GgufValueType.ARRAY) continue;
    if (key.startsWith("moeswarm.slice.")) continue;
    md.set(key, value);
  }
  md.set(SLICE_KEYS.source, ggufValue.str(extra.sourceId));
  md.set(SLICE_KEYS.sourceSha256, ggufValue.str(extra.sourceSha256));
  md.set(SLICE_KEYS.layers, ggufValue.array(GgufValueType.UINT32, Uint32Array.from(extra.layers)));
  md.set(SLICE_KEYS.experts, ggufValue.array(GgufValueType.UINT32, Uint32Array.from(extra.experts)));
  md.set(SLICE_KEYS.slabSha256, ggufValue.array(GgufValueType.STRING, extra.slabs));
  return md;
}

/** Global ids of the source's experts: itself a slice lists them, a model has 0..n-1. */
function sourceExpertIds(
  header: GgufHeader,
  layout: MoeLayout,
): { globalCount: number; ids: readonly number[] | undefined } {
  const listed = header.metadata.get(SLICE_KEYS.experts);
  if (listed === undefined) {
    const n = layout.expertCount ?? layout.layers[0]?.nExpert ?? 0;
    return { globalCount: n, ids: undefined };
  }
  if (listed.type !== GgufValueType.ARRAY || listed.itemType !== GgufValueType.UINT32) {
    throw new GgufError("MOESWARM_GGUF_MISSING_KEY", `${SLICE_KEYS.experts} must be arr[u32]`);
  }
  const ids = [...(listed.value as ArrayLike<number> & Iterable<number>)];
  let max = -1;
  for (const id of ids) if (id > max) max = id;
  return { globalCount: layout.expertCount ?? max + 1, ids };
}

function checkManifest(
  manifest: SliceManifest,
  header: GgufHeader,
  layers: readonly ExpertLayer[],
  size: bigint | undefined,
) {
  const mismatch = (why: string) =>
    new GgufError("MOESWARM_SLICE_MISMATCH", `the manifest does not describe this source: ${why}`, {
      details: { why },
    });
  if (size !== undefined && BigInt(manifest.source.size) !== size)
    throw mismatch(`size ${manifest.source.size} != ${size}`);
  if (manifest.source.headerSize !== header.headerSize) throw mismatch("the header size differs");
  for (const l of layers) {
    const ml = manifest.layers.find((x) => x.layer === l.layer);
    if (!ml || ml.nExpert !== l.nExpert || ml.tensors.length !== l.tensors.length)
      throw mismatch(`layer ${l.layer} differs`);
    l.tensors.forEach((t, i) => {
      const mt = ml.tensors[i]!;
      if (
        mt.name !== t.name ||
        mt.type !== t.info.type ||
        BigInt(mt.offset) !== t.info.absoluteOffset ||
        BigInt(mt.slabBytes) !== t.slabBytes
      ) {
        throw mismatch(`tensor ${t.name} differs`);
      }
    });
  }
}

/** The selected layers, each of which must hold routed experts. */
function chooseLayers(
  layout: MoeLayout,
  selection: IndexSelection,
  description: string,
): { layers: number[]; chosen: ExpertLayer[] } {
  const blockCount = layout.blockCount ?? Math.max(...layout.layers.map((l) => l.layer)) + 1;
  const layers = selectIndices(selection, "layer", blockCount);
  const chosen: ExpertLayer[] = layers.map((n) => {
    const l = layout.layers.find((x) => x.layer === n);
    if (!l) {
      throw new GgufError("MOESWARM_GGUF_NOT_MOE", `layer ${n} of ${description} has no routed experts`, {
        details: { layer: n, moeLayers: layout.layers.map((x) => x.layer) },
      });
    }
    return l;
  });
  return { layers, chosen };
}

/** Each chosen tensor's byte ranges in the source (one per run of consecutive experts) and new shape. */
function tensorPlans(
  chosen: readonly ExpertLayer[],
  runs: readonly (readonly [number, number])[],
  nExperts: number,
): SliceTensorPlan[] {
  const tensors: SliceTensorPlan[] = [];
  for (const l of chosen) {
    for (const t of l.tensors) {
      const base = t.info.absoluteOffset;
      const ranges = runs.map(([a, b]) => ({
        start: base + BigInt(a) * t.slabBytes,
        end: base + BigInt(b) * t.slabBytes,
      }));
      const shape = [...t.info.shape];
      shape[t.expertAxis] = nExperts;
      tensors.push({ tensor: t, ranges, shape, nbytes: t.slabBytes * BigInt(nExperts) });
    }
  }
  return tensors;
}

/**
 * Where the slice comes from and its slab sha256s: from the manifest when given (checked against
 * the source), else hashed now from the source (a slice of a slice keeps its source's sha256).
 */
async function provenance(
  source: ByteSource,
  header: GgufHeader,
  o: {
    manifest: SliceManifest | undefined;
    sourceId: string | undefined;
    isSlice: boolean;
    chosen: readonly ExpertLayer[];
    experts: readonly number[];
    tensors: readonly SliceTensorPlan[];
    chunkSize: number;
    signal: AbortSignal | undefined;
  },
): Promise<{ sourceSha256: string; sourceId: string; slabs: string[] }> {
  const { manifest, isSlice, chosen, experts, tensors, chunkSize, signal } = o;
  let sourceSha256: string;
  let sourceId: string;
  let slabs: string[];
  if (manifest) {
    if (isSlice) throw new InvalidArgumentError("a manifest describes a model, not a slice");
    checkManifest(manifest, header, chosen, source.size);
    sourceSha256 = manifest.source.headerSha256;
    sourceId = o.sourceId ?? manifest.source.name;
    slabs = [];
    for (const l of chosen) {
      const ml = manifest.layers.find((x) => x.layer === l.layer)!;
      for (const mt of ml.tensors) for (const e of experts) slabs.push(mt.sha256[e]!);
    }
  } else {
    sourceSha256 = isSlice
      ? getStringKey(header, SLICE_KEYS.sourceSha256)
      : await sourceHeaderSha256(source, header, signal);
    sourceId = o.sourceId ?? modelName(header, source.description);
    slabs = [];
    for (const t of tensors) {
      const hasher = new SlabHasher(t.tensor.slabBytes);
      for await (const bytes of readRanges(source, t.ranges, chunkSize, signal)) hasher.update(bytes);
      slabs.push(...hasher.digests);
    }
  }
  return { sourceSha256, sourceId, slabs };
}

/** The header a reader would parse from the planned slice. */
function headerOfPlan(plan: GgufPlan): GgufHeader {
  return {
    version: plan.version,
    metadata: plan.metadata,
    tensors: plan.tensors.map(
      (t): GgufTensorInfo => ({
        name: t.name,
        type: t.type,
        shape: t.shape,
        nElements: t.nElements,
        nbytes: t.nbytes,
        offset: t.offset,
        absoluteOffset: t.absoluteOffset,
      }),
    ),
    alignment: plan.alignment,
    headerSize: plan.header.byteLength,
    dataOffset: plan.dataOffset,
    dataSize: plan.totalSize - plan.dataOffset,
    fileSize: plan.totalSize,
  };
}

/**
 * Cuts the routed experts `experts` of layers `layers` out of a MoE model into a GGUF of their
 * own, by byte copy: each expert tensor keeps its type and shape except its expert axis, which
 * holds only the chosen experts' slabs (contiguous experts copied as one range). Nothing is
 * dequantised or loaded whole; the stream reads the source in bounded chunks. The slice keeps the
 * model's hyper-parameters (minus the tokenizer arrays) and adds the `moeswarm.slice.*` keys
 * ({@link SLICE_KEYS}). A slice of a slice takes global expert ids and keeps the original
 * model's source id and header sha256, so the model's manifest verifies it.
 *
 * Errors: MOESWARM_INVALID_RANGE for empty, repeated or out-of-range selections;
 * GgufError MOESWARM_GGUF_NOT_MOE for a selected layer without routed experts.
 */
export async function sliceExperts(
  input: ByteSourceInput,
  options: SliceExpertsOptions,
): Promise<ExpertSlice> {
  if (typeof options !== "object" || options === null) {
    throw new InvalidArgumentError("sliceExperts needs {layers, experts}");
  }
  const { signal, manifest } = options;
  const chunkSize = checkChunkSize(options.chunkSize);
  throwIfAborted(signal);
  const { source, owned } = await openByteSource(input, { signal });
  try {
    const header = await readGguf(source, { signal });
    const layout = findExpertTensors(header);
    if (layout.layers.length === 0) {
      throw new GgufError("MOESWARM_GGUF_NOT_MOE", `${source.description} has no routed-expert tensors`);
    }
    const { layers, chosen } = chooseLayers(layout, options.layers, source.description);
    const { globalCount, ids } = sourceExpertIds(header, layout);
    const experts = selectIndices(options.experts, "expert", globalCount);
    const position = new Map(ids?.map((id, i) => [id, i]));
    const local = experts.map((e) => {
      if (!ids) return e;
      const i = position.get(e) ?? -1;
      if (i < 0)
        throw invalidRange(`expert ${e} is not in this slice of ${source.description}`, { expert: e });
      return i;
    });
    const runs = runsOf(local);

    const tensors = tensorPlans(chosen, runs, experts.length);

    const { sourceSha256, sourceId, slabs } = await provenance(source, header, {
      manifest,
      sourceId: options.sourceId,
      isSlice: ids !== undefined,
      chosen,
      experts,
      tensors,
      chunkSize,
      signal,
    });

    const plan = planGguf({
      metadata: sliceMetadata(header, { sourceId, sourceSha256, layers, experts, slabs }),
      tensors: tensors.map((t) => ({
        name: t.tensor.name,
        type: t.tensor.info.type,
        shape: t.shape,
        data: {
          source: concatRangesSource(source, t.ranges, `${source.description} ${t.tensor.name}`),
          offset: 0,
          length: t.nbytes,
        },
      })),
      version: header.version,
    });
    const length = Number(plan.totalSize);
    const sliceHeader = headerOfPlan(plan);
    let closed = false;
    const close = async () => {
      if (closed) return;
      closed = true;
      if (owned) await source.close();
    };
    const range = (start: number, end: number, opts: SliceStreamOptions = {}): AsyncIterable<Uint8Array> => {
      if (
        !Number.isSafeInteger(start) ||
        !Number.isSafeInteger(end) ||
        start < 0 ||
        end < start ||
        end > length
      ) {
        throw invalidRange(
          `byte range ${String(start)}-${String(end)} is not inside the ${length}-byte slice`,
          {
            start,
            end,
            length,
          },
        );
      }
      return ggufByteStream(plan, { start, end, chunkSize, signal: opts.signal });
    };
    const slice: ExpertSlice = {
      length,
      header: sliceHeader,
      plan,
      layers,
      experts,
      stream: (opts = {}) => ggufByteStream(plan, { chunkSize, signal: opts.signal }),
      range,
      write: (path, opts = {}) =>
        writeStream(path, ggufByteStream(plan, { chunkSize, signal: opts.signal }), length, opts),
      close,
      [Symbol.asyncDispose]: close,
    };
    return slice;
  } catch (error) {
    if (owned) await source.close();
    throw error;
  }
}

function getStringKey(header: GgufHeader, key: string): string {
  const v = header.metadata.get(key);
  if (v?.type !== GgufValueType.STRING)
    throw new GgufError("MOESWARM_GGUF_MISSING_KEY", `${key} must be a string`);
  return v.value;
}

async function writeStream(
  path: string,
  chunks: AsyncIterable<Uint8Array>,
  total: number,
  options: SliceWriteOptions,
): Promise<void> {
  if (typeof path !== "string" || path.length === 0) {
    throw new InvalidArgumentError("write needs a non-empty path");
  }
  throwIfAborted(options.signal);
  let written = 0;
  await writeFileAtomically(
    path,
    async (handle) => {
      for await (const chunk of chunks) {
        await writeAll(handle, chunk);
        written += chunk.byteLength;
        options.onProgress?.({ bytesWritten: written, totalBytes: total });
      }
    },
    options.signal,
  );
}

/** The layers and experts a slice file holds, from its `moeswarm.slice.*` keys. */
export function sliceContents(header: GgufHeader): {
  source: string;
  sourceSha256: string;
  layers: number[];
  experts: number[];
} {
  const arr = (key: string): number[] => {
    const v = header.metadata.get(key);
    if (v?.type !== GgufValueType.ARRAY || v.itemType !== GgufValueType.UINT32) {
      throw new GgufError("MOESWARM_GGUF_MISSING_KEY", `${key} must be arr[u32] in a slice`, {
        details: { key },
      });
    }
    return [...(v.value as ArrayLike<number> & Iterable<number>)];
  };
  return {
    source: getStringKey(header, SLICE_KEYS.source),
    sourceSha256: getStringKey(header, SLICE_KEYS.sourceSha256),
    layers: arr(SLICE_KEYS.layers),
    experts: arr(SLICE_KEYS.experts),
  };
}

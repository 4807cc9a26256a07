import { readFile, stat } from "node:fs/promises";
import { basename } from "node:path";
import { GgufError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import { writeFileAtomically } from "./atomic-file.js";
import { type ByteSource, type ByteSourceInput, openByteSource } from "./byte-source.js";
import { ggmlTypeName } from "./ggml-type.js";
import { getString } from "./gguf-metadata.js";
import { type GgufHeader, readGguf } from "./gguf-reader.js";
import { type ExpertProjection, findExpertTensors, SLICE_KEYS } from "./moe-tensors.js";
import { checkChunkSize, readRanges, SlabHasher, sha256OfRange } from "./slice-io.js";

export const MANIFEST_FORMAT = "moeswarm.manifest/1";

/** One expert tensor of a layer: where it lies in the source and the sha256 of each expert's slab. */
export interface ManifestTensor {
  readonly name: string;
  readonly projection: ExpertProjection;
  readonly suffix: string;
  /** ggml type id and name. */
  readonly type: number;
  readonly typeName: string;
  /** ggml `ne`, the expert axis last. */
  readonly shape: readonly number[];
  /** Absolute offset of the tensor's data in the source file. */
  readonly offset: number;
  readonly nbytes: number;
  /** Slab of expert e: `[offset + e * slabBytes, offset + (e + 1) * slabBytes)`. */
  readonly slabBytes: number;
  /** sha256 (hex) of each expert's slab, indexed by expert id. */
  readonly sha256: readonly string[];
}

export interface ManifestLayer {
  readonly layer: number;
  readonly nExpert: number;
  readonly bytesPerExpert: number;
  readonly tensors: readonly ManifestTensor[];
}

/** What a model's experts are: per layer, per tensor, per expert: type, shape, byte range, sha256. */
export interface SliceManifest {
  readonly format: typeof MANIFEST_FORMAT;
  readonly source: {
    /** The model id slices carry as `moeswarm.slice.source`. */
    readonly name: string;
    readonly arch: string | null;
    readonly size: number;
    /** mtime of the file when the manifest was built (cache invalidation); null for other sources. */
    readonly mtimeMs: number | null;
    readonly headerSize: number;
    /** sha256 of the header bytes: what slices carry as `moeswarm.slice.source_sha256`. */
    readonly headerSha256: string;
    readonly alignment: number;
  };
  readonly blockCount: number | null;
  readonly expertCount: number | null;
  readonly expertUsedCount: number | null;
  readonly layers: readonly ManifestLayer[];
}

/** One slab of a manifest, with its byte range in the source. */
export interface ManifestSlab {
  readonly layer: number;
  readonly expert: number;
  readonly tensor: string;
  readonly start: number;
  readonly end: number;
  readonly sha256: string;
}

/** Every slab of the manifest: layer by layer, tensor by tensor, expert by expert. */
export function* manifestSlabs(manifest: SliceManifest): Generator<ManifestSlab> {
  for (const l of manifest.layers) {
    for (const t of l.tensors) {
      for (let e = 0; e < l.nExpert; e++) {
        const start = t.offset + e * t.slabBytes;
        yield {
          layer: l.layer,
          expert: e,
          tensor: t.name,
          start,
          end: start + t.slabBytes,
          sha256: t.sha256[e]!,
        };
      }
    }
  }
}

export interface ManifestProgress {
  bytesDone: number;
  bytesTotal: number;
}

export interface BuildManifestOptions {
  signal?: AbortSignal;
  onProgress?: (progress: ManifestProgress) => void;
  /** The model id (default `general.name`, else the file's name). */
  name?: string;
  /** Read size in bytes (default 8 MiB). */
  chunkSize?: number;
}

function safeNumber(value: bigint, what: string): number {
  if (value > BigInt(Number.MAX_SAFE_INTEGER)) {
    throw new GgufError("MOESWARM_GGUF_LIMIT", `${what} ${value} is beyond 2^53`);
  }
  return Number(value);
}

/** sha256 of the source's header bytes (magic through the last tensor info). */
export function sourceHeaderSha256(
  source: ByteSource,
  header: GgufHeader,
  signal?: AbortSignal,
): Promise<string> {
  return sha256OfRange(source, 0n, BigInt(header.headerSize), { signal });
}

/** The model id a slice of this header carries: the slice's own source, `general.name`, or the file name. */
export function modelName(header: GgufHeader, description: string): string {
  if (header.metadata.has(SLICE_KEYS.source)) return getString(header, SLICE_KEYS.source);
  if (header.metadata.has("general.name")) {
    const name = getString(header, "general.name");
    if (name.length > 0) return name;
  }
  return basename(description);
}

/**
 * Builds the manifest of a model: reads its header, then every routed-expert tensor once, in
 * file order and bounded chunks, hashing each expert's slab (memory stays flat whatever the
 * model size). GgufError MOESWARM_GGUF_NOT_MOE when it has no routed experts.
 */
export async function buildManifest(
  input: ByteSourceInput,
  options: BuildManifestOptions = {},
): Promise<SliceManifest> {
  const { signal, onProgress } = options;
  const chunkSize = checkChunkSize(options.chunkSize);
  throwIfAborted(signal);
  const { source, owned } = await openByteSource(input, { signal });
  try {
    const header = await readGguf(source, { signal });
    if (header.metadata.has(SLICE_KEYS.experts)) {
      throw new InvalidArgumentError(
        `${source.description} is a slice; build the manifest of the model it was cut from`,
      );
    }
    const layout = findExpertTensors(header);
    if (layout.layers.length === 0) {
      throw new GgufError("MOESWARM_GGUF_NOT_MOE", `${source.description} has no routed-expert tensors`);
    }
    const headerSha256 = await sourceHeaderSha256(source, header, signal);
    const bytesTotal = safeNumber(
      layout.layers.reduce((sum, l) => sum + l.tensors.reduce((s, t) => s + t.info.nbytes, 0n), 0n),
      "expert bytes",
    );
    let bytesDone = 0;
    onProgress?.({ bytesDone, bytesTotal });
    const layers: ManifestLayer[] = [];
    for (const l of layout.layers) {
      const tensors: ManifestTensor[] = [];
      for (const t of l.tensors) {
        const hasher = new SlabHasher(t.slabBytes);
        const start = t.info.absoluteOffset;
        for await (const bytes of readRanges(
          source,
          [{ start, end: start + t.info.nbytes }],
          chunkSize,
          signal,
        )) {
          hasher.update(bytes);
          bytesDone += bytes.byteLength;
          onProgress?.({ bytesDone, bytesTotal });
        }
        tensors.push({
          name: t.name,
          projection: t.projection,
          suffix: t.suffix,
          type: t.info.type,
          typeName: ggmlTypeName(t.info.type),
          shape: [...t.info.shape],
          offset: safeNumber(start, "tensor offset"),
          nbytes: safeNumber(t.info.nbytes, "tensor size"),
          slabBytes: safeNumber(t.slabBytes, "slab size"),
          sha256: hasher.digests,
        });
      }
      layers.push({
        layer: l.layer,
        nExpert: l.nExpert,
        bytesPerExpert: safeNumber(l.bytesPerExpert, "expert size"),
        tensors,
      });
    }
    return {
      format: MANIFEST_FORMAT,
      source: {
        name: options.name ?? modelName(header, source.description),
        arch: layout.arch ?? null,
        size: safeNumber(header.fileSize ?? source.size ?? 0n, "file size"),
        mtimeMs: null,
        headerSize: header.headerSize,
        headerSha256,
        alignment: header.alignment,
      },
      blockCount: layout.blockCount ?? null,
      expertCount: layout.expertCount ?? null,
      expertUsedCount: layout.expertUsedCount ?? null,
      layers,
    };
  } finally {
    if (owned) await source.close();
  }
}

const HEX64 = /^[0-9a-f]{64}$/;

function isNonNegInt(v: unknown): v is number {
  return typeof v === "number" && Number.isSafeInteger(v) && v >= 0;
}

/**
 * Checks that a parsed JSON value is a well-formed manifest (a hand-edited or truncated cache, or
 * one fetched from a hub) and returns it typed. GgufError MOESWARM_SLICE_MISMATCH when it is not.
 */
export function parseManifest(value: unknown): SliceManifest {
  const bad = (why: string) =>
    new GgufError("MOESWARM_SLICE_MISMATCH", `not a valid ${MANIFEST_FORMAT} manifest: ${why}`, {
      details: { why },
    });
  if (typeof value !== "object" || value === null) throw bad("not an object");
  const m = value as Record<string, unknown>;
  if (m.format !== MANIFEST_FORMAT) throw bad(`format is ${JSON.stringify(m.format)}`);
  const src = m.source as Record<string, unknown> | undefined;
  if (
    typeof src !== "object" ||
    src === null ||
    typeof src.name !== "string" ||
    !isNonNegInt(src.size) ||
    !isNonNegInt(src.headerSize) ||
    typeof src.headerSha256 !== "string" ||
    !HEX64.test(src.headerSha256) ||
    !isNonNegInt(src.alignment)
  ) {
    throw bad("source is incomplete");
  }
  if (!Array.isArray(m.layers)) throw bad("layers is not an array");
  for (const l of m.layers as unknown[]) {
    const layer = l as Record<string, unknown>;
    if (
      !isNonNegInt(layer.layer) ||
      !isNonNegInt(layer.nExpert) ||
      layer.nExpert === 0 ||
      !Array.isArray(layer.tensors)
    ) {
      throw bad("a layer is incomplete");
    }
    for (const t of layer.tensors as unknown[]) {
      const tensor = t as Record<string, unknown>;
      if (
        typeof tensor.name !== "string" ||
        !isNonNegInt(tensor.type) ||
        !Array.isArray(tensor.shape) ||
        !tensor.shape.every(isNonNegInt) ||
        !isNonNegInt(tensor.offset) ||
        !isNonNegInt(tensor.nbytes) ||
        !isNonNegInt(tensor.slabBytes) ||
        tensor.slabBytes * (layer.nExpert as number) !== tensor.nbytes ||
        !Array.isArray(tensor.sha256) ||
        tensor.sha256.length !== layer.nExpert ||
        !tensor.sha256.every((h) => typeof h === "string" && HEX64.test(h))
      ) {
        throw bad(`tensor ${JSON.stringify(tensor.name)} of layer ${layer.layer} is incomplete`);
      }
    }
  }
  return value as SliceManifest;
}

export interface LoadOrBuildManifestOptions extends BuildManifestOptions {
  /** Where the manifest is cached (default `<model>.manifest.json`). */
  manifestPath?: string;
  /** Write the cache file (default true); a read-only directory only skips the write. */
  writeCache?: boolean;
}

export interface LoadedManifest {
  readonly manifest: SliceManifest;
  /** True when the cached file was valid and used. */
  readonly cached: boolean;
  readonly manifestPath: string;
}

/**
 * The manifest of a model file, from `<model>.manifest.json` when that is still valid (same size,
 * mtime and header sha256), else built (one streamed pass) and cached there, atomically.
 */
export async function loadOrBuildManifest(
  path: string,
  options: LoadOrBuildManifestOptions = {},
): Promise<LoadedManifest> {
  if (typeof path !== "string" || path.length === 0) {
    throw new InvalidArgumentError("loadOrBuildManifest needs a model path");
  }
  const { signal } = options;
  throwIfAborted(signal);
  const manifestPath = options.manifestPath ?? `${path}.manifest.json`;
  let st: Awaited<ReturnType<typeof stat>>;
  try {
    st = await stat(path);
  } catch (error) {
    throw new GgufError("MOESWARM_GGUF_IO", `cannot stat ${path}: ${(error as Error).message}`, {
      cause: error,
    });
  }
  const cachedText = await readFile(manifestPath, "utf8").catch(() => undefined);
  if (cachedText !== undefined) {
    let cached: SliceManifest | undefined;
    try {
      cached = parseManifest(JSON.parse(cachedText));
    } catch {
      cached = undefined; // corrupt or foreign: rebuilt below
    }
    if (cached && cached.source.size === st.size && cached.source.mtimeMs === st.mtimeMs) {
      const { source } = await openByteSource(path, { signal });
      try {
        const header = await readGguf(source, { signal });
        if (
          header.headerSize === cached.source.headerSize &&
          (await sourceHeaderSha256(source, header, signal)) === cached.source.headerSha256 &&
          (options.name === undefined || options.name === cached.source.name)
        ) {
          return { manifest: cached, cached: true, manifestPath };
        }
      } finally {
        await source.close();
      }
    }
  }
  const built = await buildManifest(path, options);
  const manifest: SliceManifest = { ...built, source: { ...built.source, mtimeMs: st.mtimeMs } };
  if (options.writeCache !== false) {
    // a cache: a failed write costs a rebuild next time, nothing more
    await writeFileAtomically(manifestPath, (h) => h.writeFile(`${JSON.stringify(manifest)}\n`)).catch(
      () => undefined,
    );
  }
  return { manifest, cached: false, manifestPath };
}

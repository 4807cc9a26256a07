import { GgufError, InvalidArgumentError, throwIfAborted } from "@moeswarm/core";
import { type ByteSource, type ByteSourceInput, openByteSource } from "./byte-source.js";
import {
  GGUF_DEFAULT_ALIGNMENT,
  GGUF_KEY_GENERAL_ALIGNMENT,
  GGUF_MAGIC,
  GgufValueType,
  ggufValueTypeName,
} from "./gguf-constants.js";
import type { GgufHeader, GgufTensorInfo, MutableTensorInfo } from "./gguf-header.js";
import { Fetcher } from "./gguf-header-fetch.js";
import { badTensor, HeaderParser, limit, NEED, truncated } from "./gguf-header-parser.js";
import { type GgufLimits, resolveGgufLimits } from "./gguf-limits.js";
import type { GgufMetadata, GgufMetadataValue } from "./gguf-metadata.js";

export type { GgufHeader, GgufTensorInfo } from "./gguf-header.js";

export interface ReadGgufOptions {
  signal?: AbortSignal;
  /** Bounds on counts and lengths (defaults in DEFAULT_GGUF_LIMITS). */
  limits?: Partial<GgufLimits>;
  /**
   * First read-ahead in bytes: the source's `preferredReadSize` (1 MiB for a file, everything
   * for a buffer), else 1 MiB (HTTP). Each further read doubles it up to 64 MiB, or asks for
   * exactly what a large value needs, so a header costs a handful of reads (HTTP requests).
   */
  blockSize?: number;
  /**
   * Size of the whole file when the source holds only its beginning (header bytes kept in
   * memory, say): tensor data is checked against this instead of the source's size.
   */
  fileSize?: bigint | number;
}

const DEFAULT_BLOCK = 1024 * 1024;

/**
 * Reads the header of a GGUF file (v2 or v3, little-endian): metadata with value types, tensor
 * infos, alignment and data offset. Reads only the header's bytes, in a few large reads, so a
 * 100+ GB model over HTTP costs a few requests. Every count, length and offset is checked before
 * use; a malformed or hostile file gets a GgufError with a code, never a huge allocation.
 */
export async function readGguf(input: ByteSourceInput, options: ReadGgufOptions = {}): Promise<GgufHeader> {
  const limits = resolveGgufLimits(options.limits);
  const requested = options.blockSize;
  const declared = options.fileSize;
  if (
    declared !== undefined &&
    !(typeof declared === "bigint" ? declared >= 0n : Number.isSafeInteger(declared) && declared >= 0)
  ) {
    throw new InvalidArgumentError(`fileSize must be a non-negative integer, got ${String(declared)}`);
  }
  const declaredSize = declared === undefined ? undefined : BigInt(declared);
  if (
    requested !== undefined &&
    (!Number.isSafeInteger(requested) || requested < 64 || requested > 2 ** 31 - 1)
  ) {
    throw new InvalidArgumentError(
      `blockSize must be an integer in [64, 2^31 - 1], got ${String(requested)}`,
    );
  }
  throwIfAborted(options.signal);
  const { source, owned } = await openByteSource(input, { signal: options.signal });
  try {
    const preferred = source.preferredReadSize;
    const blockSize =
      requested ??
      (typeof preferred === "number" && Number.isSafeInteger(preferred) && preferred > 0
        ? Math.min(preferred, 2 ** 31 - 1)
        : DEFAULT_BLOCK);
    return await parseHeader(source, limits, options.signal, blockSize, declaredSize);
  } finally {
    if (owned) await source.close();
  }
}

/** Magic, version and the two counts: the fixed 24 bytes every GGUF file starts with. */
async function readPreamble(
  parser: HeaderParser,
  fetcher: Fetcher,
  limits: GgufLimits,
): Promise<{ version: 2 | 3; nTensors: number; nKv: number }> {
  await fetcher.grow(0, 0);
  if (parser.end < 4)
    throw new GgufError("MOESWARM_GGUF_BAD_MAGIC", "the file is shorter than the GGUF magic");
  if (parser.u32(0) !== GGUF_MAGIC) {
    const b = parser.bytes;
    throw new GgufError(
      "MOESWARM_GGUF_BAD_MAGIC",
      `not a GGUF file: starts with ${[...b.subarray(0, 4)].map((x) => x.toString(16).padStart(2, "0")).join(" ")}`,
    );
  }
  if (parser.end < 24) await fetcher.grow(0, 24);
  const version = parser.u32(4);
  if ((version & 0xffff) === 0 && version !== 0) {
    // gguf.cpp's test: a byte-swapped small version reads as 0xVV000000.
    throw new GgufError(
      "MOESWARM_GGUF_UNSUPPORTED_VERSION",
      `version field 0x${version.toString(16)}: a big-endian GGUF file; only little-endian files are supported`,
      { details: { version, bigEndian: true } },
    );
  }
  if (version !== 2 && version !== 3) {
    throw new GgufError(
      "MOESWARM_GGUF_UNSUPPORTED_VERSION",
      version === 1
        ? "GGUF v1 is not supported (only v2 and v3)"
        : `GGUF version ${version} is not supported (only v2 and v3)`,
      { details: { version } },
    );
  }
  const nTensors = parser.u64Approx(8);
  const nKv = parser.u64Approx(16);
  if (nTensors > limits.maxTensorCount) throw limit("the tensor count", nTensors, limits.maxTensorCount);
  if (nKv > limits.maxKvCount) throw limit("the metadata key count", nKv, limits.maxKvCount);
  // Smallest encodings: a kv is 8 (key length) + 4 (type) + 1; a tensor info 8 + 4 + 4 + 8.
  const minEnd = 24 + nKv * 13 + nTensors * 24;
  if (minEnd > parser.eof)
    throw truncated(`${nKv} metadata pairs and ${nTensors} tensor infos`, minEnd, parser.eof);
  parser.pos = 24;
  return { version, nTensors, nKv };
}

async function readMetadata(parser: HeaderParser, fetcher: Fetcher, nKv: number): Promise<GgufMetadata> {
  const metadata = new Map<string, GgufMetadataValue>();
  for (let i = 0; i < nKv; i++) {
    const start = parser.pos;
    const budget = parser.elementsLeft;
    let kv = parser.kv(i);
    while (kv === NEED) {
      await fetcher.grow(start, parser.need);
      parser.pos = start;
      parser.elementsLeft = budget;
      kv = parser.kv(i);
    }
    if (metadata.has(kv[0])) {
      throw new GgufError(
        "MOESWARM_GGUF_DUPLICATE_KEY",
        `metadata key ${JSON.stringify(kv[0])} appears twice`,
        {
          details: { key: kv[0] },
        },
      );
    }
    metadata.set(kv[0], kv[1]);
  }
  return metadata;
}

/** `general.alignment` when present (a u32 power of two), else ggml's default. */
function alignmentOf(metadata: GgufMetadata): number {
  const align = metadata.get(GGUF_KEY_GENERAL_ALIGNMENT);
  if (align === undefined) return GGUF_DEFAULT_ALIGNMENT;
  if (align.type !== GgufValueType.UINT32) {
    throw new GgufError(
      "MOESWARM_GGUF_BAD_ALIGNMENT",
      `${GGUF_KEY_GENERAL_ALIGNMENT} must be u32, not ${align.type === GgufValueType.ARRAY ? "arr" : ggufValueTypeName(align.type)}`,
    );
  }
  const alignment = align.value;
  if (alignment === 0 || (alignment & (alignment - 1)) !== 0) {
    throw new GgufError(
      "MOESWARM_GGUF_BAD_ALIGNMENT",
      `${GGUF_KEY_GENERAL_ALIGNMENT} = ${alignment} is not a power of two`,
      {
        details: { alignment },
      },
    );
  }
  return alignment;
}

/** Tensor infos with their data offsets and sizes as numbers, for the bound checks. */
interface TensorInfos {
  readonly tensors: MutableTensorInfo[];
  readonly offsets: number[];
  readonly sizes: number[];
}

async function readTensorInfos(
  parser: HeaderParser,
  fetcher: Fetcher,
  nTensors: number,
  alignment: number,
): Promise<TensorInfos> {
  const tensors: MutableTensorInfo[] = [];
  const offsets: number[] = [];
  const sizes: number[] = [];
  const names = new Set<string>();
  for (let i = 0; i < nTensors; i++) {
    const start = parser.pos;
    let t = parser.tensorInfo(i);
    while (t === NEED) {
      await fetcher.grow(start, parser.need);
      parser.pos = start;
      t = parser.tensorInfo(i);
    }
    if (names.has(t.name)) throw badTensor(t.name, "the name appears twice");
    names.add(t.name);
    if (parser.lastOffset % alignment !== 0) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_ALIGNMENT",
        `tensor ${JSON.stringify(t.name)}: offset ${t.offset} is not a multiple of the alignment ${alignment}`,
        { details: { tensor: t.name, offset: t.offset.toString(), alignment } },
      );
    }
    tensors.push(t);
    offsets.push(parser.lastOffset);
    sizes.push(parser.lastNbytes);
  }
  return { tensors, offsets, sizes };
}

/**
 * Sets each tensor's absolute offset after checking its data lies inside the file, and returns
 * the data section's size (the end of the furthest tensor, padded).
 */
function placeTensors(
  { tensors, offsets, sizes }: TensorInfos,
  dataStart: number,
  alignment: number,
  fileSize: bigint | undefined,
): number {
  const dataOffset = BigInt(dataStart);
  // Every bound below is checked in numbers: a file past 2^53 bytes (8 PiB) does not exist.
  const limitEnd =
    fileSize === undefined || fileSize > BigInt(Number.MAX_SAFE_INTEGER)
      ? Number.MAX_SAFE_INTEGER
      : Number(fileSize);
  if (tensors.length > 0 && dataStart > limitEnd) {
    throw truncated("the padding before the tensor data", dataStart, limitEnd);
  }
  let dataSize = 0;
  let ordered = true;
  for (let i = 0; i < tensors.length; i++) {
    const t = tensors[i]!;
    const offset = offsets[i]!;
    const nbytes = sizes[i]!;
    const absolute = dataStart + offset;
    if (absolute + nbytes > limitEnd) {
      const where = fileSize === undefined ? "past 2^53 bytes" : `outside the ${fileSize}-byte file`;
      throw new GgufError(
        "MOESWARM_GGUF_BAD_OFFSET",
        `tensor ${JSON.stringify(t.name)}: data [${dataOffset + t.offset}, ${dataOffset + t.offset + t.nbytes}) lies ${where}`,
        {
          details: {
            tensor: t.name,
            offset: (dataOffset + t.offset).toString(),
            nbytes: t.nbytes.toString(),
          },
        },
      );
    }
    t.absoluteOffset = BigInt(absolute);
    const padded = Math.ceil((offset + nbytes) / alignment) * alignment;
    if (padded > dataSize) dataSize = padded;
    if (i > 0 && offset < offsets[i - 1]!) ordered = false;
  }
  checkOverlaps(tensors, offsets, sizes, ordered);
  return dataSize;
}

async function parseHeader(
  source: ByteSource,
  limits: GgufLimits,
  signal: AbortSignal | undefined,
  blockSize: number,
  declaredSize: bigint | undefined,
): Promise<GgufHeader> {
  const parser = new HeaderParser(limits);
  const fetcher = new Fetcher(source, parser, signal, blockSize);
  const { version, nTensors, nKv } = await readPreamble(parser, fetcher, limits);
  const metadata = await readMetadata(parser, fetcher, nKv);
  const alignment = alignmentOf(metadata);
  const infos = await readTensorInfos(parser, fetcher, nTensors, alignment);

  const headerSize = parser.pos;
  const dataStart = Math.ceil(headerSize / alignment) * alignment;
  const sourceSize = source.size ?? (Number.isFinite(parser.eof) ? BigInt(parser.eof) : undefined);
  if (declaredSize !== undefined && sourceSize !== undefined && declaredSize < sourceSize) {
    throw new InvalidArgumentError(
      `fileSize ${declaredSize} is smaller than the source (${sourceSize} bytes)`,
    );
  }
  const fileSize = declaredSize ?? sourceSize;
  const dataSize = placeTensors(infos, dataStart, alignment, fileSize);

  return {
    version,
    metadata,
    tensors: infos.tensors,
    alignment,
    headerSize,
    dataOffset: BigInt(dataStart),
    dataSize: BigInt(dataSize),
    fileSize,
  };
}

function checkOverlaps(
  tensors: readonly GgufTensorInfo[],
  offsets: readonly number[],
  sizes: readonly number[],
  ordered: boolean,
): void {
  // Writers lay tensors out in order, so sorting is usually unnecessary.
  const order: number[] = [];
  for (let i = 0; i < tensors.length; i++) if (sizes[i]! > 0) order.push(i);
  if (!ordered) order.sort((a, b) => offsets[a]! - offsets[b]!);
  for (let k = 1; k < order.length; k++) {
    const prev = order[k - 1]!;
    const cur = order[k]!;
    if (offsets[prev]! + sizes[prev]! > offsets[cur]!) {
      const a = tensors[prev]!.name;
      const b = tensors[cur]!.name;
      throw new GgufError(
        "MOESWARM_GGUF_BAD_OFFSET",
        `tensors ${JSON.stringify(a)} and ${JSON.stringify(b)} overlap`,
        {
          details: { tensors: [a, b] },
        },
      );
    }
  }
}

/** Finds a tensor info by name. */
export function findTensor(header: Pick<GgufHeader, "tensors">, name: string): GgufTensorInfo | undefined {
  return header.tensors.find((t) => t.name === name);
}

// Planning a GGUF file: the exact header bytes and every tensor's offset, before any byte is
// written (the writer and the byte stream only follow a plan).
import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import type { ByteSource } from "./byte-source.js";
import { type GgmlType, ggmlTensorBytes, ggmlTypeTraits, isGgmlType } from "./ggml-type.js";
import {
  GGML_MAX_DIMS,
  GGML_MAX_NAME,
  GGUF_DEFAULT_ALIGNMENT,
  GGUF_KEY_GENERAL_ALIGNMENT,
  GGUF_MAGIC,
  GGUF_VERSION,
  GgufValueType,
} from "./gguf-constants.js";
import type { GgufTensorInfo } from "./gguf-header.js";
import type { GgufMetadata, GgufMetadataValue } from "./gguf-metadata.js";
import { ByteBuilder, writeValue } from "./gguf-write-values.js";

/** Bytes of a tensor taken from a range of a source (a slab of another GGUF file, say). */
export interface GgufTensorRange {
  readonly source: ByteSource;
  readonly offset: bigint | number;
  readonly length: bigint | number;
}

export interface GgufWriteTensor {
  readonly name: string;
  readonly type: GgmlType;
  /** ggml's `ne`, fastest-varying first, at most 4 entries. */
  readonly shape: readonly number[];
  /** The tensor's bytes (exactly `ggml_nbytes`). Optional only for header-only output. */
  readonly data?: Uint8Array | GgufTensorRange;
}

export interface GgufWriteInput {
  /** In the order to write (a Map, or a record whose key order is kept). */
  readonly metadata: GgufMetadata | Readonly<Record<string, GgufMetadataValue>>;
  /** Written in this order, each at the next aligned offset (as ggml and gguf-py lay them out). */
  readonly tensors: readonly GgufWriteTensor[];
  /**
   * Data alignment; defaults to the metadata's `general.alignment`, else 32. A value other than 32
   * not in the metadata is added to it as `general.alignment` (u32) so readers find it.
   */
  readonly alignment?: number;
  /** GGUF version to write (default 3; v2 has the same little-endian layout). */
  readonly version?: 2 | 3;
}

export interface GgufPlannedTensor extends GgufTensorInfo {
  readonly data: Uint8Array | GgufTensorRange | undefined;
}

/** The exact layout of a GGUF file before any byte is written. */
export interface GgufPlan {
  readonly version: 2 | 3;
  /** The metadata as written (with `general.alignment` when it was added). */
  readonly metadata: GgufMetadata;
  readonly alignment: number;
  /** Magic through the last tensor info, unpadded. */
  readonly header: Uint8Array;
  /** Where tensor data starts: `header.byteLength` rounded up to the alignment. */
  readonly dataOffset: bigint;
  readonly tensors: readonly GgufPlannedTensor[];
  /** Size of the whole file; every tensor's data is padded to the alignment, the last one too. */
  readonly totalSize: bigint;
}

const PLANS = new WeakSet<object>();
const MAX_ALIGNMENT = 2 ** 31;

function metadataEntries(input: GgufWriteInput["metadata"]): [string, GgufMetadataValue][] {
  if (input instanceof Map) return [...input.entries()];
  if (typeof input !== "object" || input === null)
    throw new InvalidArgumentError("metadata must be a Map or an object");
  return Object.entries(input as Readonly<Record<string, GgufMetadataValue>>);
}

function checkAlignment(alignment: unknown, what: string): number {
  if (
    typeof alignment !== "number" ||
    !Number.isInteger(alignment) ||
    alignment <= 0 ||
    alignment > MAX_ALIGNMENT ||
    (alignment & (alignment - 1)) !== 0
  ) {
    throw new GgufError(
      "MOESWARM_GGUF_BAD_ALIGNMENT",
      `${what} = ${String(alignment)} is not a power of two u32`,
      {
        details: { alignment: String(alignment) },
      },
    );
  }
  return alignment;
}

const NAME_ENCODER = new TextEncoder();

function isTensorRange(value: unknown): value is GgufTensorRange {
  return (
    typeof value === "object" && value !== null && "source" in value && "offset" in value && "length" in value
  );
}

export function toBigInt(value: unknown, what: string): bigint {
  if (typeof value === "bigint" && value >= 0n) return value;
  if (typeof value === "number" && Number.isSafeInteger(value) && value >= 0) return BigInt(value);
  throw new InvalidArgumentError(`${what} must be a non-negative integer, got ${String(value)}`);
}

/** `general.alignment` from the metadata, else the option (added to the metadata when not 32). */
function resolveAlignment(entries: [string, GgufMetadataValue][], requested: number | undefined): number {
  const alignEntry = entries.find(([k]) => k === GGUF_KEY_GENERAL_ALIGNMENT)?.[1];
  if (alignEntry !== undefined) {
    if (alignEntry.type !== GgufValueType.UINT32) {
      throw new GgufError("MOESWARM_GGUF_BAD_ALIGNMENT", `${GGUF_KEY_GENERAL_ALIGNMENT} must be u32`);
    }
    const alignment = checkAlignment(alignEntry.value, GGUF_KEY_GENERAL_ALIGNMENT);
    if (requested !== undefined && requested !== alignment) {
      throw new GgufError(
        "MOESWARM_GGUF_BAD_ALIGNMENT",
        `alignment ${String(requested)} disagrees with ${GGUF_KEY_GENERAL_ALIGNMENT} = ${alignment}`,
      );
    }
    return alignment;
  }
  const alignment = checkAlignment(requested ?? GGUF_DEFAULT_ALIGNMENT, "alignment");
  if (alignment !== GGUF_DEFAULT_ALIGNMENT) {
    entries.push([GGUF_KEY_GENERAL_ALIGNMENT, { type: GgufValueType.UINT32, value: alignment }]);
  }
  return alignment;
}

/** Checks a tensor's data (bytes or a source range) against the size its shape needs. */
function checkTensorData(name: string, data: GgufWriteTensor["data"], nbytes: bigint): void {
  if (data === undefined) return;
  if (data instanceof Uint8Array) {
    if (BigInt(data.byteLength) !== nbytes) {
      throw new InvalidArgumentError(
        `tensor ${JSON.stringify(name)}: ${data.byteLength} bytes of data, the shape needs ${nbytes}`,
        { details: { tensor: name } },
      );
    }
  } else if (isTensorRange(data)) {
    const length = toBigInt(data.length, `tensor ${JSON.stringify(name)} data length`);
    const from = toBigInt(data.offset, `tensor ${JSON.stringify(name)} data offset`);
    if (length !== nbytes) {
      throw new InvalidArgumentError(
        `tensor ${JSON.stringify(name)}: a range of ${length} bytes, the shape needs ${nbytes}`,
        { details: { tensor: name } },
      );
    }
    const size = data.source.size;
    if (size !== undefined && from + length > size) {
      throw new InvalidArgumentError(
        `tensor ${JSON.stringify(name)}: range [${from}, ${from + length}) is outside ${data.source.description} (${size} bytes)`,
        { details: { tensor: name } },
      );
    }
  } else {
    throw new InvalidArgumentError(
      `tensor ${JSON.stringify(name)}: data must be a Uint8Array or {source, offset, length}`,
    );
  }
}

type CheckedTensor = Omit<GgufPlannedTensor, "absoluteOffset" | "offset">;

/** Validates one tensor of the input: name, type, shape, data; `names` collects the names seen. */
function checkTensor(t: GgufWriteTensor, i: number, names: Set<string>): CheckedTensor {
  if (typeof t !== "object" || t === null) throw new InvalidArgumentError(`tensors[${i}] must be an object`);
  const { name, type, shape, data } = t;
  if (typeof name !== "string" || name.length === 0)
    throw new InvalidArgumentError(`tensors[${i}].name must be a non-empty string`);
  const tensorError = (message: string) =>
    new GgufError("MOESWARM_GGUF_BAD_TENSOR", `tensor ${JSON.stringify(name)}: ${message}`, {
      details: { tensor: name },
    });
  if (NAME_ENCODER.encode(name).byteLength >= GGML_MAX_NAME) {
    throw tensorError(`the name is longer than ${GGML_MAX_NAME - 1} bytes`);
  }
  if (names.has(name)) throw tensorError("the name appears twice");
  names.add(name);
  if (typeof type !== "number" || !isGgmlType(type))
    throw tensorError(`unknown or removed ggml type ${String(type)}`);
  if (!Array.isArray(shape) || shape.length > GGML_MAX_DIMS) {
    throw tensorError(`shape must be an array of at most ${GGML_MAX_DIMS} dimensions`);
  }
  let nElements = 1;
  for (const ne of shape) {
    if (typeof ne !== "number" || !Number.isSafeInteger(ne) || ne < 0) {
      throw tensorError(`shape entries must be non-negative integers, got ${String(ne)}`);
    }
    nElements *= ne;
  }
  if (!Number.isSafeInteger(nElements)) throw tensorError(`shape ${shape.join("x")} has too many elements`);
  const { blockSize, name: typeName } = ggmlTypeTraits(type);
  if ((shape[0] ?? 1) % blockSize !== 0) {
    throw tensorError(`ne[0] = ${shape[0] ?? 1} is not a multiple of ${typeName}'s block size ${blockSize}`);
  }
  const nbytes = ggmlTensorBytes(type, shape.length === 0 ? [1] : shape);
  checkTensorData(name, data, nbytes);
  return { name, type, shape: [...shape], nElements, nbytes, data };
}

/**
 * Computes the exact bytes of the header and the offset of every tensor, validating the input:
 * the file `ggufByteStream`/`writeGguf` produce has exactly `totalSize` bytes, so a server can
 * send `Content-Length` before reading any weight. Tensor data is not touched.
 */
export function planGguf(input: GgufWriteInput): GgufPlan {
  if (typeof input !== "object" || input === null)
    throw new InvalidArgumentError("planGguf needs {metadata, tensors}");
  const version = input.version ?? GGUF_VERSION;
  if (version !== 2 && version !== 3)
    throw new InvalidArgumentError(`version must be 2 or 3, got ${String(version)}`);
  if (!Array.isArray(input.tensors)) throw new InvalidArgumentError("tensors must be an array");

  const entries = metadataEntries(input.metadata);
  const alignment = resolveAlignment(entries, input.alignment);

  const w = new ByteBuilder();
  w.u32(GGUF_MAGIC);
  w.u32(version);
  w.u64(BigInt(input.tensors.length));
  w.u64(BigInt(entries.length));
  for (const [key, value] of entries) {
    if (typeof key !== "string" || key.length === 0)
      throw new InvalidArgumentError("metadata keys must be non-empty strings");
    w.string(key);
    writeValue(w, key, value);
  }

  const align = BigInt(alignment);
  const pad = (n: bigint) => (align - (n % align)) % align;
  const names = new Set<string>();
  const infos: Omit<GgufPlannedTensor, "absoluteOffset">[] = [];
  let offset = 0n;
  input.tensors.forEach((t, i) => {
    const { name, type, shape, nElements, nbytes, data } = checkTensor(t, i, names);
    infos.push({ name, type, shape, nElements, nbytes, offset, data });
    offset += nbytes + pad(nbytes);
  });
  for (const t of infos) {
    w.string(t.name);
    w.u32(t.shape.length);
    for (const ne of t.shape) w.u64(BigInt(ne));
    w.u32(t.type);
    w.u64(t.offset);
  }

  const header = w.result();
  const headerSize = BigInt(header.byteLength);
  const dataOffset = headerSize + pad(headerSize);
  const plan: GgufPlan = {
    version,
    metadata: new Map(entries),
    alignment,
    header,
    dataOffset,
    tensors: infos.map((t) => ({ ...t, absoluteOffset: dataOffset + t.offset })),
    totalSize: dataOffset + offset,
  };
  PLANS.add(plan);
  return plan;
}

/** A plan made by planGguf is used as is; anything else is planned (and validated) now. */
export function asPlan(input: GgufWriteInput | GgufPlan): GgufPlan {
  return PLANS.has(input) ? (input as GgufPlan) : planGguf(input as GgufWriteInput);
}

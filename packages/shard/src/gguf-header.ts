// The parsed form of a GGUF header, shared by the reader and the modules that consume it.
import type { GgmlType } from "./ggml-type.js";
import type { GgufMetadata } from "./gguf-metadata.js";

/** One tensor info of a GGUF header. */
export interface GgufTensorInfo {
  readonly name: string;
  readonly type: GgmlType;
  /** ggml's `ne`, fastest-varying first (`ne[0]` is the row length); `n_dims` entries. */
  readonly shape: readonly number[];
  readonly nElements: number;
  /** Bytes of the tensor's data (`ggml_nbytes`), without padding. */
  readonly nbytes: bigint;
  /** Offset of the data from the start of the data section, as stored in the file. */
  readonly offset: bigint;
  /** Offset of the data from the start of the file: `dataOffset + offset`. */
  readonly absoluteOffset: bigint;
}

/** A parsed GGUF header: everything before the tensor data. */
export interface GgufHeader {
  readonly version: 2 | 3;
  /** Metadata in file order, each value with its GGUF type. */
  readonly metadata: GgufMetadata;
  readonly tensors: readonly GgufTensorInfo[];
  /** `general.alignment`, or 32. */
  readonly alignment: number;
  /** Bytes from the magic to the end of the last tensor info (the header before padding). */
  readonly headerSize: number;
  /** Where the data section starts: `headerSize` rounded up to `alignment`. */
  readonly dataOffset: bigint;
  /** The data section's length as ggml computes it: the end of the furthest tensor, padded. */
  readonly dataSize: bigint;
  /** Size of the source when known. */
  readonly fileSize: bigint | undefined;
}

/** A tensor info while the reader fills in its absolute offset. */
export type MutableTensorInfo = { -readonly [K in keyof GgufTensorInfo]: GgufTensorInfo[K] };

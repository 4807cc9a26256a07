import { createHash } from "node:crypto";
import { basename } from "node:path";
import { formatRange, GgufError, type Range, toRanges } from "@moeswarm/core";
import {
  type ByteSource,
  type ExpertSlice,
  fileSource,
  GgufValueType,
  type LoadOrBuildManifestOptions,
  loadOrBuildManifest,
  readGguf,
  type SliceManifest,
  sliceExperts,
} from "@moeswarm/shard";
import { isModelId } from "./store.js";

/** One model as `GET /api/models` lists it. */
export interface ModelInfo {
  id: string;
  /** `general.name` of the file, when it has one. */
  name: string | null;
  arch: string | null;
  /** Blocks (layers) of the model; `layers=a:b` selects among 0..layers-1. */
  layers: number;
  /** The layers that have routed experts, as half-open ranges "a:b". */
  moeLayers: string[];
  /** Routed experts per layer; `experts=c:d` selects among 0..experts-1. */
  experts: number;
  /** Experts each token uses. */
  expertsUsed: number | null;
  /** Bytes of one expert of one layer (all its tensors), as a slice carries them. */
  expertBytes: number;
  /** Bytes of every routed expert of every layer. */
  expertBytesTotal: number;
  fileSize: number;
  /** sha256 of the file's header bytes: what a slice carries as `moeswarm.slice.source_sha256`. */
  headerSha256: string;
  /** Where its manifest and slices are, relative to the hub. */
  links: { manifest: string; expertShard: string };
}

/** What a model id defaults to: the file name without `.gguf`, made a valid id. */
export function defaultModelId(path: string): string {
  const stem = basename(path).replace(/\.gguf$/i, "");
  const id = stem
    .replace(/[^A-Za-z0-9._-]+/g, "-")
    .replace(/^[^A-Za-z0-9]+/, "")
    .slice(0, 128);
  return isModelId(id) ? id : "model";
}

export interface OpenModelOptions {
  signal?: AbortSignal;
  /** Where the manifest is cached (default beside the model, `<file>.manifest.json`). */
  manifestPath?: string;
  onProgress?: LoadOrBuildManifestOptions["onProgress"];
  /** Read size of the slices' streams. */
  chunkSize: number;
  /** Slices kept ready per model (their headers are planned once). */
  sliceCacheSize: number;
}

/**
 * A model the hub serves: its file open for positioned reads (one descriptor for all requests),
 * its manifest, and the slices recently asked for. The file is read through the descriptor
 * opened here, so a file replaced on disk (renamed over) keeps being served as the manifest
 * describes until the model is registered again.
 */
export class ServedModel {
  readonly manifestJson: Buffer;
  readonly manifestEtag: string;
  readonly info: ModelInfo;
  readonly #slices = new Map<string, Promise<ExpertSlice>>();
  #refs = 0;
  #retired = false;
  #closing: Promise<void> | undefined;

  private constructor(
    readonly id: string,
    readonly path: string,
    readonly source: ByteSource,
    readonly manifest: SliceManifest,
    readonly generalName: string | null,
    readonly options: OpenModelOptions,
  ) {
    this.manifestJson = Buffer.from(`${JSON.stringify(manifest)}\n`);
    this.manifestEtag = `"${createHash("sha256").update(this.manifestJson).digest("base64url")}"`;
    const layers = manifest.layers;
    const first = layers[0];
    const enc = encodeURIComponent(id);
    this.info = {
      id,
      name: generalName,
      arch: manifest.source.arch,
      layers: this.layerCount,
      moeLayers: toRanges(layers.map((l) => l.layer)).map(formatRange),
      experts: this.expertCount,
      expertsUsed: manifest.expertUsedCount,
      expertBytes: first?.bytesPerExpert ?? 0,
      expertBytesTotal: layers.reduce((n, l) => n + l.bytesPerExpert * l.nExpert, 0),
      fileSize: manifest.source.size,
      headerSha256: manifest.source.headerSha256,
      links: {
        manifest: `/api/models/${enc}/manifest`,
        expertShard: `/api/models/${enc}/expert-shard`,
      },
    };
  }

  /** Opens `path`, loads (or builds and caches) its manifest and checks the two agree. */
  static async open(id: string, path: string, options: OpenModelOptions): Promise<ServedModel> {
    const { manifest } = await loadOrBuildManifest(path, {
      signal: options.signal,
      manifestPath: options.manifestPath,
      onProgress: options.onProgress,
    });
    const source = await fileSource(path, { signal: options.signal });
    try {
      // the manifest may come from a cache: check it describes the bytes behind this descriptor
      const header = await readGguf(source, { signal: options.signal });
      const hash = createHash("sha256");
      const step = 1 << 20;
      for (let at = 0; at < header.headerSize; at += step) {
        hash.update(
          await source.read(at, Math.min(step, header.headerSize - at), { signal: options.signal }),
        );
      }
      if (
        hash.digest("hex") !== manifest.source.headerSha256 ||
        source.size !== BigInt(manifest.source.size)
      ) {
        throw new GgufError(
          "MOESWARM_SLICE_MISMATCH",
          `${path} changed while its manifest was being loaded; register it again`,
        );
      }
      const nameValue = header.metadata.get("general.name");
      const generalName = nameValue?.type === GgufValueType.STRING ? nameValue.value : null;
      return new ServedModel(id, path, source, manifest, generalName, options);
    } catch (error) {
      await source.close();
      throw error;
    }
  }

  /** Blocks of the model (the bound of `layers=`). */
  get layerCount(): number {
    const m = this.manifest;
    return m.blockCount ?? Math.max(0, ...m.layers.map((l) => l.layer + 1));
  }

  /** Routed experts per layer (the bound of `experts=`). */
  get expertCount(): number {
    const m = this.manifest;
    return m.expertCount ?? Math.max(0, ...m.layers.map((l) => l.nExpert));
  }

  /** Takes a reference for one request; false once the model is retired. */
  acquire(): boolean {
    if (this.#retired) return false;
    this.#refs++;
    return true;
  }

  release(): void {
    this.#refs--;
    if (this.#retired && this.#refs === 0) void this.#close();
  }

  /** Stops new requests; the file is closed once the last one finished. */
  retire(): Promise<void> {
    this.#retired = true;
    return this.#refs === 0 ? this.#close() : Promise.resolve();
  }

  /** Closes the file now (the hub is shutting down and its requests were cut). */
  close(): Promise<void> {
    this.#retired = true;
    return this.#close();
  }

  #close(): Promise<void> {
    this.#closing ??= (async () => {
      this.#slices.clear();
      await this.source.close();
    })();
    return this.#closing;
  }

  /**
   * The slice of `layers` x `experts`, planned once and kept (a bounded LRU): its header is built
   * from the manifest, so nothing but the GGUF header is read before streaming.
   */
  slice(layers: Range, experts: Range): Promise<ExpertSlice> {
    const key = `${formatRange(layers)}/${formatRange(experts)}`;
    const hit = this.#slices.get(key);
    if (hit) {
      this.#slices.delete(key);
      this.#slices.set(key, hit);
      return hit;
    }
    const made = sliceExperts(this.source, {
      layers,
      experts,
      manifest: this.manifest,
      chunkSize: this.options.chunkSize,
      // no request's signal: the promise is shared by every request for this slice
    });
    this.#slices.set(key, made);
    made.catch(() => {
      if (this.#slices.get(key) === made) this.#slices.delete(key);
    });
    while (this.#slices.size > this.options.sliceCacheSize) {
      const oldest = this.#slices.keys().next().value as string;
      this.#slices.delete(oldest);
    }
    return made;
  }
}

/**
 * The strong ETag of a slice: a hash of the source's header sha256, the normalised query and the
 * slice's own header bytes (which carry every slab's sha256 from the manifest). The same file and
 * query give the same tag across restarts and hubs; any change of the bytes served changes it.
 */
export function sliceEtag(headerSha256: string, query: string, slice: ExpertSlice): string {
  const h = createHash("sha256")
    .update("moeswarm-expert-shard/1\n")
    .update(`${headerSha256}\n${query}\n`)
    .update(slice.plan.header)
    .digest("base64url");
  return `"${h}"`;
}

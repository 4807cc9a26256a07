// The hub's served models: loading the configured and stored ones at start, registering and
// removing them at run time, and keeping the market's view of each in step.
import { mkdir, realpath, stat } from "node:fs/promises";
import { isAbsolute, relative, resolve, sep } from "node:path";
import { GgufError, HubError, isMoeswarmError } from "@moeswarm/core";
import { badRequest, notFound } from "./http-errors.js";
import type { Settings } from "./hub-options.js";
import type { HubEvent } from "./hub-types.js";
import type { MarketModel } from "./market.js";
import type { MarketBook } from "./market-book.js";
import type { HubMetrics } from "./metrics.js";
import { type ModelInfo, ServedModel } from "./model.js";
import { type HubStore, isModelId } from "./store.js";

const noop = () => {};

export interface ModelRegistryOptions {
  settings: Settings;
  store: HubStore;
  marketBook: MarketBook;
  metrics: HubMetrics;
  emit(event: HubEvent): void;
  /** True once the hub began to close: nothing loaded after that is served. */
  closing(): boolean;
}

export class ModelRegistry {
  readonly #o: ModelRegistryOptions;
  readonly #models = new Map<string, ServedModel>();
  /** Ids being loaded by POST /api/models (a second request for the same id waits for the first). */
  readonly #loading = new Map<string, Promise<ServedModel>>();
  readonly #loadAbort = new AbortController();

  constructor(options: ModelRegistryOptions) {
    this.#o = options;
  }

  get size(): number {
    return this.#models.size;
  }

  /** The served model `id`; HubError MOESWARM_HUB_NOT_FOUND otherwise. */
  get(id: string): ServedModel {
    const model = isModelId(id) ? this.#models.get(id) : undefined;
    if (!model) throw notFound(`no model ${JSON.stringify(id)} on this hub`);
    return model;
  }

  /** The served model `id`, or undefined (no error). */
  find(id: string): ServedModel | undefined {
    return this.#models.get(id);
  }

  list(): ModelInfo[] {
    return [...this.#models.values()].map((m) => structuredClone(m.info));
  }

  /** The market's view of the served model `id`; HubError MOESWARM_HUB_NOT_FOUND otherwise. */
  marketModel(id: string): MarketModel {
    const model = this.get(id);
    return marketModelOf(model.id, model);
  }

  /** Creates the manifest directory (before anything loads). */
  async prepare(): Promise<void> {
    const { manifestDir } = this.#o.settings;
    if (manifestDir !== undefined) {
      try {
        await mkdir(manifestDir, { recursive: true });
      } catch (error) {
        throw new HubError(
          "MOESWARM_HUB_INTERNAL",
          `cannot create the manifest directory: ${(error as Error).message}`,
          { cause: error },
        );
      }
    }
  }

  /** Loads what the hub serves from the start: the configured models (which fail the start), then the stored ones. */
  async load(configured: ReadonlyArray<{ id: string; path: string }>): Promise<void> {
    // configured models fail the start; a stored one that no longer loads is reported and skipped
    for (const { id, path } of configured) {
      const model = await this.#open(id, path);
      if (this.#o.closing()) {
        await model.close();
        return;
      }
      this.#serve(id, model);
    }
    for (const stored of await this.#o.store.listModels()) {
      if (this.#models.has(stored.id) || !isModelId(stored.id)) continue;
      try {
        const model = await this.#open(stored.id, stored.path);
        if (this.#o.closing()) {
          await model.close();
          return;
        }
        this.#serve(stored.id, model);
      } catch (error) {
        if (this.#o.closing()) return;
        this.#o.emit({ type: "model-unavailable", id: stored.id, path: stored.path, error });
      }
    }
  }

  /**
   * Serves the file `file` (a real path inside the model directory) as `id` and stores the
   * registration; `created` is false when it was served already. `asked` is the path as the
   * client gave it (for messages).
   */
  async register(id: string, file: string, asked: string): Promise<{ model: ServedModel; created: boolean }> {
    const existing = this.#models.get(id);
    if (existing) {
      if (existing.path !== file) {
        throw new HubError("MOESWARM_HUB_CONFLICT", `model id ${id} is taken by another file`, {
          details: { id },
        });
      }
      return { model: existing, created: false };
    }
    let loading = this.#loading.get(id);
    if (!loading) {
      loading = this.#open(id, file);
      this.#loading.set(id, loading);
      void loading.catch(noop).finally(() => {
        if (this.#loading.get(id) === loading) this.#loading.delete(id);
      });
    }
    let model: ServedModel;
    try {
      model = await loading;
    } catch (error) {
      if (isMoeswarmError(error) && error instanceof GgufError && error.code !== "MOESWARM_GGUF_IO") {
        throw badRequest(`${asked} cannot be served: ${error.message}`, { cause: error.code });
      }
      throw error;
    }
    if (this.#models.get(id) === model) return { model, created: false };
    if (this.#models.has(id) || this.#o.closing()) {
      await model.close();
      throw new HubError("MOESWARM_HUB_CONFLICT", `model id ${id} was registered meanwhile`, {
        details: { id },
      });
    }
    try {
      await this.#o.store.putModel({ id, path: file, addedAt: Date.now() });
    } catch (error) {
      await model.close();
      this.#o.metrics.storeError();
      throw isMoeswarmError(error)
        ? error
        : new HubError("MOESWARM_HUB_STORE", String(error), { cause: error });
    }
    this.#serve(id, model);
    return { model, created: true };
  }

  /** Forgets the registration of `id` and retires the model once its downloads end. */
  async remove(id: string): Promise<void> {
    const model = this.get(id);
    await this.#o.store.deleteModel(id);
    this.#models.delete(id);
    this.#o.marketBook.removeModel(id);
    await model.retire();
    this.#o.emit({ type: "model-removed", id });
  }

  /** Stops loads in flight (the hub is closing). */
  abortLoads(): void {
    this.#loadAbort.abort(new HubError("MOESWARM_HUB_NOT_FOUND", "the hub is shutting down"));
  }

  /** The loads of POST /api/models still in flight. */
  pending(): Promise<ServedModel>[] {
    return [...this.#loading.values()];
  }

  async closeAll(): Promise<void> {
    await Promise.allSettled([...this.#models.values()].map((m) => m.close()));
    this.#models.clear();
  }

  /** Serves a loaded model: the API lists it, the market tracks its coverage. */
  #serve(id: string, model: ServedModel): void {
    this.#models.set(id, model);
    this.#o.marketBook.addModel(marketModelOf(id, model));
  }

  #open(id: string, path: string): Promise<ServedModel> {
    const { settings, emit } = this.#o;
    const started = performance.now();
    emit({ type: "model-loading", id, path });
    return ServedModel.open(id, path, {
      signal: this.#loadAbort.signal,
      manifestPath:
        settings.manifestDir === undefined ? undefined : resolve(settings.manifestDir, `${id}.manifest.json`),
      chunkSize: settings.chunkSize,
      sliceCacheSize: settings.sliceCacheSize,
      onProgress: ({ bytesDone, bytesTotal }) => emit({ type: "model-progress", id, bytesDone, bytesTotal }),
    }).then((model) => {
      emit({ type: "model-ready", id, path, ms: performance.now() - started });
      return model;
    });
  }
}

/** The market's view of a served model: its MoE layers with their expert count and size. */
function marketModelOf(id: string, model: ServedModel): MarketModel {
  return {
    id,
    layers: [...model.manifest.layers]
      .sort((a, b) => a.layer - b.layer)
      .map((l) => ({ layer: l.layer, nExpert: l.nExpert, bytesPerExpert: l.bytesPerExpert })),
  };
}

/**
 * The real path of `path` (relative to `dir`, or absolute), refused unless it is a regular file
 * inside `dir` once every symbolic link is resolved.
 */
export async function resolveInside(dir: string, path: string): Promise<string> {
  const outside = () => badRequest(`"path" must name a file inside the model directory`, { path });
  let root: string;
  try {
    root = await realpath(dir);
  } catch (error) {
    throw new HubError("MOESWARM_HUB_INTERNAL", `the model directory is not readable`, { cause: error });
  }
  let real: string;
  try {
    real = await realpath(resolve(root, path));
  } catch {
    // does not exist: say so only for paths that would have been inside
    const rel = relative(root, resolve(root, path));
    if (rel.startsWith("..") || isAbsolute(rel)) throw outside();
    throw notFound(`no file ${JSON.stringify(path)} in the model directory`);
  }
  const rel = relative(root, real);
  if (rel === "" || rel.startsWith(`..${sep}`) || rel === ".." || isAbsolute(rel)) throw outside();
  const st = await stat(real);
  if (!st.isFile()) throw badRequest(`${JSON.stringify(path)} is not a file`);
  return real;
}

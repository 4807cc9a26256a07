import { HubError } from "@moeswarm/core";

/**
 * What the hub keeps across restarts. Asynchronous so that a server database can stand in for
 * the embedded SQLite one; a store's methods may throw HubError MOESWARM_HUB_STORE.
 *
 * Issue 7 grows it (demand counters, claims with leases, credits) by new methods and, for SQLite,
 * new schema versions; what is here does not change meaning.
 */
export interface HubStore extends AsyncDisposable {
  /** "memory", "sqlite", or an embedder's own name (for logs and /metrics). */
  readonly kind: string;
  /** Models registered at run time (POST /api/models), oldest first. */
  listModels(): Promise<StoredModel[]>;
  /** Adds or replaces (by id) a model. */
  putModel(model: StoredModel): Promise<void>;
  deleteModel(id: string): Promise<boolean>;
  /** Every worker the relay has seen and not forgotten, ordered by id. */
  listWorkers(): Promise<StoredWorker[]>;
  /** Adds or replaces workers (with their slices), in one transaction. */
  putWorkers(workers: readonly StoredWorker[]): Promise<void>;
  /** Forgets workers last seen before `before` (unix ms); returns how many. */
  deleteWorkersSeenBefore(before: number): Promise<number>;
  close(): Promise<void>;
}

export interface StoredModel {
  /** The model id (see `isModelId`). */
  readonly id: string;
  /** Absolute path of the GGUF file. */
  readonly path: string;
  /** Unix ms. */
  readonly addedAt: number;
}

/** A slice a worker registered: one model's layers and global expert ids, ascending. */
export interface StoredSlice {
  readonly model: string;
  readonly layers: readonly number[];
  readonly experts: readonly number[];
  readonly capacity?: number;
  readonly backend?: string;
  /** Unix ms of the register frame. */
  readonly registeredAt: number;
}

export interface StoredWorker {
  readonly id: string;
  /** Unix ms. */
  readonly firstSeen: number;
  readonly lastSeen: number;
  /** Connected to this hub's relay when last written (false for every worker after a restart). */
  readonly connected: boolean;
  readonly draining: boolean;
  readonly slices: readonly StoredSlice[];
}

const MODEL_ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

/**
 * Model ids are names, never paths: 1..128 characters of `A-Z a-z 0-9 . _ -`, starting with a
 * letter or digit (so `.`, `..` and anything with a slash are not ids).
 */
export function isModelId(value: unknown): value is string {
  return typeof value === "string" && MODEL_ID.test(value);
}

function copyWorker(w: StoredWorker): StoredWorker {
  return {
    ...w,
    slices: w.slices.map((s) => ({ ...s, layers: [...s.layers], experts: [...s.experts] })),
  };
}

/** A store in this process's memory: for tests, and embedders that persist elsewhere. */
export function createMemoryStore(): HubStore {
  const models = new Map<string, StoredModel>();
  const workers = new Map<string, StoredWorker>();
  let closed = false;
  const open = () => {
    if (closed) throw new HubError("MOESWARM_HUB_STORE", "the hub store is closed");
  };
  const store: HubStore = {
    kind: "memory",
    async listModels() {
      open();
      return [...models.values()].map((m) => ({ ...m }));
    },
    async putModel(model) {
      open();
      models.delete(model.id); // re-inserted last: the order is the order of registration
      models.set(model.id, { ...model });
    },
    async deleteModel(id) {
      open();
      return models.delete(id);
    },
    async listWorkers() {
      open();
      return [...workers.values()].sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0)).map(copyWorker);
    },
    async putWorkers(list) {
      open();
      for (const w of list) workers.set(w.id, copyWorker(w));
    },
    async deleteWorkersSeenBefore(before) {
      open();
      let n = 0;
      for (const [id, w] of workers) {
        if (w.lastSeen < before) {
          workers.delete(id);
          n++;
        }
      }
      return n;
    },
    async close() {
      closed = true;
    },
    [Symbol.asyncDispose]() {
      return store.close();
    },
  };
  return store;
}

import { HubError } from "@moeswarm/core";
import type { CreditRow, Lease, StoredDemandRow } from "./market.js";

/**
 * What the hub keeps across restarts. Asynchronous so that a server database can stand in for
 * the embedded SQLite one; a store's methods may throw HubError MOESWARM_HUB_STORE.
 *
 * The coverage market keeps its leases, demand counters and credits here too (SQLite schema
 * version 2).
 */
export interface HubStore extends AsyncDisposable {
  /** "memory", "sqlite", or an embedder's own name (for logs and /metrics). */
  readonly kind: string;
  /** For "sqlite": the driver it runs on ("better-sqlite3", "node:sqlite", "node-sqlite3-wasm"). */
  readonly driver?: string;
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
  /** Active leases (claims granted, not yet fulfilled, released or expired), by id. */
  listLeases(): Promise<StoredLease[]>;
  /**
   * Adds or replaces leases (by id), and writes `also` (leases ended, credits, demand) in the
   * same transaction: what the market changed with them is on disk together or not at all, and
   * before the change is answered. Puts come before the deletes.
   */
  putLeases(leases: readonly StoredLease[], also?: MarketWrite): Promise<void>;
  /** Deletes leases by id; returns how many existed. */
  deleteLeases(ids: readonly string[]): Promise<number>;
  /** Demand counters, by model then layer. */
  listDemand(): Promise<StoredDemandRow[]>;
  /** Adds or replaces demand rows (by model and layer), in one transaction. */
  putDemand(rows: readonly StoredDemandRow[]): Promise<void>;
  /** Deletes a model's demand counters; returns how many rows. */
  deleteDemand(model: string): Promise<number>;
  /** Credits (expert-tokens served), by worker then model. */
  listCredits(): Promise<StoredCredit[]>;
  /** Adds or replaces credit rows (absolute totals, by worker and model), in one transaction. */
  putCredits(rows: readonly StoredCredit[]): Promise<void>;
  close(): Promise<void>;
}

/** What the market changed beside its leases, written with them (see `putLeases`). */
export interface MarketWrite {
  /** Leases that ended (released, replaced, fulfilled, expired), by id. */
  readonly deleteLeases?: readonly string[];
  /** Credit rows (absolute totals, by worker and model). */
  readonly credits?: readonly StoredCredit[];
  /** Demand rows (by model and layer). */
  readonly demand?: readonly StoredDemandRow[];
}

/** A lease as the store keeps it (see `Lease` of the market). */
export type StoredLease = Lease;

/** Expert-tokens a worker served for a model, in all. */
export type StoredCredit = CreditRow;

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

const byIds = (a: string, b: string) => (a < b ? -1 : a > b ? 1 : 0);

function copyLease(l: StoredLease): StoredLease {
  return { ...l, layers: { ...l.layers }, experts: { ...l.experts }, capacity: { ...l.capacity } };
}

function copyDemand(d: StoredDemandRow): StoredDemandRow {
  return { ...d, counts: d.counts.slice() };
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
  const leases = new Map<string, StoredLease>();
  const demand = new Map<string, StoredDemandRow>();
  const credits = new Map<string, StoredCredit>();
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
    async listLeases() {
      open();
      return [...leases.values()].sort((a, b) => byIds(a.id, b.id)).map(copyLease);
    },
    async putLeases(list, also = {}) {
      open();
      for (const l of list) leases.set(l.id, copyLease(l));
      for (const id of also.deleteLeases ?? []) leases.delete(id);
      for (const c of also.credits ?? []) credits.set(`${c.worker}\0${c.model}`, { ...c });
      for (const d of also.demand ?? []) demand.set(`${d.model}\0${d.layer}`, copyDemand(d));
    },
    async deleteLeases(ids) {
      open();
      let n = 0;
      for (const id of ids) if (leases.delete(id)) n++;
      return n;
    },
    async listDemand() {
      open();
      return [...demand.values()]
        .sort((a, b) => byIds(a.model, b.model) || a.layer - b.layer)
        .map(copyDemand);
    },
    async putDemand(rows) {
      open();
      for (const d of rows) demand.set(`${d.model}\0${d.layer}`, copyDemand(d));
    },
    async deleteDemand(model) {
      open();
      let n = 0;
      for (const [key, d] of demand) {
        if (d.model === model) {
          demand.delete(key);
          n++;
        }
      }
      return n;
    },
    async listCredits() {
      open();
      return [...credits.values()]
        .sort((a, b) => byIds(a.worker, b.worker) || byIds(a.model, b.model))
        .map((c) => ({ ...c }));
    },
    async putCredits(rows) {
      open();
      for (const c of rows) credits.set(`${c.worker}\0${c.model}`, { ...c });
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

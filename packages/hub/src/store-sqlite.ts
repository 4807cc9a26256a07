import { mkdirSync } from "node:fs";
import { dirname } from "node:path";
import {
  errorFromSystemError,
  formatRange,
  HubError,
  InvalidArgumentError,
  IoError,
  type MoeswarmError,
  parseRange,
  toRanges,
} from "@moeswarm/core";
import type { StoredDemandRow } from "./market.js";
import {
  loadSqliteDriver,
  SQLITE_DRIVERS,
  type SqliteDatabase,
  type SqliteDriver,
  type SqliteDriverName,
  sqliteDriverNamed,
} from "./sqlite-driver.js";
import type {
  HubStore,
  MarketWrite,
  StoredCredit,
  StoredLease,
  StoredModel,
  StoredSlice,
  StoredWorker,
} from "./store.js";

/*
 * Schema versions, applied in order inside one transaction each; `PRAGMA user_version` records
 * the last one applied. Never edit a published step: add the next one. A database written by a
 * newer hub (user_version beyond this list) is refused rather than guessed at.
 *
 * Version 2 holds the coverage market: demand counters (one row per model and MoE layer: the
 * instant they refer to and one little-endian f64 per expert), active leases, and credits
 * (expert-tokens served per worker and model), keyed by the worker and model ids used here.
 *
 * Version 3 lets a worker keep several slices of one model (each register frame adds one): the
 * slices' key becomes (worker, model, layers, experts), with their registration order.
 *
 * Version 4 keeps the last stats report seq per backbone and model, written with the credits.
 *
 * Version 5 keeps a lease's owner (the claimant's principal), so that after a restart a cell leased
 * to one worker of an owner is still refused to its other workers (NULL: the claim named none).
 */
const MIGRATIONS: readonly string[] = [
  // 1: models registered at run time, workers and the slices they registered
  `CREATE TABLE models (
     id       TEXT PRIMARY KEY,
     path     TEXT NOT NULL,
     added_at INTEGER NOT NULL
   ) STRICT;
   CREATE TABLE workers (
     id         TEXT PRIMARY KEY,
     first_seen INTEGER NOT NULL,
     last_seen  INTEGER NOT NULL,
     connected  INTEGER NOT NULL DEFAULT 0,
     draining   INTEGER NOT NULL DEFAULT 0
   ) STRICT;
   CREATE INDEX workers_last_seen ON workers (last_seen);
   CREATE TABLE worker_slices (
     worker        TEXT NOT NULL REFERENCES workers (id) ON DELETE CASCADE,
     model         TEXT NOT NULL,
     layers        TEXT NOT NULL,  -- half-open ranges "a:b,c:d"
     experts       TEXT NOT NULL,
     capacity      INTEGER,
     backend       TEXT,
     registered_at INTEGER NOT NULL,
     PRIMARY KEY (worker, model)
   ) STRICT;`,
  // 2: the coverage market
  `CREATE TABLE demand (
     model  TEXT NOT NULL,
     layer  INTEGER NOT NULL,
     at     REAL NOT NULL,     -- unix ms the counts refer to
     counts BLOB NOT NULL,     -- f64 little-endian, one per expert
     PRIMARY KEY (model, layer)
   ) STRICT;
   CREATE TABLE leases (
     id         TEXT PRIMARY KEY,
     worker     TEXT NOT NULL,
     model      TEXT NOT NULL,
     layers     TEXT NOT NULL,  -- half-open range "a:b"
     experts    TEXT NOT NULL,
     bytes      INTEGER NOT NULL,
     granted_at REAL NOT NULL,
     expires_at REAL NOT NULL,
     capacity   TEXT NOT NULL   -- JSON
   ) STRICT;
   CREATE INDEX leases_worker ON leases (worker, model);
   CREATE TABLE credits (
     worker        TEXT NOT NULL,
     model         TEXT NOT NULL,
     expert_tokens INTEGER NOT NULL,
     updated_at    REAL NOT NULL,
     PRIMARY KEY (worker, model)
   ) STRICT;`,
  // 3: several slices per worker and model
  `CREATE TABLE worker_slices_v3 (
     worker        TEXT NOT NULL REFERENCES workers (id) ON DELETE CASCADE,
     model         TEXT NOT NULL,
     layers        TEXT NOT NULL,  -- half-open ranges "a:b,c:d"
     experts       TEXT NOT NULL,
     capacity      INTEGER,
     backend       TEXT,
     registered_at INTEGER NOT NULL,
     position      INTEGER NOT NULL DEFAULT 0,  -- registration order among the worker's slices
     PRIMARY KEY (worker, model, layers, experts)
   ) STRICT;
   INSERT INTO worker_slices_v3 (worker, model, layers, experts, capacity, backend, registered_at, position)
     SELECT worker, model, layers, experts, capacity, backend, registered_at, 0 FROM worker_slices;
   DROP TABLE worker_slices;
   ALTER TABLE worker_slices_v3 RENAME TO worker_slices;`,
  // 4: the last stats report seq per backbone and model (retries stay duplicates across a restart)
  `CREATE TABLE stats_seq (
     backbone TEXT NOT NULL,
     model    TEXT NOT NULL,
     seq      INTEGER NOT NULL,
     PRIMARY KEY (backbone, model)
   ) STRICT;`,
  // 5: a lease's owner (its claimant's principal, when the claim named one)
  "ALTER TABLE leases ADD COLUMN owner TEXT;",
];

/** The schema version this hub writes. */
export const SQLITE_SCHEMA_VERSION = MIGRATIONS.length;

// SQLite's own codes for what the disk did (better-sqlite3 puts them in `code`)
const SQLITE_IO: ReadonlyArray<[RegExp, IoError["code"]]> = [
  [/^SQLITE_FULL/, "MOESWARM_IO_NO_SPACE"],
  [/^SQLITE_(READONLY|PERM|AUTH)/, "MOESWARM_IO_ACCESS"],
  [/^SQLITE_(IOERR|CANTOPEN)/, "MOESWARM_IO_FAILED"],
];

/** The local I/O failure under a store error (a full disk, a read-only file), if that is what it was. */
function ioErrorOf(what: string, error: unknown): MoeswarmError | undefined {
  const code = (error as { code?: unknown } | null)?.code;
  if (typeof code !== "string") return undefined;
  if (/^E[A-Z]+$/.test(code)) return errorFromSystemError(error, what);
  const io = SQLITE_IO.find(([pattern]) => pattern.test(code));
  return (
    io && new IoError(io[1], `${what}: ${(error as Error).message}`, { cause: error, details: { code } })
  );
}

/**
 * HubError MOESWARM_HUB_STORE (what callers of a store handle); when the disk was the trouble,
 * its IoError code (MOESWARM_IO_NO_SPACE...) is in the message and `details.io`, and the IoError
 * is the cause.
 */
function storeError(what: string, error: unknown): HubError {
  const message = `${what}: ${(error as Error)?.message ?? String(error)}`;
  const io = ioErrorOf(what, error);
  return new HubError("MOESWARM_HUB_STORE", io ? `${message} (${io.code})` : message, {
    cause: io ?? error,
    ...(io ? { details: { io: io.code } } : {}),
  });
}

/** `[0,1,2,5]` as "0:3,5:6", the compact form the tables keep. */
function packIndices(values: readonly number[]): string {
  return toRanges(values).map(formatRange).join(",");
}

function unpackIndices(text: string): number[] {
  if (text === "") return [];
  const out: number[] = [];
  for (const part of text.split(",")) {
    const r = parseRange(part);
    for (let i = r.start; i < r.end; i++) out.push(i);
  }
  return out;
}

interface ModelRow {
  id: string;
  path: string;
  added_at: number;
}
interface WorkerRow {
  id: string;
  first_seen: number;
  last_seen: number;
  connected: number;
  draining: number;
}
interface SliceRow {
  worker: string;
  model: string;
  layers: string;
  experts: string;
  capacity: number | null;
  backend: string | null;
  registered_at: number;
}

interface LeaseRow {
  id: string;
  worker: string;
  model: string;
  layers: string;
  experts: string;
  bytes: number;
  granted_at: number;
  expires_at: number;
  capacity: string;
  owner: string | null;
}
interface DemandRow {
  model: string;
  layer: number;
  at: number;
  counts: Buffer;
}
interface CreditTableRow {
  worker: string;
  model: string;
  expert_tokens: number;
  updated_at: number;
}

function countsToBlob(counts: Float64Array): Buffer {
  const b = Buffer.alloc(counts.length * 8);
  for (let i = 0; i < counts.length; i++) b.writeDoubleLE(counts[i] as number, i * 8);
  return b;
}

function blobToCounts(blob: Buffer): Float64Array {
  const out = new Float64Array(Math.floor(blob.byteLength / 8));
  for (let i = 0; i < out.length; i++) out[i] = blob.readDoubleLE(i * 8);
  return out;
}

function capacityOf(text: string): StoredLease["capacity"] {
  try {
    const v = JSON.parse(text) as unknown;
    return typeof v === "object" && v !== null && !Array.isArray(v) ? (v as StoredLease["capacity"]) : {};
  } catch {
    return {};
  }
}

/** The drivers `options` allow, in the order they are tried. */
function driversOf(options: SqliteStoreOptions): readonly SqliteDriver[] {
  if (options.drivers !== undefined) return options.drivers;
  const name = options.driver ?? "auto";
  if (name === "auto") return SQLITE_DRIVERS;
  const driver = sqliteDriverNamed(name);
  if (!driver) {
    throw new InvalidArgumentError(
      `sqliteDriver must be "auto" or one of ${SQLITE_DRIVERS.map((d) => d.name).join(", ")}; got ${JSON.stringify(name)}`,
    );
  }
  return [driver];
}

function openDatabase(path: string, options: SqliteStoreOptions): SqliteDatabase {
  // MOESWARM_HUB_NO_SQLITE (no driver loads) goes to the caller as it is
  const { open } = loadSqliteDriver(driversOf(options));
  try {
    if (path !== ":memory:") mkdirSync(dirname(path), { recursive: true });
    return open(path);
  } catch (error) {
    if (error instanceof HubError) throw error; // the WASM driver: another process holds the file
    throw storeError(`cannot open the SQLite store ${path}`, error);
  }
}

/** Applies the pending migrations; returns the schema version now in force. */
function migrate(db: SqliteDatabase, path: string): number {
  const current = db.pragma("user_version", { simple: true }) as number;
  if (current > MIGRATIONS.length) {
    throw new HubError(
      "MOESWARM_HUB_STORE",
      `${path} has schema version ${current}, written by a newer hub (this one knows ${MIGRATIONS.length})`,
      { details: { version: current, known: MIGRATIONS.length } },
    );
  }
  for (let v = current; v < MIGRATIONS.length; v++) {
    db.transaction(() => {
      db.exec(MIGRATIONS[v] as string);
      db.pragma(`user_version = ${v + 1}`);
    }).immediate();
  }
  return MIGRATIONS.length;
}

export interface SqliteStoreOptions {
  /** How long a write waits for another process's lock (default 5000 ms). */
  busyTimeoutMs?: number;
  /**
   * Which SQLite driver (sqlite-driver.ts): "auto" (default) tries better-sqlite3, then Node's
   * built-in node:sqlite (Node 22.5+), then node-sqlite3-wasm; a name uses only that one.
   */
  driver?: "auto" | SqliteDriverName;
  /** Drivers to try instead, in order (tests; embedders with a driver of their own). */
  drivers?: readonly SqliteDriver[];
}

/**
 * The embedded store: one SQLite file (created with its directory when missing), WAL journal,
 * schema versions applied at open (`user_version`). `":memory:"` keeps it in memory. Throws
 * HubError MOESWARM_HUB_STORE when the file cannot be opened, is not a database, or was written
 * by a newer hub.
 */
export function openSqliteStore(path: string, options: SqliteStoreOptions = {}): HubStore {
  if (typeof path !== "string" || path.length === 0) {
    throw new InvalidArgumentError("openSqliteStore needs a file path");
  }
  const busy = options.busyTimeoutMs ?? 5000;
  if (!Number.isInteger(busy) || busy < 0) {
    throw new InvalidArgumentError("busyTimeoutMs must be an integer >= 0");
  }
  const db = openConfigured(path, busy, options);

  const q = prepareStatements(db);
  const tx = writeTransactions(db, q);

  let closed = false;
  // better-sqlite3 is synchronous: each call runs to completion before the promise settles
  const run = async <T>(what: string, fn: () => T): Promise<T> => {
    if (closed) throw new HubError("MOESWARM_HUB_STORE", "the hub store is closed");
    try {
      return fn();
    } catch (error) {
      throw storeError(what, error);
    }
  };

  const store: HubStore = {
    kind: "sqlite",
    driver: db.driver,
    listModels: () =>
      run("listing models", () =>
        q.models.all().map((r): StoredModel => ({ id: r.id, path: r.path, addedAt: r.added_at })),
      ),
    putModel: (m) =>
      run("storing a model", () => {
        q.putModel.run(m.id, m.path, m.addedAt);
      }),
    deleteModel: (id) => run("deleting a model", () => q.deleteModel.run(id).changes > 0),
    listWorkers: () => run("listing workers", () => workersOf(q)),
    putWorkers: (list) =>
      run("storing workers", () => {
        tx.putWorkers.immediate(list);
      }),
    deleteWorkersSeenBefore: (before) =>
      run("forgetting workers", () => q.forget.run(Math.floor(before)).changes),
    listLeases: () => run("listing leases", () => q.leases.all().map(leaseOfRow)),
    putLeases: (list, also = {}) =>
      run("storing leases", () => {
        tx.putLeases.immediate(list, also);
      }),
    deleteLeases: (ids) => run("deleting leases", () => tx.deleteLeases.immediate(ids)),
    listDemand: () =>
      run("listing demand", () =>
        q.demand.all().map(
          (r): StoredDemandRow => ({
            model: r.model,
            layer: r.layer,
            at: r.at,
            counts: blobToCounts(r.counts),
          }),
        ),
      ),
    putDemand: (rows) =>
      run("storing demand", () => {
        tx.putDemand.immediate(rows);
      }),
    deleteDemand: (model) => run("deleting demand", () => q.deleteDemand.run(model).changes),
    listCredits: () =>
      run("listing credits", () =>
        q.credits.all().map(
          (r): StoredCredit => ({
            worker: r.worker,
            model: r.model,
            expertTokens: r.expert_tokens,
            updatedAt: r.updated_at,
          }),
        ),
      ),
    putCredits: (rows) =>
      run("storing credits", () => {
        tx.putCredits.immediate(rows);
      }),
    listStatsSeqs: () => run("listing stats seqs", () => q.statsSeqs.all()),
    async close() {
      if (closed) return;
      closed = true;
      db.close();
    },
    [Symbol.asyncDispose]() {
      return store.close();
    },
  };
  return store;
}

/** The statements the store runs, prepared once. */
function prepareStatements(db: SqliteDatabase) {
  return {
    models: db.prepare<[], ModelRow>("SELECT id, path, added_at FROM models ORDER BY added_at, rowid"),
    putModel: db.prepare<[string, string, number]>(
      "INSERT INTO models (id, path, added_at) VALUES (?, ?, ?) ON CONFLICT (id) DO UPDATE SET path = excluded.path, added_at = excluded.added_at",
    ),
    deleteModel: db.prepare<[string]>("DELETE FROM models WHERE id = ?"),
    workers: db.prepare<[], WorkerRow>(
      "SELECT id, first_seen, last_seen, connected, draining FROM workers ORDER BY id",
    ),
    slices: db.prepare<[], SliceRow>(
      "SELECT worker, model, layers, experts, capacity, backend, registered_at FROM worker_slices ORDER BY worker, position, model, layers, experts",
    ),
    putWorker: db.prepare<[string, number, number, number, number]>(
      `INSERT INTO workers (id, first_seen, last_seen, connected, draining) VALUES (?, ?, ?, ?, ?)
       ON CONFLICT (id) DO UPDATE SET first_seen = excluded.first_seen, last_seen = excluded.last_seen,
         connected = excluded.connected, draining = excluded.draining`,
    ),
    clearSlices: db.prepare<[string]>("DELETE FROM worker_slices WHERE worker = ?"),
    // OR REPLACE: two slices whose ids pack to the same ranges are one slice
    putSlice: db.prepare<[string, string, string, string, number | null, string | null, number, number]>(
      "INSERT OR REPLACE INTO worker_slices (worker, model, layers, experts, capacity, backend, registered_at, position) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    ),
    forget: db.prepare<[number]>("DELETE FROM workers WHERE last_seen < ?"),
    leases: db.prepare<[], LeaseRow>(
      "SELECT id, worker, model, layers, experts, bytes, granted_at, expires_at, capacity, owner FROM leases ORDER BY id",
    ),
    putLease: db.prepare<
      [string, string, string, string, string, number, number, number, string, string | null]
    >(
      `INSERT INTO leases (id, worker, model, layers, experts, bytes, granted_at, expires_at, capacity, owner)
       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
       ON CONFLICT (id) DO UPDATE SET worker = excluded.worker, model = excluded.model, layers = excluded.layers,
         experts = excluded.experts, bytes = excluded.bytes, granted_at = excluded.granted_at,
         expires_at = excluded.expires_at, capacity = excluded.capacity, owner = excluded.owner`,
    ),
    deleteLease: db.prepare<[string]>("DELETE FROM leases WHERE id = ?"),
    demand: db.prepare<[], DemandRow>("SELECT model, layer, at, counts FROM demand ORDER BY model, layer"),
    putDemand: db.prepare<[string, number, number, Buffer]>(
      `INSERT INTO demand (model, layer, at, counts) VALUES (?, ?, ?, ?)
       ON CONFLICT (model, layer) DO UPDATE SET at = excluded.at, counts = excluded.counts`,
    ),
    deleteDemand: db.prepare<[string]>("DELETE FROM demand WHERE model = ?"),
    credits: db.prepare<[], CreditTableRow>(
      "SELECT worker, model, expert_tokens, updated_at FROM credits ORDER BY worker, model",
    ),
    statsSeqs: db.prepare<[], { backbone: string; model: string; seq: number }>(
      "SELECT backbone, model, seq FROM stats_seq ORDER BY backbone, model",
    ),
    putStatsSeq: db.prepare<[string, string, number]>(
      `INSERT INTO stats_seq (backbone, model, seq) VALUES (?, ?, ?)
       ON CONFLICT (backbone, model) DO UPDATE SET seq = MAX(seq, excluded.seq)`,
    ),
    putCredit: db.prepare<[string, string, number, number]>(
      `INSERT INTO credits (worker, model, expert_tokens, updated_at) VALUES (?, ?, ?, ?)
       ON CONFLICT (worker, model) DO UPDATE SET expert_tokens = excluded.expert_tokens, updated_at = excluded.updated_at`,
    ),
  };
}

type Statements = ReturnType<typeof prepareStatements>;

/** The multi-row writes, each one transaction. */
function writeTransactions(db: SqliteDatabase, q: Statements) {
  const putLeases = db.transaction((list: readonly StoredLease[], also: MarketWrite) => {
    for (const l of list) {
      q.putLease.run(
        l.id,
        l.worker,
        l.model,
        formatRange(l.layers),
        formatRange(l.experts),
        l.bytes,
        l.grantedAt,
        l.expiresAt,
        JSON.stringify(l.capacity ?? {}),
        l.owner ?? null,
      );
    }
    for (const id of also.deleteLeases ?? []) q.deleteLease.run(id);
    for (const c of also.credits ?? []) q.putCredit.run(c.worker, c.model, c.expertTokens, c.updatedAt);
    for (const d of also.demand ?? []) q.putDemand.run(d.model, d.layer, d.at, countsToBlob(d.counts));
    for (const x of also.statsSeqs ?? []) q.putStatsSeq.run(x.backbone, x.model, x.seq);
  });
  const deleteLeases = db.transaction((ids: readonly string[]) => {
    let n = 0;
    for (const id of ids) n += q.deleteLease.run(id).changes;
    return n;
  });
  const putDemand = db.transaction((rows: readonly StoredDemandRow[]) => {
    for (const d of rows) q.putDemand.run(d.model, d.layer, d.at, countsToBlob(d.counts));
  });
  const putCredits = db.transaction((rows: readonly StoredCredit[]) => {
    for (const c of rows) q.putCredit.run(c.worker, c.model, c.expertTokens, c.updatedAt);
  });
  const putWorkers = db.transaction((list: readonly StoredWorker[]) => {
    for (const w of list) {
      q.putWorker.run(w.id, w.firstSeen, w.lastSeen, w.connected ? 1 : 0, w.draining ? 1 : 0);
      q.clearSlices.run(w.id);
      for (const [position, s] of w.slices.entries()) {
        q.putSlice.run(
          w.id,
          s.model,
          packIndices(s.layers),
          packIndices(s.experts),
          s.capacity ?? null,
          s.backend ?? null,
          s.registeredAt,
          position,
        );
      }
    }
  });
  return { putLeases, deleteLeases, putDemand, putCredits, putWorkers };
}

/** The workers table with each worker's slices, in registration order. */
function workersOf(q: Statements): StoredWorker[] {
  const slices = new Map<string, StoredSlice[]>();
  for (const r of q.slices.all()) {
    const s: StoredSlice = {
      model: r.model,
      layers: unpackIndices(r.layers),
      experts: unpackIndices(r.experts),
      registeredAt: r.registered_at,
      ...(r.capacity === null ? {} : { capacity: r.capacity }),
      ...(r.backend === null ? {} : { backend: r.backend }),
    };
    const list = slices.get(r.worker);
    if (list) list.push(s);
    else slices.set(r.worker, [s]);
  }
  return q.workers.all().map(
    (r): StoredWorker => ({
      id: r.id,
      firstSeen: r.first_seen,
      lastSeen: r.last_seen,
      connected: r.connected === 1,
      draining: r.draining === 1,
      slices: slices.get(r.id) ?? [],
    }),
  );
}

function leaseOfRow(r: LeaseRow): StoredLease {
  return {
    id: r.id,
    worker: r.worker,
    model: r.model,
    layers: parseRange(r.layers),
    experts: parseRange(r.experts),
    bytes: r.bytes,
    grantedAt: r.granted_at,
    expiresAt: r.expires_at,
    capacity: capacityOf(r.capacity),
    ...(r.owner === null ? {} : { owner: r.owner }),
  };
}

/** The database, its journal and foreign keys set and its schema migrated. */
function openConfigured(path: string, busy: number, options: SqliteStoreOptions): SqliteDatabase {
  const db = openDatabase(path, options);
  try {
    db.pragma(`busy_timeout = ${busy}`);
    // (a driver without shared memory keeps SQLite's rollback journal: as durable, one process)
    if (path !== ":memory:" && db.wal) db.pragma("journal_mode = WAL");
    // FULL: a committed lease or credit is on disk before the hub answers for it (NORMAL could
    // lose the last commits to a power cut; a kill -9 loses nothing either way)
    db.pragma("synchronous = FULL");
    db.pragma("foreign_keys = ON");
    migrate(db, path);
  } catch (error) {
    db.close();
    throw error instanceof HubError ? error : storeError(`cannot open the SQLite store ${path}`, error);
  }
  return db;
}

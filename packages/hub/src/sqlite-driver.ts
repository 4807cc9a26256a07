// The SQLite the hub's store runs on, behind one small interface: better-sqlite3 when it is
// installed and loads (fastest; a native addon, so optional: it needs a compiler where it has no
// prebuilt binary), Node's built-in `node:sqlite` where the running Node has it (22.5+), and
// node-sqlite3-wasm (real SQLite compiled to WebAssembly with a file VFS: no compiler, any
// platform) everywhere else. The interface is the part of better-sqlite3's `Database` the
// stores use, so the schema and statements are the same text for every driver.
import { createRequire } from "node:module";
import { HubError } from "@moeswarm/core";
import { openWasmDatabase, type RawDatabase } from "./sqlite-wasm.js";

export type SqliteValue = number | bigint | string | Buffer | Uint8Array | null;

export interface SqliteStatement<P extends unknown[] = unknown[], R = unknown> {
  run(...params: P): { changes: number };
  get(...params: P): R | undefined;
  all(...params: P): R[];
}

/** A function run in one transaction; `.immediate` takes the write lock at BEGIN (what the store's writes use). */
export type SqliteTransaction<A extends unknown[], T> = ((...args: A) => T) & {
  immediate: (...args: A) => T;
};

/** One connection (synchronous, as SQLite is). */
export interface SqliteDatabase {
  /** Which driver opened it ("better-sqlite3", "node:sqlite", "node-sqlite3-wasm", or an injected one's). */
  readonly driver: string;
  /** Whether it can keep a WAL journal (node-sqlite3-wasm has no shared memory: rollback journal). */
  readonly wal: boolean;
  prepare<P extends unknown[] = unknown[], R = unknown>(sql: string): SqliteStatement<P, R>;
  exec(sql: string): void;
  /** `PRAGMA <source>`: the rows, or with `simple` the first column of the first row. */
  pragma(source: string, options?: { simple?: boolean }): unknown;
  transaction<A extends unknown[], T>(fn: (...args: A) => T): SqliteTransaction<A, T>;
  close(): void;
}

/** A way to open databases; `load` throws when the driver is not there (not installed, too old a Node). */
export interface SqliteDriver {
  readonly name: string;
  load(): (path: string) => SqliteDatabase;
}

export type SqliteDriverName = "better-sqlite3" | "node:sqlite" | "node-sqlite3-wasm";

const require = createRequire(import.meta.url);

/** The install line the hub's errors name. */
export const SQLITE_INSTALL_HINT =
  "npm install node-sqlite3-wasm (no compiler needed) or npm install better-sqlite3 (faster; prebuilt for common platforms)";

const betterSqlite3: SqliteDriver = {
  name: "better-sqlite3",
  load() {
    const Database = require("better-sqlite3") as typeof import("better-sqlite3");
    // the addon loads at the first open: probe it now, so a missing binary is "not available"
    new Database(":memory:").close();
    return (path) => {
      const db = new Database(path);
      return {
        driver: "better-sqlite3",
        wal: true,
        prepare: (sql) => db.prepare(sql) as never,
        exec: (sql) => {
          db.exec(sql);
        },
        pragma: (source, options) => db.pragma(source, options),
        transaction: (fn) => db.transaction(fn) as never,
        close: () => {
          db.close();
        },
      };
    };
  },
};

interface NodeSqliteModule {
  DatabaseSync: new (
    path: string,
  ) => {
    prepare(sql: string): {
      run(...p: unknown[]): { changes: number | bigint };
      get(...p: unknown[]): unknown;
      all(...p: unknown[]): unknown[];
    };
    exec(sql: string): void;
    close(): void;
  };
}

const nodeSqlite: SqliteDriver = {
  name: "node:sqlite",
  load() {
    // getBuiltinModule: a plain import of a module this Node lacks would fail the whole bundle
    const mod = process.getBuiltinModule?.("node:sqlite") as NodeSqliteModule | undefined;
    if (!mod?.DatabaseSync) throw new Error(`node:sqlite is not in Node ${process.version} (22.5+ has it)`);
    return (path) => {
      const db = new mod.DatabaseSync(path);
      return adapt("node:sqlite", true, {
        prepare(sql) {
          const s = db.prepare(sql);
          return {
            run: (p) => ({ changes: Number(s.run(...p).changes) }),
            get: (p) => s.get(...p) ?? undefined,
            all: (p) => s.all(...p),
          };
        },
        exec: (sql) => db.exec(sql),
        close: () => db.close(),
      });
    };
  },
};

const wasm: SqliteDriver = {
  name: "node-sqlite3-wasm",
  load() {
    const mod = require("node-sqlite3-wasm") as typeof import("node-sqlite3-wasm");
    return (path) => adapt("node-sqlite3-wasm", false, openWasmDatabase(mod, path));
  },
};

/** The drivers in the order the hub tries them. */
export const SQLITE_DRIVERS: readonly SqliteDriver[] = [betterSqlite3, nodeSqlite, wasm];

/** A driver by name (for `sqliteDriver` / --sqlite-driver). */
export function sqliteDriverNamed(name: string): SqliteDriver | undefined {
  return SQLITE_DRIVERS.find((d) => d.name === name);
}

/** What each driver said when it would not load, for the error. */
export interface DriverFailure {
  driver: string;
  reason: string;
}

const loaded = new WeakMap<SqliteDriver, (path: string) => SqliteDatabase>();

/**
 * The first driver of `drivers` that loads, with what the others said. Throws HubError
 * MOESWARM_HUB_NO_SQLITE, naming the install line, when none does.
 */
export function loadSqliteDriver(drivers: readonly SqliteDriver[] = SQLITE_DRIVERS): {
  name: string;
  open: (path: string) => SqliteDatabase;
  skipped: DriverFailure[];
} {
  const skipped: DriverFailure[] = [];
  for (const d of drivers) {
    try {
      let open = loaded.get(d);
      if (!open) {
        open = d.load();
        loaded.set(d, open);
      }
      return { name: d.name, open, skipped };
    } catch (error) {
      skipped.push({ driver: d.name, reason: firstLine(error) });
    }
  }
  throw new HubError(
    "MOESWARM_HUB_NO_SQLITE",
    [
      "no SQLite driver loads, so the hub cannot keep its state on disk:",
      ...skipped.map((s) => `  - ${s.driver}: ${s.reason}`),
      `install one: ${SQLITE_INSTALL_HINT};`,
      'or run without persistence: --db :memory: (store: ":memory:")',
    ].join("\n"),
    { details: { tried: skipped } },
  );
}

function firstLine(error: unknown): string {
  const message = (error as Error)?.message ?? String(error);
  return message.split("\n")[0] as string;
}

// --- the adapter for drivers without better-sqlite3's API ------------------------------------

// SQLite's primary result codes by number (node:sqlite's errcode) and by message (the WASM
// build's errors carry only sqlite3_errmsg), as better-sqlite3 names them in `code`
const CODES: ReadonlyArray<[number, string, RegExp]> = [
  [13, "SQLITE_FULL", /database or disk is full/],
  [8, "SQLITE_READONLY", /readonly database/],
  [3, "SQLITE_PERM", /access permission denied/],
  [23, "SQLITE_AUTH", /authorization denied/],
  [10, "SQLITE_IOERR", /disk I\/O error/],
  [14, "SQLITE_CANTOPEN", /unable to open database file|Could not open the database/],
  [5, "SQLITE_BUSY", /database is locked/],
  [26, "SQLITE_NOTADB", /file is not a database/],
  [11, "SQLITE_CORRUPT", /malformed/],
  [19, "SQLITE_CONSTRAINT", /constraint failed/],
];

/** The error with `code` SQLITE_* as better-sqlite3 gives it, so the store names disk trouble alike. */
function uniform(error: unknown): unknown {
  if (!(error instanceof Error)) return error;
  const e = error as Error & { code?: unknown; errcode?: unknown };
  if (typeof e.code === "string" && e.code.startsWith("SQLITE_")) return error;
  const primary = typeof e.errcode === "number" ? e.errcode & 0xff : undefined;
  const hit = CODES.find(([n, , text]) => n === primary || text.test(e.message));
  if (hit) {
    try {
      e.code = hit[1];
    } catch {
      // a frozen error keeps its own code
    }
  }
  return error;
}

const guard =
  <A extends unknown[], T>(fn: (...args: A) => T) =>
  (...args: A): T => {
    try {
      return fn(...args);
    } catch (error) {
      throw uniform(error);
    }
  };

/** Buffers for blobs (node:sqlite and the WASM build answer Uint8Array; the stores read Buffers). */
function withBuffers(row: unknown): unknown {
  if (typeof row !== "object" || row === null) return row;
  const r = row as Record<string, unknown>;
  for (const k of Object.keys(r)) {
    const v = r[k];
    if (v instanceof Uint8Array && !Buffer.isBuffer(v))
      r[k] = Buffer.from(v.buffer, v.byteOffset, v.byteLength);
  }
  return r;
}

export function adapt(driver: string, wal: boolean, raw: RawDatabase): SqliteDatabase {
  let depth = 0;
  const exec = guard((sql: string) => raw.exec(sql));
  const prepare = guard(<P extends unknown[], R>(sql: string): SqliteStatement<P, R> => {
    const s = raw.prepare(sql);
    return {
      run: guard((...p: P) => s.run(p)),
      get: guard((...p: P) => withBuffers(s.get(p) ?? undefined) as R | undefined),
      all: guard((...p: P) => s.all(p).map(withBuffers) as R[]),
    };
  });
  const pragma = (source: string, options?: { simple?: boolean }): unknown => {
    const rows = prepare<[], Record<string, unknown>>(`PRAGMA ${source}`).all();
    if (!options?.simple) return rows;
    const first = rows[0];
    return first === undefined ? undefined : Object.values(first)[0];
  };
  const transaction = <A extends unknown[], T>(fn: (...args: A) => T): SqliteTransaction<A, T> => {
    const inMode =
      (mode: string) =>
      (...args: A): T => {
        // nested: a savepoint, as better-sqlite3 does
        const name = `moeswarm_tx_${depth}`;
        exec(depth === 0 ? `BEGIN ${mode}` : `SAVEPOINT ${name}`);
        depth++;
        let result: T;
        try {
          result = fn(...args);
        } catch (error) {
          depth--;
          exec(depth === 0 ? "ROLLBACK" : `ROLLBACK TO ${name}; RELEASE ${name}`);
          throw error;
        }
        depth--;
        try {
          exec(depth === 0 ? "COMMIT" : `RELEASE ${name}`);
        } catch (error) {
          if (depth === 0) {
            try {
              exec("ROLLBACK");
            } catch {
              // already rolled back by SQLite
            }
          }
          throw error;
        }
        return result;
      };
    return Object.assign(inMode("DEFERRED"), { immediate: inMode("IMMEDIATE") });
  };
  return {
    driver,
    wal,
    prepare,
    exec,
    pragma,
    transaction,
    close: guard(() => raw.close()),
  };
}

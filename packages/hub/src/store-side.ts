// Tables kept beside the hub's store (quarantines, enrolment codes). The store (store.ts) is an
// interface an embedder may implement with a database of its own, so these tables are not part of
// it: for a SQLite store they live in the same file, through a second connection on the store's
// driver (WAL lets both write; the same driver keeps the same locking), created if missing; for
// any other store, in this process's memory, kept per store object so that a hub built again on
// the same store (a restart in tests) finds them.
import { HubError } from "@moeswarm/core";
import { loadSqliteDriver, type SqliteDatabase, sqliteDriverNamed } from "./sqlite-driver.js";
import type { HubStore } from "./store.js";

/** Runs one synchronous statement as a promise; a failure becomes HubError MOESWARM_HUB_STORE. */
export type SideRun = <T>(what: string, fn: () => T) => Promise<T>;

export interface SideStoreSpec<S> {
  /** What the tables are, for the open error ("the quarantine table"). */
  readonly name: string;
  /** `CREATE TABLE IF NOT EXISTS ...`: run at every open. */
  readonly schema: string;
  /** The side store over a SQLite connection (it closes `db` in its `close`). */
  sqlite(db: SqliteDatabase, run: SideRun): S;
  /** The side store in memory: made once per store object, then handed out again. */
  memory(): S;
}

const runSide: SideRun = (what, fn) => {
  try {
    return Promise.resolve(fn());
  } catch (error) {
    return Promise.reject(new HubError("MOESWARM_HUB_STORE", `${what}: ${String(error)}`, { cause: error }));
  }
};

/** Memory side stores per hub store, by spec name. */
const memoryStores = new WeakMap<HubStore, Map<string, unknown>>();

/**
 * The side store `spec` for the hub's `store` option (a SQLite path, or a store object) and the
 * store opened from it. Throws HubError MOESWARM_HUB_STORE when the SQLite tables cannot be opened.
 */
export function openSideStore<S>(
  option: HubStore | string | undefined,
  store: HubStore,
  spec: SideStoreSpec<S>,
): S {
  if (typeof option === "string" && option !== ":memory:" && store.kind === "sqlite") {
    let db: SqliteDatabase;
    try {
      // the store's driver choice (better-sqlite3 is optional: a static import would break the
      // bundled hub, and a hub without it)
      const named = store.driver === undefined ? undefined : sqliteDriverNamed(store.driver);
      db = loadSqliteDriver(named ? [named] : undefined).open(option);
    } catch (error) {
      throw new HubError("MOESWARM_HUB_STORE", `cannot open ${spec.name}: ${String(error)}`, {
        cause: error,
      });
    }
    try {
      db.pragma("busy_timeout = 5000");
      db.exec(spec.schema);
      return spec.sqlite(db, runSide);
    } catch (error) {
      db.close();
      throw new HubError("MOESWARM_HUB_STORE", `cannot open ${spec.name}: ${String(error)}`, {
        cause: error,
      });
    }
  }
  let stores = memoryStores.get(store);
  if (!stores) {
    stores = new Map();
    memoryStores.set(store, stores);
  }
  if (!stores.has(spec.name)) stores.set(spec.name, spec.memory());
  return stores.get(spec.name) as S;
}

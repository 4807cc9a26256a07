// Where the hub's pauses persist (issue 19): a `worker_pauses` table beside the hub's store, as
// quarantines and enrolment codes are (store-side.ts says where side tables live and why they are
// not part of the store's schema). Only the hub's pause is kept, the one an owner or the operator
// set: a worker's own pause (battery, heat) is its to tell again, and a hub restart forgets it.
import type { SqliteDatabase } from "./sqlite-driver.js";
import type { HubStore } from "./store.js";
import { openSideStore, type SideRun } from "./store-side.js";

/** A hub pause in force: who set it, when (unix ms), and why when they said. */
export interface StoredPause {
  readonly worker: string;
  readonly by: "owner" | "operator";
  readonly at: number;
  readonly reason?: string;
}

export interface PauseStore {
  /** Every pause kept, ordered by worker id. */
  list(): Promise<StoredPause[]>;
  /** Adds or replaces (by worker) a pause. */
  put(pause: StoredPause): Promise<void>;
  /** true when the worker had a pause. */
  delete(worker: string): Promise<boolean>;
  close(): Promise<void>;
}

function memoryPauses(): PauseStore {
  const t = new Map<string, StoredPause>();
  return {
    list: async () => [...t.values()].sort((a, b) => (a.worker < b.worker ? -1 : 1)).map((p) => ({ ...p })),
    put: async (p) => {
      t.set(p.worker, { ...p });
    },
    delete: async (worker) => t.delete(worker),
    close: async () => {},
  };
}

interface PauseRow {
  worker: string;
  by: string;
  at: number;
  reason: string | null;
}

function sqlitePauses(db: SqliteDatabase, run: SideRun): PauseStore {
  const all = db.prepare<[], PauseRow>("SELECT worker, by, at, reason FROM worker_pauses ORDER BY worker");
  const put = db.prepare<[string, string, number, string | null]>(
    `INSERT INTO worker_pauses (worker, by, at, reason) VALUES (?, ?, ?, ?)
     ON CONFLICT (worker) DO UPDATE SET by = excluded.by, at = excluded.at, reason = excluded.reason`,
  );
  const del = db.prepare<[string]>("DELETE FROM worker_pauses WHERE worker = ?");
  return {
    list: () =>
      run("listing pauses", () =>
        all
          .all()
          // a row another program wrote with an unknown pauser is not a pause this hub can lift
          .filter((r) => r.by === "owner" || r.by === "operator")
          .map(
            (r): StoredPause => ({
              worker: r.worker,
              by: r.by as StoredPause["by"],
              at: r.at,
              ...(r.reason === null ? {} : { reason: r.reason }),
            }),
          ),
      ),
    put: (p) =>
      run("storing a pause", () => {
        put.run(p.worker, p.by, p.at, p.reason ?? null);
      }),
    delete: (worker) => run("deleting a pause", () => del.run(worker).changes > 0),
    close: async () => {
      db.close();
    },
  };
}

/** The pause table for the hub's `store` option (a SQLite path, or the store object in memory). */
export function openPauseStore(option: HubStore | string | undefined, store: HubStore): PauseStore {
  return openSideStore(option, store, {
    name: "the pause table",
    schema: `CREATE TABLE IF NOT EXISTS worker_pauses (
       worker TEXT PRIMARY KEY, by TEXT NOT NULL, at INTEGER NOT NULL, reason TEXT
     )`,
    sqlite: sqlitePauses,
    memory: memoryPauses,
  });
}

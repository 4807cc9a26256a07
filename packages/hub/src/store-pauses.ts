// Where the hub's pauses persist (issue 19): a `worker_pauses` table beside the hub's store, as
// quarantines and enrolment codes are (store-side.ts says where side tables live and why they are
// not part of the store's schema). Only the hub's pause is kept, the one an owner or the operator
// set: a worker's own pause (battery, heat) is its to tell again, and a hub restart forgets it.
// Beside each pause, `seen`: when the hub last saw the worker, written when the hub forgets the
// worker (worker-book.ts deletes its row then), so a pause's retention still counts from it.
import type { SqliteDatabase } from "./sqlite-driver.js";
import type { HubStore } from "./store.js";
import { openSideStore, type SideRun } from "./store-side.js";

/** A hub pause in force: who set it, when (unix ms), and why when they said. */
export interface StoredPause {
  readonly worker: string;
  readonly by: "owner" | "operator";
  readonly at: number;
  readonly reason?: string;
  /** When the hub last saw the worker, once the hub forgot it (unix ms). */
  readonly seen?: number;
}

export interface PauseStore {
  /** Every pause kept, ordered by worker id. */
  list(): Promise<StoredPause[]>;
  /** Adds or replaces (by worker) a pause; a `seen` already kept stays unless `pause` has one. */
  put(pause: StoredPause): Promise<void>;
  /** Records when the hub last saw `worker` (nothing when it has no pause). */
  setSeen(worker: string, seen: number): Promise<void>;
  /** true when the worker had a pause. */
  delete(worker: string): Promise<boolean>;
  close(): Promise<void>;
}

function memoryPauses(): PauseStore {
  const t = new Map<string, StoredPause>();
  return {
    list: async () => [...t.values()].sort((a, b) => (a.worker < b.worker ? -1 : 1)).map((p) => ({ ...p })),
    put: async (p) => {
      const seen = p.seen ?? t.get(p.worker)?.seen;
      t.set(p.worker, { ...p, ...(seen === undefined ? {} : { seen }) });
    },
    setSeen: async (worker, seen) => {
      const p = t.get(worker);
      if (p) t.set(worker, { ...p, seen });
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
  seen: number | null;
}

function sqlitePauses(db: SqliteDatabase, run: SideRun): PauseStore {
  // a table made before `seen` existed (the first release with pauses) gains the column
  const columns = db.prepare<[], { name: string }>("PRAGMA table_info(worker_pauses)").all();
  if (!columns.some((c) => c.name === "seen")) db.exec("ALTER TABLE worker_pauses ADD COLUMN seen INTEGER");
  const all = db.prepare<[], PauseRow>(
    "SELECT worker, by, at, reason, seen FROM worker_pauses ORDER BY worker",
  );
  const put = db.prepare<[string, string, number, string | null, number | null]>(
    `INSERT INTO worker_pauses (worker, by, at, reason, seen) VALUES (?, ?, ?, ?, ?)
     ON CONFLICT (worker) DO UPDATE SET by = excluded.by, at = excluded.at, reason = excluded.reason,
       seen = COALESCE(excluded.seen, worker_pauses.seen)`,
  );
  const setSeen = db.prepare<[number, string]>("UPDATE worker_pauses SET seen = ? WHERE worker = ?");
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
              ...(r.seen === null ? {} : { seen: r.seen }),
            }),
          ),
      ),
    put: (p) =>
      run("storing a pause", () => {
        put.run(p.worker, p.by, p.at, p.reason ?? null, p.seen ?? null);
      }),
    setSeen: (worker, seen) =>
      run("recording when a paused worker was seen", () => {
        setSeen.run(seen, worker);
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
       worker TEXT PRIMARY KEY, by TEXT NOT NULL, at INTEGER NOT NULL, reason TEXT, seen INTEGER
     )`,
    sqlite: sqlitePauses,
    memory: memoryPauses,
  });
}

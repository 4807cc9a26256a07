// Where quarantines persist: a `quarantine` table beside the hub's store (store-side.ts says where
// side tables live and why they are not part of the store's schema).

import type { SqliteDatabase } from "./sqlite-driver.js";
import type { HubStore } from "./store.js";
import { openSideStore, type SideRun } from "./store-side.js";

/** What a backbone saw: the evidence of a quarantine (validated in reputation.ts). */
export interface QuarantineEvidence {
  worker: string;
  layer: number;
  reason: string;
  /** sha256 (hex) of the dispatch frame's payload the answer was for. */
  requestDigest: string;
  expected?: { norm?: number; cosine?: number };
  got?: { norm?: number; cosine?: number };
  /** When the backbone saw it, unix ms (its clock). */
  at: number;
}

export interface QuarantineRecord {
  worker: string;
  /** When the hub took the report, unix ms. */
  at: number;
  /** The backbone (token id) that reported it. */
  by: string;
  /** The model it was serving. */
  model: string;
  evidence: QuarantineEvidence;
}

export interface ReportStore {
  list(): Promise<QuarantineRecord[]>;
  put(record: QuarantineRecord): Promise<void>;
  /** true when the worker was quarantined. */
  delete(worker: string): Promise<boolean>;
  close(): Promise<void>;
}

function memoryReports(): ReportStore {
  const t = new Map<string, QuarantineRecord>();
  const copy = (r: QuarantineRecord): QuarantineRecord => structuredClone(r);
  return {
    list: async () => [...t.values()].map(copy),
    put: async (r) => {
      t.set(r.worker, copy(r));
    },
    delete: async (worker) => t.delete(worker),
    close: async () => {},
  };
}

function sqliteReports(db: SqliteDatabase, run: SideRun): ReportStore {
  const all = db.prepare<[], { worker: string; at: number; by: string; model: string; evidence: string }>(
    "SELECT worker, at, by, model, evidence FROM quarantine ORDER BY worker",
  );
  const put = db.prepare<[string, number, string, string, string]>(
    `INSERT INTO quarantine (worker, at, by, model, evidence) VALUES (?, ?, ?, ?, ?)
     ON CONFLICT (worker) DO UPDATE SET at = excluded.at, by = excluded.by, model = excluded.model, evidence = excluded.evidence`,
  );
  const del = db.prepare<[string]>("DELETE FROM quarantine WHERE worker = ?");
  return {
    list: () =>
      run("listing quarantines", () =>
        all.all().map((r) => ({
          worker: r.worker,
          at: r.at,
          by: r.by,
          model: r.model,
          evidence: JSON.parse(r.evidence) as QuarantineEvidence,
        })),
      ),
    put: (r) =>
      run("storing a quarantine", () => {
        put.run(r.worker, r.at, r.by, r.model, JSON.stringify(r.evidence));
      }),
    delete: (worker) => run("deleting a quarantine", () => del.run(worker).changes > 0),
    close: async () => {
      db.close();
    },
  };
}

/** The quarantine table for the hub's `store` option (a SQLite path, or the store object in memory). */
export function openReportStore(option: HubStore | string | undefined, store: HubStore): ReportStore {
  return openSideStore(option, store, {
    name: "the quarantine table",
    schema: `CREATE TABLE IF NOT EXISTS quarantine (
       worker TEXT PRIMARY KEY, at INTEGER NOT NULL, by TEXT NOT NULL, model TEXT NOT NULL, evidence TEXT NOT NULL
     )`,
    sqlite: sqliteReports,
    memory: memoryReports,
  });
}

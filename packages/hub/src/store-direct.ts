// Where credits for direct traffic wait for their other half: tables beside the hub's store
// (store-side.ts says where side tables live and why). A hub restarted on the same store still
// matches a half that the other side reports after the restart, still knows which pairs it minted
// a ticket for (a direct link outlives the hub that admitted it), and still takes a worker's
// retried report as a duplicate. Written through the market's write queue, before the credits a
// change came with (market-book.ts): a crash between the two loses a credit, never doubles one.

import type { SqliteDatabase } from "./sqlite-driver.js";
import type { HubStore } from "./store.js";
import { openSideStore, type SideRun } from "./store-side.js";

/** One backbone-worker-model pair's unmatched counts. */
export interface DirectPendingRow {
  readonly backbone: string;
  readonly worker: string;
  readonly model: string;
  /** Expert-tokens the worker said it answered that no receipt has matched yet. */
  readonly workerExpertTokens: number;
  /** Expert-tokens the backbone accepted beyond the relay's forwards that no worker report has matched yet. */
  readonly backboneExpertTokens: number;
  /** Unix ms (hub clock) of the last report that touched the pair; the match window runs from it. */
  readonly at: number;
}

/** A pair the hub minted a direct-link ticket for, and when (unix ms). */
export interface DirectPairRow {
  readonly backbone: string;
  readonly worker: string;
  readonly at: number;
}

/** The last direct-served report seq the hub took from a worker. */
export interface DirectSeqRow {
  readonly worker: string;
  readonly seq: number;
}

export interface DirectState {
  pending: DirectPendingRow[];
  seqs: DirectSeqRow[];
  pairs: DirectPairRow[];
}

/** What changed since the last write. A pending row with both counts 0 is deleted. */
export interface DirectWrite {
  readonly pending: readonly DirectPendingRow[];
  readonly seqs: readonly DirectSeqRow[];
  readonly pairs: readonly DirectPairRow[];
  /** Pairs forgotten (the oldest, past the bound). */
  readonly forgetPairs: ReadonlyArray<{ backbone: string; worker: string }>;
}

export interface DirectStore {
  load(): Promise<DirectState>;
  /** One transaction. */
  write(change: DirectWrite): Promise<void>;
  close(): Promise<void>;
}

const pk = (r: { backbone: string; worker: string; model?: string }) =>
  `${r.backbone}\0${r.worker}\0${r.model ?? ""}`;
const empty = (r: DirectPendingRow) => r.workerExpertTokens === 0 && r.backboneExpertTokens === 0;

function memoryDirect(): DirectStore {
  const pending = new Map<string, DirectPendingRow>();
  const seqs = new Map<string, number>();
  const pairs = new Map<string, DirectPairRow>();
  return {
    load: async () => ({
      pending: [...pending.values()].map((r) => ({ ...r })),
      seqs: [...seqs].map(([worker, seq]) => ({ worker, seq })),
      pairs: [...pairs.values()].map((r) => ({ ...r })),
    }),
    write: async (w) => {
      for (const r of w.pending) {
        if (empty(r)) pending.delete(pk(r));
        else pending.set(pk(r), { ...r });
      }
      for (const q of w.seqs) seqs.set(q.worker, Math.max(seqs.get(q.worker) ?? q.seq, q.seq));
      for (const p of w.pairs) pairs.set(pk(p), { ...p });
      for (const p of w.forgetPairs) pairs.delete(pk(p));
    },
    close: async () => {},
  };
}

function sqliteDirect(db: SqliteDatabase, run: SideRun): DirectStore {
  const q = {
    pending: db.prepare<
      [],
      { backbone: string; worker: string; model: string; worker_et: number; backbone_et: number; at: number }
    >("SELECT backbone, worker, model, worker_et, backbone_et, at FROM direct_pending ORDER BY at"),
    seqs: db.prepare<[], DirectSeqRow>("SELECT worker, seq FROM direct_seq"),
    pairs: db.prepare<[], DirectPairRow>("SELECT backbone, worker, at FROM direct_pairs ORDER BY at"),
    putPending: db.prepare<[string, string, string, number, number, number]>(
      `INSERT INTO direct_pending (backbone, worker, model, worker_et, backbone_et, at) VALUES (?, ?, ?, ?, ?, ?)
       ON CONFLICT (backbone, worker, model) DO UPDATE SET worker_et = excluded.worker_et,
         backbone_et = excluded.backbone_et, at = excluded.at`,
    ),
    deletePending: db.prepare<[string, string, string]>(
      "DELETE FROM direct_pending WHERE backbone = ? AND worker = ? AND model = ?",
    ),
    putSeq: db.prepare<[string, number]>(
      `INSERT INTO direct_seq (worker, seq) VALUES (?, ?)
       ON CONFLICT (worker) DO UPDATE SET seq = MAX(seq, excluded.seq)`,
    ),
    putPair: db.prepare<[string, string, number]>(
      `INSERT INTO direct_pairs (backbone, worker, at) VALUES (?, ?, ?)
       ON CONFLICT (backbone, worker) DO UPDATE SET at = excluded.at`,
    ),
    deletePair: db.prepare<[string, string]>("DELETE FROM direct_pairs WHERE backbone = ? AND worker = ?"),
  };
  const write = db.transaction((w: DirectWrite) => {
    for (const r of w.pending) {
      if (empty(r)) q.deletePending.run(r.backbone, r.worker, r.model);
      else
        q.putPending.run(r.backbone, r.worker, r.model, r.workerExpertTokens, r.backboneExpertTokens, r.at);
    }
    for (const s of w.seqs) q.putSeq.run(s.worker, s.seq);
    for (const p of w.pairs) q.putPair.run(p.backbone, p.worker, p.at);
    for (const p of w.forgetPairs) q.deletePair.run(p.backbone, p.worker);
  });
  return {
    load: () =>
      run("loading direct credits", () => ({
        pending: q.pending.all().map((r) => ({
          backbone: r.backbone,
          worker: r.worker,
          model: r.model,
          workerExpertTokens: r.worker_et,
          backboneExpertTokens: r.backbone_et,
          at: r.at,
        })),
        seqs: q.seqs.all().map((r) => ({ worker: r.worker, seq: r.seq })),
        pairs: q.pairs.all().map((r) => ({ backbone: r.backbone, worker: r.worker, at: r.at })),
      })),
    write: (w) =>
      run("storing direct credits", () => {
        write.immediate(w);
      }),
    close: async () => {
      db.close();
    },
  };
}

/** The direct-credit tables for the hub's `store` option (a SQLite path, or the store object in memory). */
export function openDirectStore(option: HubStore | string | undefined, store: HubStore): DirectStore {
  return openSideStore(option, store, {
    name: "the direct-credit tables",
    schema: `CREATE TABLE IF NOT EXISTS direct_pending (
       backbone TEXT NOT NULL, worker TEXT NOT NULL, model TEXT NOT NULL,
       worker_et INTEGER NOT NULL, backbone_et INTEGER NOT NULL, at REAL NOT NULL,
       PRIMARY KEY (backbone, worker, model)
     );
     CREATE TABLE IF NOT EXISTS direct_seq (worker TEXT PRIMARY KEY, seq INTEGER NOT NULL);
     CREATE TABLE IF NOT EXISTS direct_pairs (
       backbone TEXT NOT NULL, worker TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (backbone, worker)
     );`,
    sqlite: sqliteDirect,
    memory: memoryDirect,
  });
}

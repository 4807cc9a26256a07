// node-sqlite3-wasm as a RawDatabase (sqlite-driver.ts adapts it). Its file VFS writes through
// node:fs and fsyncs on SQLite's xSync (so `synchronous = FULL` reaches the disk), but it locks
// with a `<file>.lock` directory and has no shared memory: one process per database file, a
// rollback journal instead of WAL, and a lock directory left behind when a process dies inside
// a transaction. So this driver records its process in `<file>.owner`, refuses a file another
// live process holds, and removes the lock a dead one left (SQLite then rolls its hot journal back).
import { readFileSync, rmdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { resolve } from "node:path";
import { HubError } from "@moeswarm/core";

type WasmModule = typeof import("node-sqlite3-wasm");

/** The little a driver must do; sqlite-driver.ts's adapter adds pragmas, transactions and uniform errors. */
export interface RawDatabase {
  prepare(sql: string): {
    run(params: unknown[]): { changes: number };
    get(params: unknown[]): unknown;
    all(params: unknown[]): unknown[];
  };
  exec(sql: string): void;
  close(): void;
}

/** Connections open per database file in this process (the store and the quarantine table share one file). */
const openHere = new Map<string, number>();

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === "EPERM";
  }
}

function ownerOf(file: string): number | undefined {
  try {
    const pid = Number.parseInt(readFileSync(file, "utf8"), 10);
    return Number.isSafeInteger(pid) && pid > 0 ? pid : undefined;
  } catch {
    return undefined;
  }
}

function isDirectory(path: string): boolean {
  try {
    return statSync(path).isDirectory();
  } catch {
    return false;
  }
}

/** Claims `path` for this process (see the top of the file); released by `release`. */
function claim(path: string): void {
  const n = openHere.get(path) ?? 0;
  if (n > 0) {
    openHere.set(path, n + 1);
    return;
  }
  const ownerFile = `${path}.owner`;
  const owner = ownerOf(ownerFile);
  if (owner !== undefined && owner !== process.pid && alive(owner)) {
    throw new HubError(
      "MOESWARM_HUB_STORE",
      `${path} is in use by process ${owner}: the node-sqlite3-wasm driver lets one process use a database file (stop that hub, or give this one its own --data-dir)`,
      { details: { pid: owner } },
    );
  }
  // nobody alive holds it: a lock directory is what a killed process left mid-transaction
  if (isDirectory(`${path}.lock`)) rmdirSync(`${path}.lock`);
  writeFileSync(ownerFile, `${process.pid}\n`);
  openHere.set(path, 1);
}

function release(path: string): void {
  const n = (openHere.get(path) ?? 1) - 1;
  if (n > 0) {
    openHere.set(path, n);
    return;
  }
  openHere.delete(path);
  if (ownerOf(`${path}.owner`) === process.pid) rmSync(`${path}.owner`, { force: true });
}

export function openWasmDatabase(mod: WasmModule, path: string): RawDatabase {
  const file = path === ":memory:" ? path : resolve(path);
  if (file !== ":memory:") claim(file);
  let db: InstanceType<WasmModule["Database"]>;
  try {
    db = new mod.Database(file);
  } catch (error) {
    if (file !== ":memory:") release(file);
    throw error;
  }
  const statements: Array<InstanceType<WasmModule["Statement"]>> = [];
  type Values = Parameters<InstanceType<WasmModule["Statement"]>["run"]>[0];
  return {
    prepare(sql) {
      const s = db.prepare(sql);
      statements.push(s);
      return {
        run: (p) => s.run(p as Values),
        // all(), not get(): get() leaves the statement open, and with it the file's lock
        get: (p) => s.all(p as Values)[0],
        all: (p) => s.all(p as Values),
      };
    },
    exec: (sql) => db.exec(sql),
    close() {
      for (const s of statements) {
        try {
          if (!s.isFinalized) s.finalize();
        } catch {
          // finalize repeats the statement's last error (already thrown where it ran)
        }
      }
      statements.length = 0;
      try {
        db.close();
      } finally {
        if (file !== ":memory:") release(file);
      }
    },
  };
}

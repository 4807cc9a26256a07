import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { IoError } from "@moeswarm/core";
import Database from "better-sqlite3";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  createMemoryStore,
  type HubStore,
  isModelId,
  openSqliteStore,
  SQLITE_DRIVERS,
  SQLITE_SCHEMA_VERSION,
  type SqliteDriverName,
  type StoredLease,
  type StoredWorker,
} from "../src/index.js";
import { type TempDir, tempDir } from "./hub-helpers.js";

let tmp: TempDir;
beforeAll(() => {
  tmp = tempDir("moeswarm-store-");
});
afterAll(() => tmp?.remove());

const w = (id: string, lastSeen: number, extra: Partial<StoredWorker> = {}): StoredWorker => ({
  id,
  firstSeen: 1000,
  lastSeen,
  connected: false,
  draining: false,
  slices: [],
  ...extra,
});

/** A lease of model m, layer 0, experts 0:8, with `extra` fields. */
const aLease = (id: string, extra: Partial<StoredLease> = {}): StoredLease => ({
  id,
  worker: "w",
  model: "m",
  layers: { start: 0, end: 1 },
  experts: { start: 0, end: 8 },
  bytes: 10,
  grantedAt: 1,
  expiresAt: 2,
  capacity: {},
  ...extra,
});

/** The drivers this Node has; the others are named with the reason, once. */
const drivers: SqliteDriverName[] = [];
for (const d of SQLITE_DRIVERS) {
  try {
    d.load();
    drivers.push(d.name as SqliteDriverName);
  } catch (error) {
    console.log(
      `store tests: the ${d.name} driver is not available here, its runs are skipped: ${(error as Error).message}`,
    );
  }
}
// a test without better-sqlite3 would not reach the other drivers' tests: say so loudly
if (!drivers.includes("node-sqlite3-wasm"))
  throw new Error("node-sqlite3-wasm (a dependency of the hub) must load");

const fresh = (name: string) => join(tmp.dir, `${name}-${Math.random().toString(36).slice(2)}.db`);

const stores: Array<[string, () => HubStore]> = [
  ["memory", () => createMemoryStore()],
  ...drivers.flatMap(
    (driver): Array<[string, () => HubStore]> => [
      [`sqlite :memory: (${driver})`, () => openSqliteStore(":memory:", { driver })],
      [`sqlite file (${driver})`, () => openSqliteStore(fresh("contract"), { driver })],
    ],
  ),
];

describe.each(stores)("HubStore contract: %s", (_name, make) => {
  it("keeps models by id in registration order", async () => {
    await using s = make();
    expect(await s.listModels()).toEqual([]);
    await s.putModel({ id: "b", path: "/m/b.gguf", addedAt: 1 });
    await s.putModel({ id: "a", path: "/m/a.gguf", addedAt: 2 });
    await s.putModel({ id: "b", path: "/m/b2.gguf", addedAt: 3 });
    expect(await s.listModels()).toEqual([
      { id: "a", path: "/m/a.gguf", addedAt: 2 },
      { id: "b", path: "/m/b2.gguf", addedAt: 3 },
    ]);
    expect(await s.deleteModel("a")).toBe(true);
    expect(await s.deleteModel("a")).toBe(false);
    expect((await s.listModels()).map((m) => m.id)).toEqual(["b"]);
  });

  it("keeps workers with their slices, replaces them whole, forgets old ones", async () => {
    await using s = make();
    const experts = [...Array.from({ length: 128 }, (_, i) => i), 200, 201, 255];
    await s.putWorkers([
      w("w2", 5000, {
        connected: true,
        slices: [
          { model: "m1", layers: [0, 1, 2], experts, capacity: 2 ** 40, backend: "cuda", registeredAt: 4000 },
          { model: "m2", layers: [7], experts: [3], registeredAt: 4500 },
        ],
      }),
      w("w1", 100),
    ]);
    const all = await s.listWorkers();
    expect(all.map((x) => x.id)).toEqual(["w1", "w2"]);
    expect(all[1]).toEqual(
      w("w2", 5000, {
        connected: true,
        slices: [
          { model: "m1", layers: [0, 1, 2], experts, capacity: 2 ** 40, backend: "cuda", registeredAt: 4000 },
          { model: "m2", layers: [7], experts: [3], registeredAt: 4500 },
        ],
      }),
    );
    await s.putWorkers([
      w("w2", 6000, {
        draining: true,
        slices: [{ model: "m1", layers: [3], experts: [9], registeredAt: 5500 }],
      }),
    ]);
    expect((await s.listWorkers())[1]).toEqual(
      w("w2", 6000, {
        draining: true,
        slices: [{ model: "m1", layers: [3], experts: [9], registeredAt: 5500 }],
      }),
    );
    // several slices of one model, kept in the order registered
    const three = [
      { model: "m1", layers: [3], experts: [9, 10], registeredAt: 7000 },
      { model: "m1", layers: [0, 1, 2], experts: [0, 1], registeredAt: 7100 },
      { model: "m1", layers: [0], experts: [2, 3, 4], registeredAt: 7200 },
    ];
    await s.putWorkers([w("w2", 7500, { slices: three })]);
    expect((await s.listWorkers())[1]).toEqual(w("w2", 7500, { slices: three }));
    expect(await s.deleteWorkersSeenBefore(1000)).toBe(1);
    expect((await s.listWorkers()).map((x) => x.id)).toEqual(["w2"]);
  });

  it("keeps leases, demand counters and credits", async () => {
    await using s = make();
    expect([await s.listLeases(), await s.listDemand(), await s.listCredits()]).toEqual([[], [], []]);
    const lease = (id: string, expiresAt: number): StoredLease => ({
      id,
      worker: "w1",
      model: "m",
      layers: { start: 0, end: 2 },
      experts: { start: 64, end: 128 },
      bytes: 2 ** 40 + 3,
      grantedAt: 1_700_000_000_000.5,
      expiresAt,
      capacity: { ramBytes: 2 ** 41, backend: "cuda", bandwidthBps: 1.25e8 },
    });
    await s.putLeases([lease("b", 10), lease("a", 20)]);
    await s.putLeases([lease("b", 30)]);
    expect(await s.listLeases()).toEqual([lease("a", 20), lease("b", 30)]);
    expect(await s.deleteLeases(["a", "zzz"])).toBe(1);
    expect(await s.listLeases()).toEqual([lease("b", 30)]);
    // the claimant's principal is kept with its lease (schema 5); a lease without one stays without
    await s.putLeases([{ ...lease("c", 40), owner: "alice" }]);
    expect(await s.listLeases()).toEqual([lease("b", 30), { ...lease("c", 40), owner: "alice" }]);

    // f64 counts round-trip bit for bit (subnormals, fractions, large values)
    const counts = new Float64Array([0, 1.5, 5e-324, 1e300, 1 / 3]);
    await s.putDemand([
      { model: "m", layer: 3, at: 1000.25, counts },
      { model: "m", layer: 1, at: 1000.25, counts: new Float64Array([7]) },
      { model: "k", layer: 0, at: 5, counts: new Float64Array(0) },
    ]);
    await s.putDemand([{ model: "m", layer: 1, at: 2000, counts: new Float64Array([8, 9]) }]);
    expect(await s.listDemand()).toEqual([
      { model: "k", layer: 0, at: 5, counts: new Float64Array(0) },
      { model: "m", layer: 1, at: 2000, counts: new Float64Array([8, 9]) },
      { model: "m", layer: 3, at: 1000.25, counts },
    ]);
    expect(await s.deleteDemand("m")).toBe(2);
    expect((await s.listDemand()).map((d) => d.model)).toEqual(["k"]);

    await s.putCredits([
      { worker: "w2", model: "m", expertTokens: 5, updatedAt: 1 },
      { worker: "w1", model: "m", expertTokens: 2 ** 53 - 1, updatedAt: 2 },
    ]);
    await s.putCredits([{ worker: "w2", model: "m", expertTokens: 6, updatedAt: 3 }]);
    expect(await s.listCredits()).toEqual([
      { worker: "w1", model: "m", expertTokens: 2 ** 53 - 1, updatedAt: 2 },
      { worker: "w2", model: "m", expertTokens: 6, updatedAt: 3 },
    ]);
  });

  it("writes a lease with the leases it ends, credits and demand (putLeases' second argument)", async () => {
    await using s = make();
    const lease = (id: string) => aLease(id, { worker: "w1", experts: { start: 0, end: 2 }, expiresAt: 100 });
    await s.putLeases([lease("old"), lease("other")]);
    await s.putLeases([lease("new")], {
      deleteLeases: ["old", "absent"],
      credits: [{ worker: "w1", model: "m", expertTokens: 7, updatedAt: 2 }],
      demand: [{ model: "m", layer: 0, at: 2, counts: new Float64Array([1, 2]) }],
    });
    expect((await s.listLeases()).map((l) => l.id)).toEqual(["new", "other"]);
    expect(await s.listCredits()).toEqual([{ worker: "w1", model: "m", expertTokens: 7, updatedAt: 2 }]);
    expect(await s.listDemand()).toEqual([{ model: "m", layer: 0, at: 2, counts: new Float64Array([1, 2]) }]);
    // a lease put and deleted in one write is gone (puts first)
    await s.putLeases([lease("brief")], { deleteLeases: ["brief"] });
    expect((await s.listLeases()).map((l) => l.id)).toEqual(["new", "other"]);
  });

  it("refuses use after close", async () => {
    const s = make();
    await s.close();
    await expect(s.listModels()).rejects.toMatchObject({ code: "MOESWARM_HUB_STORE" });
  });
});

describe.each(drivers)("SQLite store on %s", (driver) => {
  const openSqliteStore = (path: string) => openSqliteStoreWith(path, { driver });
  it("creates the file and its directory, versions its schema with user_version", async () => {
    const path = join(fresh("nested"), "dir", "hub.db");
    const s = openSqliteStore(path);
    expect(s.driver).toBe(driver);
    await s.putModel({ id: "m", path: "/x.gguf", addedAt: 1 });
    await s.close();
    const db = new Database(path, { readonly: true });
    try {
      expect(db.pragma("user_version", { simple: true })).toBe(SQLITE_SCHEMA_VERSION);
      // node-sqlite3-wasm has no shared memory: SQLite's rollback journal
      expect(db.pragma("journal_mode", { simple: true })).toBe(
        driver === "node-sqlite3-wasm" ? "delete" : "wal",
      );
      const tables = db
        .prepare<[], { name: string }>("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .all()
        .map((r) => r.name);
      expect(tables).toEqual([
        "credits",
        "demand",
        "leases",
        "models",
        "stats_seq",
        "worker_slices",
        "workers",
      ]);
    } finally {
      db.close();
    }
    // reopening applies nothing twice and keeps the data
    const again = openSqliteStore(path);
    expect(await again.listModels()).toEqual([{ id: "m", path: "/x.gguf", addedAt: 1 }]);
    await again.close();
  });

  it("upgrades a version 1 database to the current version, keeping its rows", async () => {
    const path = fresh("v1");
    const db = new Database(path);
    db.exec(`CREATE TABLE models (id TEXT PRIMARY KEY, path TEXT NOT NULL, added_at INTEGER NOT NULL) STRICT;
      CREATE TABLE workers (id TEXT PRIMARY KEY, first_seen INTEGER NOT NULL, last_seen INTEGER NOT NULL,
        connected INTEGER NOT NULL DEFAULT 0, draining INTEGER NOT NULL DEFAULT 0) STRICT;
      CREATE INDEX workers_last_seen ON workers (last_seen);
      CREATE TABLE worker_slices (worker TEXT NOT NULL REFERENCES workers (id) ON DELETE CASCADE, model TEXT NOT NULL,
        layers TEXT NOT NULL, experts TEXT NOT NULL, capacity INTEGER, backend TEXT, registered_at INTEGER NOT NULL,
        PRIMARY KEY (worker, model)) STRICT;
      INSERT INTO models VALUES ('m', '/m.gguf', 7);
      INSERT INTO workers VALUES ('w', 1, 2, 0, 0);
      INSERT INTO worker_slices VALUES ('w', 'm', '0:2', '0:4', NULL, NULL, 3);`);
    db.pragma("user_version = 1");
    db.close();
    await using s = openSqliteStore(path);
    expect(await s.listModels()).toEqual([{ id: "m", path: "/m.gguf", addedAt: 7 }]);
    expect(await s.listWorkers()).toEqual([
      w("w", 2, {
        firstSeen: 1,
        slices: [{ model: "m", layers: [0, 1], experts: [0, 1, 2, 3], registeredAt: 3 }],
      }),
    ]);
    await s.putCredits([{ worker: "w", model: "m", expertTokens: 1, updatedAt: 1 }]);
    expect(await s.listCredits()).toHaveLength(1);
    // version 3: several slices of one model per worker
    await s.putWorkers([
      w("w", 9, {
        slices: [
          { model: "m", layers: [0, 1], experts: [0, 1, 2, 3], registeredAt: 3 },
          { model: "m", layers: [2], experts: [0, 1, 2, 3], registeredAt: 8 },
        ],
      }),
    ]);
    expect((await s.listWorkers())[0]?.slices.map((x) => x.layers)).toEqual([[0, 1], [2]]);
    expect(SQLITE_SCHEMA_VERSION).toBe(5);
  });

  it("upgrades a version 4 database: its leases are kept, without an owner, and take one", async () => {
    const path = fresh("v4");
    const v4 = openSqliteStore(path);
    await v4.close();
    const db = new Database(path);
    db.exec("DROP TABLE leases");
    db.exec(`CREATE TABLE leases (id TEXT PRIMARY KEY, worker TEXT NOT NULL, model TEXT NOT NULL, layers TEXT NOT NULL,
        experts TEXT NOT NULL, bytes INTEGER NOT NULL, granted_at REAL NOT NULL, expires_at REAL NOT NULL,
        capacity TEXT NOT NULL) STRICT;
      CREATE INDEX leases_worker ON leases (worker, model);
      INSERT INTO leases VALUES ('l', 'w', 'm', '0:1', '0:8', 10, 1, 2, '{}');`);
    db.pragma("user_version = 4");
    db.close();
    await using s = openSqliteStore(path);
    const old = aLease("l");
    expect(await s.listLeases()).toEqual([old]);
    await s.putLeases([{ ...old, owner: "bob" }]);
    expect(await s.listLeases()).toEqual([{ ...old, owner: "bob" }]);
  });

  it("refuses a database written by a newer hub", () => {
    const path = fresh("newer");
    const db = new Database(path);
    db.pragma(`user_version = ${SQLITE_SCHEMA_VERSION + 1}`);
    db.close();
    expect(() => openSqliteStore(path)).toThrow(
      expect.objectContaining({ code: "MOESWARM_HUB_STORE", message: expect.stringMatching(/newer hub/) }),
    );
  });

  it("refuses a file that is not a database", () => {
    const path = fresh("not-a-db");
    writeFileSync(path, "this is not sqlite, just some text that is long enough to have a header".repeat(20));
    expect(() => openSqliteStore(path)).toThrow(expect.objectContaining({ code: "MOESWARM_HUB_STORE" }));
  });

  it("writes a lease and what ended with it in one transaction: all or nothing", async () => {
    await using s = openSqliteStore(":memory:");
    const lease = aLease("kept", { worker: "w1", experts: { start: 0, end: 2 }, expiresAt: 100 });
    await s.putLeases([lease]);
    // a credit that is not an integer fails the STRICT table half way: the delete and the put roll back
    await expect(
      s.putLeases([{ ...lease, id: "new" }], {
        deleteLeases: ["kept"],
        credits: [{ worker: "w1", model: "m", expertTokens: 1.5, updatedAt: 2 }],
      }),
    ).rejects.toMatchObject({ code: "MOESWARM_HUB_STORE" });
    expect((await s.listLeases()).map((l) => l.id)).toEqual(["kept"]);
    expect(await s.listCredits()).toEqual([]);
  });

  it("names the disk's trouble: a file where its directory should be is MOESWARM_IO_NOT_FOUND under MOESWARM_HUB_STORE", () => {
    const file = fresh("a-file");
    writeFileSync(file, "x");
    let thrown: unknown;
    try {
      openSqliteStore(join(file, "state", "hub.db"));
    } catch (error) {
      thrown = error;
    }
    expect(thrown).toMatchObject({
      code: "MOESWARM_HUB_STORE",
      details: { io: "MOESWARM_IO_NOT_FOUND" },
      message: expect.stringMatching(/ENOTDIR.*\(MOESWARM_IO_NOT_FOUND\)$/),
    });
    expect((thrown as Error).cause).toBeInstanceOf(IoError);
  });

  it("rolls back a batch that fails half way", async () => {
    await using s = openSqliteStore(":memory:");
    await s.putWorkers([w("a", 10)]);
    const bad = {
      ...w("b", 20),
      slices: [{ model: "m", layers: [0], experts: [0], capacity: 1.5, registeredAt: 1 }],
    };
    await expect(s.putWorkers([w("a", 30), bad])).rejects.toMatchObject({ code: "MOESWARM_HUB_STORE" });
    expect(await s.listWorkers()).toEqual([w("a", 10)]);
  });
});

const openSqliteStoreWith = openSqliteStore;

describe("model ids", () => {
  it.each([
    ["tiny", true],
    ["Qwen3.5-122B-A10B_q4", true],
    ["a".repeat(128), true],
    ["a".repeat(129), false],
    ["", false],
    [".", false],
    ["..", false],
    ["../x", false],
    ["a/b", false],
    ["a\\b", false],
    ["-x", false],
    ["x y", false],
    ["x\u0000", false],
    [42, false],
  ])("%j -> %s", (id, ok) => {
    expect(isModelId(id)).toBe(ok);
  });
});

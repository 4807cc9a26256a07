// The SQLite drivers (sqlite-driver.ts): the fallback when better-sqlite3 is missing, the refusal
// when no driver loads and persistence was asked for, what the hub says about its store, and the
// node-sqlite3-wasm driver's one-process lock (a lock left by a killed process is cleared).
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Writable } from "node:stream";
import Database from "better-sqlite3";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../src/cli/run.js";
import {
  createHub,
  loadSqliteDriver,
  openSqliteStore,
  SQLITE_DRIVERS,
  type SqliteDriver,
} from "../src/index.js";
import { call, json, syntheticModel, type TempDir, tempDir } from "./hub-helpers.js";

let tmp: TempDir;
beforeAll(() => {
  tmp = tempDir("moeswarm-store-drivers-");
});
afterAll(() => tmp?.remove());

const named = (name: string) => SQLITE_DRIVERS.find((d) => d.name === name) as SqliteDriver;

/** better-sqlite3 as it is on a machine where npm skipped it (an optional dependency that failed to build). */
const missingBetterSqlite3: SqliteDriver = {
  name: "better-sqlite3",
  load() {
    throw new Error("Cannot find module 'better-sqlite3'");
  },
};
const noNodeSqlite: SqliteDriver = {
  name: "node:sqlite",
  load() {
    throw new Error("node:sqlite is not in this Node");
  },
};

describe("driver choice", () => {
  it("falls back to node-sqlite3-wasm when better-sqlite3 is missing, and the data is the same SQLite file", async () => {
    const path = join(tmp.dir, "fallback.db");
    const drivers = [missingBetterSqlite3, noNodeSqlite, named("node-sqlite3-wasm")];
    expect(loadSqliteDriver(drivers)).toMatchObject({
      name: "node-sqlite3-wasm",
      skipped: [
        { driver: "better-sqlite3", reason: "Cannot find module 'better-sqlite3'" },
        { driver: "node:sqlite", reason: "node:sqlite is not in this Node" },
      ],
    });
    const store = openSqliteStore(path, { drivers });
    expect(store.driver).toBe("node-sqlite3-wasm");
    await store.putModel({ id: "m", path: "/m.gguf", addedAt: 5 });
    await store.putCredits([{ worker: "w", model: "m", expertTokens: 42, updatedAt: 6 }]);
    await store.close();
    // an independent reader (the real better-sqlite3) sees the rows
    const db = new Database(path, { readonly: true });
    try {
      expect(db.prepare("SELECT id, path, added_at FROM models").all()).toEqual([
        { id: "m", path: "/m.gguf", added_at: 5 },
      ]);
      expect(db.prepare("SELECT expert_tokens FROM credits").get()).toEqual({ expert_tokens: 42 });
    } finally {
      db.close();
    }
  });

  it("auto prefers better-sqlite3 where it loads", () => {
    expect(loadSqliteDriver().name).toBe("better-sqlite3");
  });

  it("refuses a store path with no driver (MOESWARM_HUB_NO_SQLITE naming the install line), never a silent memory store", async () => {
    const drivers = [missingBetterSqlite3, noNodeSqlite];
    let thrown: unknown;
    try {
      openSqliteStore(join(tmp.dir, "none.db"), { drivers });
    } catch (error) {
      thrown = error;
    }
    expect(thrown).toMatchObject({
      code: "MOESWARM_HUB_NO_SQLITE",
      message: expect.stringContaining("npm install node-sqlite3-wasm"),
    });
    expect((thrown as Error).message).toContain("better-sqlite3: Cannot find module 'better-sqlite3'");
    expect(existsSync(join(tmp.dir, "none.db"))).toBe(false);
  });

  it("rejects an unknown driver name", () => {
    expect(() => openSqliteStore(":memory:", { driver: "sqlite4" as never })).toThrow(
      expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
    );
  });
});

function sink() {
  let text = "";
  return {
    stream: new Writable({
      write(chunk, _enc, done) {
        text += String(chunk);
        done();
      },
    }),
    text: () => text,
  };
}

/** A driver this Node cannot load (node:sqlite before 22.5), or undefined where every one loads. */
const unavailable = SQLITE_DRIVERS.find((d) => {
  try {
    d.load();
    return false;
  } catch {
    return true;
  }
});

describe("the hub and its store", () => {
  it("says which store and driver it uses: GET /api/health and the listening line", async () => {
    const model = await syntheticModel("tiny");
    const dir = join(tmp.dir, "cli-data");
    const ac = new AbortController();
    const out = sink();
    const err = sink();
    const running = runCli(
      [
        "serve",
        ...["--model", model, "--port", "0", "--json", "--data-dir", dir],
        ...["--sqlite-driver", "node-sqlite3-wasm"],
      ],
      { stdout: out.stream, stderr: err.stream },
      ac.signal,
    );
    try {
      for (let i = 0; i < 200 && !out.text().includes('"listening"'); i++)
        await new Promise((r) => setTimeout(r, 50));
      const listening = JSON.parse(
        out
          .text()
          .split("\n")
          .find((l) => l.includes('"listening"')) as string,
      );
      expect(listening).toMatchObject({ store: "sqlite", storeDriver: "node-sqlite3-wasm" });
      const health = json(await call(`${listening.url}/api/health`));
      expect(health).toEqual({
        ok: true,
        store: { kind: "sqlite", driver: "node-sqlite3-wasm" },
        client: { address: "127.0.0.1" },
      });
    } finally {
      ac.abort();
      expect(await running).toBe(0);
    }
    expect(existsSync(join(dir, "moeswarm-hub.db"))).toBe(true);
    // and as a human reads it
    const lines = sink();
    const ac2 = new AbortController();
    const second = runCli(
      ["serve", "--model", model, "--port", "0", "--data-dir", dir],
      { stdout: lines.stream, stderr: sink().stream },
      ac2.signal,
    );
    for (let i = 0; i < 200 && !lines.text().includes("store:"); i++)
      await new Promise((r) => setTimeout(r, 50));
    ac2.abort();
    expect(await second).toBe(0);
    expect(lines.text()).toContain(`store: sqlite via better-sqlite3 (${join(dir, "moeswarm-hub.db")})`);
  });

  it.skipIf(unavailable === undefined)(
    "refuses to start with --data-dir when its driver does not load (exit 1, the install line)",
    async () => {
      const out = sink();
      const err = sink();
      const dir = join(tmp.dir, "refused");
      const code = await runCli(
        [
          "serve",
          ...["--model", await syntheticModel("tiny"), "--port", "0", "--data-dir", dir],
          ...["--sqlite-driver", unavailable?.name as string],
        ],
        { stdout: out.stream, stderr: err.stream },
      );
      expect(code).toBe(1);
      expect(err.text()).toMatch(/^moeswarm-hub: MOESWARM_HUB_NO_SQLITE: .*npm install node-sqlite3-wasm/);
      expect(out.text()).not.toContain("serving");
      expect(existsSync(join(dir, "moeswarm-hub.db"))).toBe(false);
    },
  );

  it("runs on the memory store for `:memory:` when no driver loads (nothing was asked to persist)", async () => {
    // createHub takes a driver name; the injected list goes through openSqliteStore: both paths
    const hub = createHub({ secret: "store-drivers-secret-0123456789", store: ":memory:" });
    expect(hub.store.kind).toBe("sqlite");
    await hub.close();
    if (unavailable) {
      const fallback = createHub({
        secret: "store-drivers-secret-0123456789",
        store: ":memory:",
        sqliteDriver: unavailable.name as never,
      });
      expect(fallback.store.kind).toBe("memory");
      await fallback.close();
      expect(() =>
        createHub({
          secret: "store-drivers-secret-0123456789",
          store: join(tmp.dir, "x", "hub.db"),
          sqliteDriver: unavailable.name as never,
        }),
      ).toThrow(expect.objectContaining({ code: "MOESWARM_HUB_NO_SQLITE" }));
    } else
      console.log(
        "every SQLite driver loads on this Node: the no-driver path of createHub is not reachable here",
      );
  });
});

describe("node-sqlite3-wasm: one process per file", () => {
  const wasm = { driver: "node-sqlite3-wasm" as const };

  it("clears the lock a killed process left mid-transaction and rolls its transaction back", async () => {
    const dir = join(tmp.dir, "killed");
    mkdirSync(dir, { recursive: true });
    const path = join(dir, "hub.db");
    const s = openSqliteStore(path, wasm);
    await s.putModel({ id: "kept", path: "/k.gguf", addedAt: 1 });
    await s.close();
    // a child opens the file, begins a write, and is killed -9 inside it
    const script = `
      const { Database } = require("node-sqlite3-wasm");
      require("node:fs").writeFileSync(${JSON.stringify(`${path}.owner`)}, process.pid + "\\n");
      const db = new Database(${JSON.stringify(path)});
      db.exec("BEGIN IMMEDIATE");
      db.run("INSERT INTO models (id, path, added_at) VALUES ('lost', '/l.gguf', 2)");
      process.stdout.write("inside\\n");
      setInterval(() => {}, 1000);`;
    const child = spawn(process.execPath, ["-e", script], {
      cwd: join(import.meta.dirname, ".."),
      stdio: ["ignore", "pipe", "inherit"],
    });
    await new Promise<void>((resolve) => child.stdout.once("data", () => resolve()));
    expect(existsSync(`${path}.lock`)).toBe(true);
    // the same file while that process lives: refused, naming it
    expect(() => openSqliteStore(path, wasm)).toThrow(
      expect.objectContaining({
        code: "MOESWARM_HUB_STORE",
        message: expect.stringContaining(`process ${child.pid}`),
      }),
    );
    const exited = new Promise((resolve) => child.once("exit", resolve));
    child.kill("SIGKILL");
    await exited;
    expect(existsSync(`${path}.lock`)).toBe(true);
    await using again = openSqliteStore(path, wasm);
    expect((await again.listModels()).map((m) => m.id)).toEqual(["kept"]);
    await again.putModel({ id: "after", path: "/a.gguf", addedAt: 3 });
    expect((await again.listModels()).map((m) => m.id)).toEqual(["kept", "after"]);
  });

  it("keeps no owner file once closed, and two connections of one process share the file", async () => {
    const path = join(tmp.dir, "shared.db");
    const a = openSqliteStore(path, wasm);
    const b = openSqliteStore(path, wasm);
    await a.putModel({ id: "a", path: "/a.gguf", addedAt: 1 });
    expect((await b.listModels()).map((m) => m.id)).toEqual(["a"]);
    await a.close();
    expect(existsSync(`${path}.owner`)).toBe(true);
    await b.close();
    expect(existsSync(`${path}.owner`)).toBe(false);
    // a dead process's owner file without a lock: nothing to clear
    const dead = spawnSync(process.execPath, [
      "-e",
      "process.stdout.write(String(process.pid))",
    ]).stdout.toString();
    writeFileSync(`${path}.owner`, `${dead}\n`);
    await using c = openSqliteStore(path, wasm);
    expect((await c.listModels()).map((m) => m.id)).toEqual(["a"]);
  });
});

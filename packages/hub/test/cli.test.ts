import { type ChildProcess, spawn } from "node:child_process";
import { X509Certificate } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, realpathSync, writeFileSync } from "node:fs";
import { connect, type Socket } from "node:net";
import { dirname, join } from "node:path";
import { Writable } from "node:stream";
import { fileURLToPath } from "node:url";
import { frameAllocatorEnv, frameAllocatorState, sleep } from "@moeswarm/core";
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

function startBin(args: string[], options: { env?: NodeJS.ProcessEnv; cwd?: string } = {}): Spawned {
  const child = spawn(process.execPath, [BIN, ...args], { stdio: ["ignore", "pipe", "pipe"], ...options });
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
    await sleep(20);
  }
}

describe("the moeswarm-hub bin", () => {
  it("is built", () => {
    // the bin test runs the built file: `pnpm --filter @moeswarm/hub build` first (turbo does)
    expect(existsSync(BIN), `${BIN} is missing: build the package first`).toBe(true);
  });

  it("prints its version with --version (and as JSON with --json)", async () => {
    const { version } = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
    const plain = startBin(["--version"]);
    expect(await plain.exited).toBe(0);
    const json = startBin(["--version", "--json"]);
    expect(await json.exited).toBe(0);
    expect(json.lines).toEqual([{ name: "moeswarm-hub", version }]);
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
      // as core reads this test's environment (the bin inherits it)
      expect(listening.malloc).toBe(frameAllocatorState(process.env));
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
        // the printed worker token is bound to worker-1 (an unbound one could take any id)
        id: "worker-1",
        token: tokens.worker,
        reconnect: false,
      });
      // an operator drains it through the API: the bin says so in one line
      const drain = await call(`${listening.url}/api/workers/worker-1/drain`, {
        method: "POST",
        headers: { authorization: `Bearer ${tokens.admin}` },
        body: JSON.stringify({ reason: "maintenance" }),
      });
      expect(drain.status).toBe(200);
      expect(await until(() => run.lines.find((l) => l.event === "drain"), "the drain line")).toEqual({
        event: "drain",
        worker: "worker-1",
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

  it("serves https and wss with --tls-self-signed, writing the CA that clients trust to --tls-ca-out", async () => {
    const caFile = join(tmp.dir, "tls", "ca.pem");
    mkdirSync(dirname(caFile));
    // started as docs/deploy.md has operators start it, with glibc's malloc tuned for large frames
    const env = frameAllocatorEnv();
    const run = startBin(
      [
        "serve",
        ...["--model", tiny, "--port", "0", "--db", ":memory:", "--json"],
        ...["--tls-self-signed", "--tls-ca-out", caFile],
      ],
      { env },
    );
    try {
      const listening = await until(
        () => run.lines.find((l) => l.event === "listening"),
        `the listening line (stderr: ${run.stderr()})`,
      );
      expect(listening.url).toBe(`https://127.0.0.1:${listening.port}`);
      expect(listening.malloc).toBe(frameAllocatorState(env));
      expect(listening.relayUrl).toBe(`wss://127.0.0.1:${listening.port}/relay`);
      const tls = listening.tls as { selfSigned: boolean; ca: string; hosts: string[] };
      expect(tls.selfSigned).toBe(true);
      expect(tls.ca).toBe(caFile);
      expect(tls.hosts.slice(0, 3)).toEqual(["localhost", "127.0.0.1", "::1"]);
      const ca = readFileSync(caFile, "utf8");
      expect(new X509Certificate(ca).ca).toBe(true);
      const models = await call(`${listening.url}/api/models`, { ca });
      expect(json(models)).toMatchObject({ models: [{ experts: 8 }] });
      // by name too, and over wss for a worker that trusts the CA
      const byName = await call(`https://localhost:${listening.port}/api/models`, { ca });
      expect(byName.status).toBe(200);
      const tokens = listening.tokens as { worker: string };
      const conn = await connectRelay(listening.relayUrl as string, {
        role: "worker",
        id: "worker-1",
        token: tokens.worker,
        ca,
        reconnect: false,
      });
      await conn.close();
      // a client that does not trust the CA is refused by its own TLS check
      await expect(call(`${listening.url}/api/models`)).rejects.toMatchObject({
        code: expect.stringMatching(/UNABLE_TO_VERIFY_LEAF_SIGNATURE|SELF_SIGNED|UNABLE_TO_GET_ISSUER/),
      });
    } finally {
      run.child.kill("SIGTERM");
    }
    expect(await run.exited).toBe(0);
  });

  it("keeps its self-signed CA in the data directory: a restarted hub serves the CA its clients trust", async () => {
    const data = join(tmp.dir, "kept-data");
    const args = (host = "127.0.0.1") => [
      "serve",
      ...["--model", tiny, "--port", "0", "--host", host, "--data-dir", data, "--json", "--tls-self-signed"],
      ...["--tls-ca-out", join(data, "ca-for-workers.pem")],
    ];
    const serveOnce = async (host?: string) => {
      const run = startBin(args(host));
      try {
        const listening = await until(
          () => run.lines.find((l) => l.event === "listening"),
          `the listening line (stderr: ${run.stderr()})`,
        );
        return { run, listening, tls: listening.tls as { made: boolean; dir: string; ca: string } };
      } catch (error) {
        run.child.kill("SIGKILL");
        throw error;
      }
    };
    const first = await serveOnce();
    const ca1 = readFileSync(join(data, "tls", "ca.crt"), "utf8");
    expect(first.tls.made).toBe(true);
    expect(first.tls.dir).toBe(join(data, "tls"));
    expect(readFileSync(join(data, "ca-for-workers.pem"), "utf8")).toBe(ca1);
    expect(existsSync(join(data, "moeswarm-hub.db"))).toBe(true);
    first.run.child.kill("SIGTERM");
    expect(await first.run.exited).toBe(0);

    // the second process finds the CA and certificate and serves them: a client pinned to the
    // first CA connects over https and wss
    const second = await serveOnce();
    try {
      expect(second.tls.made).toBe(false);
      expect(readFileSync(join(data, "tls", "ca.crt"), "utf8")).toBe(ca1);
      expect((await call(`${second.listening.url}/api/models`, { ca: ca1 })).status).toBe(200);
      const conn = await connectRelay(second.listening.relayUrl as string, {
        role: "worker",
        id: "worker-1",
        token: (second.listening.tokens as { worker: string }).worker,
        ca: ca1,
        reconnect: false,
      });
      await conn.close();
    } finally {
      second.run.child.kill("SIGTERM");
    }
    expect(await second.run.exited).toBe(0);

    // other host names: a certificate for them, from a new CA
    const third = await serveOnce("127.0.0.2");
    try {
      expect(third.tls.made).toBe(true);
      const ca3 = readFileSync(join(data, "tls", "ca.crt"), "utf8");
      expect(ca3).not.toBe(ca1);
      expect((await call(`${third.listening.url}/api/models`, { ca: ca3 })).status).toBe(200);
    } finally {
      third.run.child.kill("SIGTERM");
    }
    expect(await third.run.exited).toBe(0);
  });

  it("says where the CA is in its human-readable output, and fails with one line without openssl", async () => {
    const cwd = join(tmp.dir, "cwd");
    mkdirSync(cwd);
    const args = ["serve", "--model", tiny, "--port", "0", "--db", ":memory:", "--tls-self-signed"];
    const run = startBin(args, { cwd });
    try {
      const line = await until(
        () => run.lines.find((l) => String(l.text).includes("CA certificate")),
        `the TLS line (stderr: ${run.stderr()})`,
      );
      // without --tls-ca-out: moeswarm-hub-ca.pem in the working directory, named in full
      const caPath = join(realpathSync(cwd), "moeswarm-hub-ca.pem");
      expect(line.text).toContain(`CA certificate: ${caPath}`);
      expect(run.lines.map((l) => l.text).join("\n")).toContain(`--ca ${caPath}`);
      expect(existsSync(caPath)).toBe(true);
    } finally {
      run.child.kill("SIGTERM");
    }
    expect(await run.exited).toBe(0);
    const noOpenssl = startBin(args, { cwd, env: { ...process.env, PATH: cwd } });
    expect(await noOpenssl.exited).toBe(1);
    expect(noOpenssl.stderr()).toMatch(/^moeswarm-hub: MOESWARM_HUB_TLS: .*openssl.*\n$/);
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
    // one token per peer: a worker or backbone token must name its id
    const unbound = await cli(["token", "--secret-file", secretFile, "--role", "backbone"]);
    expect([unbound.code, unbound.stderr]).toEqual([
      2,
      expect.stringContaining("--id <peer id> is required"),
    ]);
    expect((await cli(["token", "--secret-file", secretFile, "--role", "admin"])).code).toBe(0);
    const short = join(tmp.dir, "short");
    writeFileSync(short, "tiny");
    const bad = await cli(["token", "--secret-file", short, "--role", "admin"]);
    expect(bad.code).toBe(1);
    expect(bad.stderr).toMatch(/^moeswarm-hub: MOESWARM_INVALID_ARGUMENT: .*16 bytes/);
  });

  // The client sees the idle sockets closed a moment before the hub has counted them out of the
  // address's cap (its own close events, on a loaded machine later): a connection made in that
  // moment is refused at the socket ("socket hang up") before any HTTP, so it is made again; a
  // refusal at the socket never reaches /api/enrol, so it spends none of the enrolment tries.
  const enrolTry = async (port: number) => {
    for (let attempt = 0; ; attempt++) {
      try {
        return await call(`http://127.0.0.1:${port}/api/enrol`, {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ code: "not-a-code" }),
        });
      } catch (error) {
        const code = (error as NodeJS.ErrnoException).code;
        if (attempt >= 20 || (code !== "ECONNRESET" && code !== "EPIPE")) throw error;
        await sleep(100);
      }
    }
  };

  it("takes the connection limits as flags", async () => {
    const bad = await cli(["serve", "--model", tiny, "--db", ":memory:", "--max-connections", "0"]);
    expect(bad.code).toBe(2);
    expect(bad.stderr).toMatch(/--max-connections must be an integer/);
    const badRate = await cli(["serve", "--model", tiny, "--db", ":memory:", "--enrol-per-minute", "0"]);
    expect(badRate.code).toBe(2);
    expect(badRate.stderr).toMatch(/--enrol-per-minute must be an integer/);
    const run = startBin([
      "serve",
      ...["--model", tiny, "--port", "0", "--db", ":memory:", "--json"],
      ...["--max-connections-per-address", "3", "--idle-timeout", "1"],
      ...["--enrol-burst", "2", "--enrol-per-minute", "1"],
    ]);
    const sockets: Socket[] = [];
    try {
      const listening = await until(
        () => run.lines.find((l) => l.event === "listening"),
        `the listening line (stderr: ${run.stderr()})`,
      );
      const closed: number[] = [];
      const start = Date.now();
      for (let i = 0; i < 5; i++) {
        const s = connect({ port: listening.port as number, host: "127.0.0.1" });
        s.on("error", () => {});
        s.on("close", () => closed.push(Date.now() - start));
        sockets.push(s);
      }
      // two beyond the cap at once, the three others after the 1 s idle timeout
      await until(() => (closed.length >= 2 ? true : undefined), "the refusals", 900);
      expect(closed).toHaveLength(2);
      await until(() => (closed.length === 5 ? true : undefined), "the idle closes", 5000);
      expect(Math.max(...closed)).toBeGreaterThanOrEqual(900);
      // the enrolment tries per address: two wrong codes answered, the third refused
      const tries: number[] = [];
      for (let i = 0; i < 3; i++) {
        const a = await enrolTry(listening.port as number);
        tries.push(a.status);
        if (a.status === 429) {
          expect((json(a) as { error: { details: unknown } }).error.details).toEqual({
            burst: 2,
            perMinute: 1,
            retryAfterMs: 60_000,
          });
        }
      }
      expect(tries).toEqual([403, 403, 429]);
    } finally {
      for (const s of sockets) s.destroy();
      run.child.kill("SIGTERM");
    }
    expect(await run.exited).toBe(0);
  });

  it("explains itself", async () => {
    expect((await cli([])).code).toBe(2);
    const help = await cli(["serve", "--help"]);
    expect(help.code).toBe(0);
    const flags =
      "--model --port --host --tls-cert --tls-key --tls-self-signed --tls-ca-out --secret-file --db --data-dir --max-connections --max-connections-per-address --max-unauthenticated-per-address --idle-timeout --headers-timeout --enrol-burst --enrol-per-minute";
    for (const flag of flags.split(" ")) expect(help.stdout).toContain(flag);
    const unknown = await cli(["serve", "--nope"]);
    expect(unknown.code).toBe(2);
    expect(unknown.stderr).toMatch(/^moeswarm-hub: MOESWARM_INVALID_ARGUMENT: /);
    expect((await cli(["serve", "--port", "1"])).stderr).toMatch(/--model/);
    expect((await cli(["serve", "--model", tiny, "--tls-cert", "x"])).stderr).toMatch(/go together/);
    const both = await cli([
      "serve",
      "--model",
      tiny,
      "--tls-self-signed",
      "--tls-cert",
      "c",
      "--tls-key",
      "k",
    ]);
    expect(both.code).toBe(2);
    expect(both.stderr).toMatch(/not both/);
    const caOnly = await cli(["serve", "--model", tiny, "--tls-ca-out", "ca.pem"]);
    expect(caOnly.code).toBe(2);
    expect(caOnly.stderr).toMatch(/--tls-ca-out goes with --tls-self-signed/);
  });
});

// `moeswarm-hub pause <worker-id>`, `resume <worker-id>` and `pauses` (issue 19): the CLI talks
// to a running hub over HTTP with a token, as an operator (admin token) or a worker's owner (a
// worker token of the same owner) would; the hub's answer is printed in words or as JSON.
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../src/cli/run.js";
import { createHub, type Hub, mintToken } from "../src/index.js";
import { copyModel, syntheticModel, type TempDir, tempDir, waitFor } from "./hub-helpers.js";

const SECRET = "hub-pause-cli-secret-0123456789abcdef";

let tmp: TempDir;
let hub: Hub;
let url: string;
const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
const alice = (id: string) => mintToken({ role: "worker", id, owner: "alice", ttlS: 600 }, SECRET);

const sink = () => {
  const s = {
    text: "",
    write(t: string) {
      s.text += t;
      return true;
    },
  };
  return s;
};

/** Runs the CLI in this process; its exit status, stdout and stderr. */
async function cli(args: string[], env: NodeJS.ProcessEnv = {}) {
  const out = sink();
  const err = sink();
  const status = await runCli(args, { stdout: out as never, stderr: err as never, env });
  return { status, out: out.text, err: err.text };
}

beforeAll(async () => {
  tmp = tempDir("moeswarm-hub-pause-cli-");
  hub = createHub({
    secret: SECRET,
    models: [{ id: "tiny", path: copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf") }],
    store: join(tmp.dir, "hub.db"),
  });
  url = (await hub.listen(0)).url;
});

afterAll(async () => {
  await hub?.close();
  tmp?.remove();
});

describe("moeswarm-hub pause / resume / pauses", () => {
  it("pauses as the operator, lists, resumes: in words and as JSON", async () => {
    const p = await cli(["pause", "phone-1", "--hub", url, "--token", admin, "--reason", "maintenance"]);
    expect(p.err).toBe("");
    expect(p.status).toBe(0);
    // a worker this hub never saw: its pause waits for it, until the retention (30 days) ends
    expect(p.out).toMatch(
      /^worker phone-1 is paused by the operator since \d{4}-\d\d-\d\dT[\d:.]+Z: maintenance; the hub routes it nothing new until resumed; not seen since the pause \(no longer listed by the hub\); the pause is dropped at \d{4}-\d\d-\d\dT[\d:.]+Z unless it returns or is resumed\n$/,
    );
    const at = (await fetchJson(`/api/workers/phone-1/pause`)).hub.at as number;
    expect(p.out).toContain(new Date(at).toISOString());
    expect(p.out).toContain(`dropped at ${new Date(at + 30 * 86_400_000).toISOString()}`);

    // its owner pauses the tablet (its own token: a worker the hub has not seen has no other owner
    // it knows of), from MOESWARM_HUB and a token file
    const tokenFile = join(tmp.dir, "alice.token");
    writeFileSync(tokenFile, `${alice("tablet-1")}\n`);
    const j = await cli(["pause", "tablet-1", "--token-file", tokenFile, "--json"], { MOESWARM_HUB: url });
    expect(j.status).toBe(0);
    expect(JSON.parse(j.out)).toEqual({
      worker: "tablet-1",
      paused: true,
      hub: { at: expect.any(Number), by: "owner" },
      away: { listed: false, dropsAt: expect.any(Number) },
    });

    const list = await cli(["pauses", "--hub", url]);
    expect(list.status).toBe(0);
    const lines = list.out.trimEnd().split("\n");
    expect(lines[0]).toMatch(/^WORKER\s+PAUSED BY\s+SINCE\s+LAST SEEN\s+DROPPED AT\s+REASON$/);
    const drops = new Date(at + 30 * 86_400_000).toISOString();
    expect(lines.slice(1).map((l) => l.split(/\s{2,}/))).toEqual([
      ["phone-1", "the operator", new Date(at).toISOString(), "?", drops, "maintenance"],
      ["tablet-1", "its owner", expect.stringMatching(/Z$/), "?", expect.stringMatching(/Z$/)],
    ]);
    const listed = JSON.parse((await cli(["pauses", "--hub", url, "--token", admin, "--json"])).out);
    expect(listed).toEqual(await fetchJson("/api/pauses"));
    expect(listed.pauses.map((x: { worker: string }) => x.worker)).toEqual(["phone-1", "tablet-1"]);

    // resumed: by the operator, then the owner (MOESWARM_TOKEN)
    const r = await cli(["resume", "phone-1", "--hub", url, "--token", admin]);
    expect(r).toMatchObject({ status: 0, out: "worker phone-1 is not paused: the hub routes it work\n" });
    const r2 = await cli(["resume", "tablet-1", "--hub", url, "--json"], {
      MOESWARM_TOKEN: alice("tablet-1"),
    });
    expect(JSON.parse(r2.out)).toEqual({ worker: "tablet-1", paused: false });
    expect((await cli(["pauses", "--hub", url])).out).toBe("no worker is paused\n");
  });

  it("says what the hub refused (exit 1) and what the command line lacks (exit 2)", async () => {
    // another owner's worker token: the hub's 403, one line with its code
    await cli(["pause", "phone-2", "--hub", url, "--token", admin]);
    const mallory = mintToken({ role: "worker", id: "m1", owner: "mallory", ttlS: 600 }, SECRET);
    const refused = await cli(["resume", "phone-2", "--hub", url, "--token", mallory]);
    expect(refused.status).toBe(1);
    expect(refused.err).toMatch(
      /^moeswarm-hub: MOESWARM_HUB_NOT_OWNER: .*only its owner or the hub's operator/,
    );
    expect(refused.err.trimEnd().split("\n")).toHaveLength(1);
    expect((await fetchJson("/api/workers/phone-2/pause")).paused).toBe(true);
    const bad = await cli(["pause", "phone-2", "--hub", url, "--token", "not-a-token"]);
    expect(bad.status).toBe(1);
    expect(bad.err).toMatch(/^moeswarm-hub: MOESWARM_AUTH_/);
    // nobody listening there
    const gone = await cli(["pauses", "--hub", "http://127.0.0.1:1", "--token", admin]);
    expect(gone.status).toBe(1);
    expect(gone.err).toMatch(
      /^moeswarm-hub: MOESWARM_TRANSPORT_CONNECT: .*127\.0\.0\.1:1.*is the hub running/,
    );

    for (const [args, says] of [
      [["pause", "--hub", url, "--token", admin], "pause takes one worker id"],
      [["pause", "a", "b", "--hub", url, "--token", admin], "pause takes one worker id"],
      [["resume", "phone-2", "--token", admin], "--hub <url> is required"],
      [["pause", "phone-2", "--hub", url], "a token is required"],
      [["pause", "phone-2", "--hub", url, "--token", admin, "--token-file", "x"], "not both"],
      [
        ["pause", "phone-2", "--hub", url, "--token", admin, "--reason", "x".repeat(1025)],
        "at most 1024 bytes",
      ],
      [["pause", "phone-2", "--hub", "ftp://h", "--token", admin], "--hub"],
      [["pauses", "extra", "--hub", url], "Unexpected argument"],
      [
        ["pause", "phone-2", "--hub", url, "--token-file", join(tmp.dir, "missing")],
        "cannot read --token-file",
      ],
    ] as const) {
      const r = await cli([...args]);
      expect(r.status, args.join(" ")).toBe(2);
      expect(r.err).toContain(says);
    }
    expect((await fetchJson("/api/workers/phone-2/pause")).hub.by).toBe("operator");
  });

  it("serve --pause-retention <days> sets how long a paused worker may stay unseen", async () => {
    const model = join(tmp.dir, "tiny.gguf");
    const bad = await cli(["serve", "--model", model, "--db", ":memory:", "--pause-retention", "0"]);
    expect(bad.status).toBe(2);
    expect(bad.err).toContain('--pause-retention must be an integer in 1..3650, got "0"');
    expect((await cli(["serve", "--help"])).out).toContain("--pause-retention");
    const stop = new AbortController();
    const out = sink();
    const running = runCli(
      ["serve", "--model", model, "--db", ":memory:", "--port", "0", "--json", "--pause-retention", "2"],
      { stdout: out as never, stderr: sink() as never, env: {} },
      stop.signal,
    );
    try {
      await waitFor(() => out.text.includes('"listening"'), "serve listening");
      const ready = JSON.parse(out.text.split("\n").find((l) => l.includes('"listening"')) as string) as {
        url: string;
        tokens: { admin: string };
      };
      const p = await cli(["pause", "ghost", "--hub", ready.url, "--token", ready.tokens.admin, "--json"]);
      const state = JSON.parse(p.out) as { hub: { at: number }; away: { dropsAt: number } };
      expect(state.away.dropsAt).toBe(state.hub.at + 2 * 86_400_000);
    } finally {
      stop.abort();
      expect(await running).toBe(0);
    }
  });

  it("explains itself", async () => {
    const top = await cli(["--help"]);
    for (const name of ["pause", "resume", "pauses"]) expect(top.out).toMatch(new RegExp(`^  ${name} `, "m"));
    const help = await cli(["pause", "--help"]);
    expect(help.status).toBe(0);
    for (const flag of ["--hub", "--token", "--token-file", "--ca", "--reason", "--json"]) {
      expect(help.out).toContain(flag);
    }
    expect(help.out).toContain("usage: moeswarm-hub pause <worker-id>");
    expect((await cli(["pauses", "-h"])).out).toContain("usage: moeswarm-hub pauses");
  });
});

async function fetchJson(path: string) {
  const res = await fetch(`${url}${path}`, { headers: { authorization: `Bearer ${admin}` } });
  expect(res.status).toBe(200);
  // biome-ignore lint/suspicious/noExplicitAny: a JSON answer, probed by the assertions
  return (await res.json()) as Record<string, any>;
}

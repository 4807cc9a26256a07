// runCliProcess in a real process (it installs signal handlers and sets the exit code): the built
// package, as an executable's main.ts uses it.
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { beforeAll, describe, expect, it } from "vitest";

const DIST = fileURLToPath(new URL("../dist/index.js", import.meta.url));

/** Runs `body` (the CLI's run function) under runCliProcess; sends `signals` once it printed "ready". */
function runMain(body: string, options: string, signals: NodeJS.Signals[], argv: string[] = []) {
  const script = `import { runCliProcess } from ${JSON.stringify(DIST)};
runCliProcess(${body}, ${options});`;
  const child = spawn(process.execPath, ["--input-type=module", "-e", script, "node-e", ...argv], {
    stdio: "pipe",
  });
  let stdout = "";
  let stderr = "";
  child.stderr.on("data", (d: Buffer) => {
    stderr += d;
  });
  child.stdout.on("data", (d: Buffer) => {
    stdout += d;
    if (stdout.includes("ready") && signals.length > 0) {
      // one at a time: two of the same signal pending together are delivered once
      for (const [i, s] of signals.splice(0).entries()) setTimeout(() => child.kill(s), 100 * i);
    }
  });
  return new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve) => {
    child.on("exit", (code) => resolve({ code, stdout, stderr }));
  });
}

// waits (holding the process open) for the signal, then says what it was given
const WAITS = `(argv, io, signal) => new Promise((resolve) => {
  const alive = setInterval(() => {}, 1000);
  signal.addEventListener("abort", () => {
    clearInterval(alive);
    io.stdout.write("aborted " + String(signal.reason instanceof Error ? signal.reason.name : signal.reason) + "\\n");
    setTimeout(() => resolve(3), 20);
  });
  io.stdout.write("ready\\n");
})`;

describe("runCliProcess", () => {
  beforeAll(() => {
    if (!existsSync(DIST)) throw new Error(`${DIST} is missing: build @moeswarm/core first`);
  });

  it("aborts the CLI's signal on SIGTERM (plain, or with the signal's name) and exits with its status", async () => {
    const plain = await runMain(WAITS, `{ name: "t" }`, ["SIGTERM"]);
    expect(plain).toMatchObject({ code: 3, stdout: "ready\naborted AbortError\n" });
    const named = await runMain(WAITS, `{ name: "t", signalReason: true }`, ["SIGINT"]);
    expect(named).toMatchObject({ code: 3, stdout: "ready\naborted SIGINT\n" });
  });

  it("exits at once with 143 on a second SIGTERM", async () => {
    const never = `(argv, io) => { io.stdout.write("ready\\n"); return new Promise(() => setInterval(() => {}, 1000)); }`;
    expect((await runMain(never, `{ name: "t" }`, ["SIGTERM", "SIGTERM"])).code).toBe(143);
  });

  it("prints a rejection with the executable's name and exits 1; exitWhenDone ends despite open handles", async () => {
    const fails = `async () => { throw new Error("boom"); }`;
    expect(await runMain(fails, `{ name: "moeswarm-t" }`, [])).toMatchObject({
      code: 1,
      stderr: "moeswarm-t: Error: boom\n",
    });
    const lingers = `async () => { setInterval(() => {}, 1000); return 0; }`;
    expect((await runMain(lingers, `{ name: "t", exitWhenDone: true }`, [])).code).toBe(0);
  });

  it("answers --version (and --version --json) without running the CLI", async () => {
    const never = `async () => { throw new Error("must not run"); }`;
    const options = `{ name: "moeswarm-t", version: "1.2.3" }`;
    expect(await runMain(never, options, [], ["--version"])).toMatchObject({
      code: 0,
      stdout: "moeswarm-t 1.2.3\n",
    });
    const json = await runMain(never, options, [], ["--version", "--json"]);
    expect(json.code).toBe(0);
    expect(JSON.parse(json.stdout)).toEqual({ name: "moeswarm-t", version: "1.2.3" });
    // without a version the flag is the CLI's own business
    expect((await runMain(never, `{ name: "moeswarm-t" }`, [], ["--version"])).code).toBe(1);
  });
});

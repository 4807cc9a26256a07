import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, describe, expect, it, vi } from "vitest";

// trace.ts reads MOESWARM_TRACE once per module instance, so each case imports a fresh copy
async function freshTrace(dir: string | undefined): Promise<typeof import("../src/trace.js")> {
  vi.resetModules();
  if (dir === undefined) delete process.env.MOESWARM_TRACE;
  else process.env.MOESWARM_TRACE = dir;
  return import("../src/trace.js");
}

describe("traceHop", () => {
  const dirs: string[] = [];
  afterEach(() => {
    delete process.env.MOESWARM_TRACE;
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });

  it("records hops with monotonic nanosecond stamps and tags under MOESWARM_TRACE", async () => {
    const dir = mkdtempSync(join(tmpdir(), "moeswarm-trace-"));
    dirs.push(dir);
    const t = await freshTrace(join(dir, "sub"));
    expect(t.traceEnabled()).toBe(true);
    const before = process.hrtime.bigint();
    t.traceHop("a.send", 7);
    t.traceHop("b.recv");
    t.traceFlush();
    const after = process.hrtime.bigint();
    const file = join(dir, "sub", `trace-${process.pid}.tsv`);
    const lines = readFileSync(file, "utf8").replace(/\n$/, "").split("\n");
    expect(lines[0]).toMatch(new RegExp(`^# pid ${process.pid} `));
    const rows = lines.slice(1).map((l) => l.split("\t"));
    expect(rows.map((r) => [r[0], r[2]])).toEqual([
      ["a.send", "7"],
      ["b.recv", ""],
    ]);
    const stamps = rows.map((r) => BigInt(r[1] ?? "0"));
    expect(stamps[0]! >= before && stamps[0]! <= stamps[1]! && stamps[1]! <= after).toBe(true);
    // a second flush with nothing buffered appends nothing
    t.traceFlush();
    expect(readFileSync(file, "utf8").replace(/\n$/, "").split("\n")).toHaveLength(3);
  });

  it("writes nothing when MOESWARM_TRACE is unset", async () => {
    const dir = mkdtempSync(join(tmpdir(), "moeswarm-trace-"));
    dirs.push(dir);
    const t = await freshTrace(undefined);
    t.traceHop("x");
    t.traceFlush();
    expect(t.traceEnabled()).toBe(false);
    expect(readdirSync(dir)).toEqual([]);
  });
});

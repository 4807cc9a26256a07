// The glibc malloc tunables a launcher gives a process that moves large frames.
import { spawnSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import {
  FRAME_MALLOC_TUNABLES,
  frameAllocatorAdvice,
  frameAllocatorEnv,
  frameAllocatorState,
  hasFrameAllocatorEnv,
} from "../src/frame-allocator.js";

const OURS =
  "glibc.malloc.top_pad=67108864:glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432";

describe("frameAllocatorEnv", () => {
  it("adds the three tunables to an environment without any, and changes nothing else", () => {
    const env = { PATH: "/bin" };
    const out = frameAllocatorEnv(env);
    expect(out).toEqual({ PATH: "/bin", GLIBC_TUNABLES: OURS });
    expect(env).toEqual({ PATH: "/bin" }); // a copy
    expect(hasFrameAllocatorEnv(out)).toBe(true);
    expect(hasFrameAllocatorEnv(env)).toBe(false);
  });

  it("is what docs/deploy.md tells operators to set", () => {
    const doc = readFileSync(new URL("../../../docs/deploy.md", import.meta.url), "utf8");
    expect(/^GLIBC_TUNABLES=(\S+)$/m.exec(doc)?.[1]).toBe(frameAllocatorEnv({}).GLIBC_TUNABLES);
  });

  it("keeps the tunables already given, an operator's own value of ours included", () => {
    const out = frameAllocatorEnv({
      GLIBC_TUNABLES: "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=1",
    });
    expect(out.GLIBC_TUNABLES).toBe(
      "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=1:glibc.malloc.top_pad=67108864:glibc.malloc.mmap_threshold=33554432",
    );
    // given twice, nothing is added the second time
    expect(frameAllocatorEnv(out).GLIBC_TUNABLES).toBe(out.GLIBC_TUNABLES);
    expect(hasFrameAllocatorEnv({ GLIBC_TUNABLES: "glibc.malloc.top_pad=1" })).toBe(false);
  });

  it("tells a tuned process from glibc's defaults, and says when there is no glibc to tune", () => {
    expect(frameAllocatorState(frameAllocatorEnv({}), true)).toBe("tuned");
    expect(frameAllocatorState({}, true)).toBe("glibc defaults");
    expect(frameAllocatorState({ GLIBC_TUNABLES: "glibc.malloc.top_pad=1" }, true)).toBe("glibc defaults");
    expect(frameAllocatorState(frameAllocatorEnv({}), false)).toBe("not glibc");
    // advice only where there is something to set, and it gives the whole value
    expect(frameAllocatorAdvice("tuned")).toBeUndefined();
    expect(frameAllocatorAdvice("not glibc")).toBeUndefined();
    expect(frameAllocatorAdvice("glibc defaults")).toContain(
      `GLIBC_TUNABLES=${frameAllocatorEnv({}).GLIBC_TUNABLES} `,
    );
    // asked of this process's own C library: Debian's Node runs on glibc
    const report = process.report as unknown as { excludeNetwork?: boolean };
    const before = report.excludeNetwork;
    const here = frameAllocatorState({});
    expect(report.excludeNetwork).toBe(before);
    const header = (process.report.getReport() as { header: { glibcVersionRuntime?: string } }).header;
    expect(here).toBe(header.glibcVersionRuntime ? "glibc defaults" : "not glibc");
  });

  // glibc's loader lists the tunables as it parsed them from GLIBC_TUNABLES (glibc >= 2.33)
  const loader = "/lib64/ld-linux-x86-64.so.2";
  const listed = existsSync(loader)
    ? spawnSync(loader, ["--list-tunables"], { encoding: "utf8" })
    : undefined;
  const canList = listed?.status === 0 && listed.stdout.includes("glibc.malloc.top_pad");
  if (!canList)
    console.log(`frame-allocator: skipped the glibc check: ${loader} cannot list its tunables here`);
  it.skipIf(!canList)("gives glibc the values it names, as glibc reads them", () => {
    const out = spawnSync(loader, ["--list-tunables"], { env: frameAllocatorEnv({}), encoding: "utf8" });
    const parsed = Object.fromEntries(
      [...out.stdout.matchAll(/^(glibc\.malloc\.\w+): (0x[0-9a-f]+)/gm)].map((m) => [m[1], Number(m[2])]),
    );
    for (const [key, value] of Object.entries(FRAME_MALLOC_TUNABLES)) expect(parsed[key]).toBe(value);
  });
});

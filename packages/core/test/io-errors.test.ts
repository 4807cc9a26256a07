// errorFromSystemError with errors the file system really raises (this runs as root, so EACCES
// cannot be provoked: ENOSPC comes from /dev/full, ENOTDIR from a file where a directory goes).
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { open, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { errorFromSystemError, HubError, IoError, isMoeswarmError } from "../src/index.js";

const dir = mkdtempSync(join(tmpdir(), "moeswarm-io-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

async function failure(fn: () => Promise<unknown>): Promise<unknown> {
  try {
    await fn();
  } catch (error) {
    return error;
  }
  throw new Error("expected a failure");
}

describe("errorFromSystemError", () => {
  it.runIf(process.platform === "linux")(
    "maps ENOSPC (a write to /dev/full) to MOESWARM_IO_NO_SPACE",
    async () => {
      const raw = await failure(async () => {
        const file = await open("/dev/full", "w");
        try {
          await file.write(Buffer.alloc(4096));
        } finally {
          await file.close();
        }
      });
      expect((raw as NodeJS.ErrnoException).code).toBe("ENOSPC");
      const e = errorFromSystemError(raw, "writing the slice");
      expect(e).toBeInstanceOf(IoError);
      expect(e.code).toBe("MOESWARM_IO_NO_SPACE");
      expect(e.message).toMatch(/^writing the slice: .*ENOSPC/);
      expect(e.cause).toBe(raw);
      expect(e.details).toMatchObject({ code: "ENOSPC", syscall: "write" });
    },
  );

  it("maps ENOTDIR and ENOENT (a file where a directory goes, a missing file) to MOESWARM_IO_NOT_FOUND", async () => {
    const file = join(dir, "a-file");
    writeFileSync(file, "x");
    const notDir = await failure(() => writeFile(join(file, "child"), "y"));
    expect((notDir as NodeJS.ErrnoException).code).toBe("ENOTDIR");
    const e = errorFromSystemError(notDir, "writing child");
    expect(e.code).toBe("MOESWARM_IO_NOT_FOUND");
    expect(e.details).toMatchObject({ code: "ENOTDIR", path: join(file, "child") });
    const missing = await failure(() => open(join(dir, "absent")));
    expect(errorFromSystemError(missing, "opening").code).toBe("MOESWARM_IO_NOT_FOUND");
  });

  it("maps the access codes, the open-file limits and the rest by Node's code", () => {
    const sys = (code: string) => Object.assign(new Error(`${code}: x`), { code, syscall: "open" });
    for (const code of ["EACCES", "EPERM", "EROFS"]) {
      expect(errorFromSystemError(sys(code), "c").code).toBe("MOESWARM_IO_ACCESS");
    }
    expect(errorFromSystemError(sys("EDQUOT"), "c").code).toBe("MOESWARM_IO_NO_SPACE");
    expect(errorFromSystemError(sys("EMFILE"), "c").code).toBe("MOESWARM_IO_TOO_MANY_FILES");
    expect(errorFromSystemError(sys("EIO"), "c").code).toBe("MOESWARM_IO_FAILED");
    expect(errorFromSystemError("weird", "c").code).toBe("MOESWARM_IO_FAILED");
    // a moeswarm error already says what happened
    const hub = new HubError("MOESWARM_HUB_STORE", "s");
    expect(errorFromSystemError(hub, "c")).toBe(hub);
    expect(isMoeswarmError(new IoError("disk"), "MOESWARM_IO_FAILED")).toBe(true);
  });
});

// writeFileAtomically's failures with real file-system errors: a full disk (/dev/full gives
// ENOSPC) and a file where a directory is expected (ENOTDIR). As root, EACCES cannot be provoked.
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { open } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { IoError } from "@moeswarm/core";
import { afterAll, describe, expect, it } from "vitest";
import { writeAll, writeFileAtomically } from "../src/atomic-file.js";

const dir = mkdtempSync(join(tmpdir(), "moeswarm-atomic-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("writeFileAtomically", () => {
  it.runIf(process.platform === "linux")(
    "reports a full disk as MOESWARM_IO_NO_SPACE and leaves no temporary file",
    async () => {
      const target = join(dir, "slice.gguf");
      const failure = writeFileAtomically(target, async (handle) => {
        await writeAll(handle, new Uint8Array(16));
        // the disk fills up half way: a real ENOSPC from the kernel
        const full = await open("/dev/full", "w");
        try {
          await writeAll(full, new Uint8Array(4096));
        } finally {
          await full.close();
        }
      });
      await expect(failure).rejects.toBeInstanceOf(IoError);
      await expect(failure).rejects.toMatchObject({
        code: "MOESWARM_IO_NO_SPACE",
        message: expect.stringMatching(/^writing .*slice\.gguf: .*ENOSPC/),
        details: { code: "ENOSPC" },
      });
      expect(readdirSync(dir).filter((f) => f.startsWith("slice.gguf"))).toEqual([]);
    },
  );

  it("reports a file where the directory should be as MOESWARM_IO_NOT_FOUND", async () => {
    const file = join(dir, "not-a-dir");
    writeFileSync(file, "x");
    await expect(writeFileAtomically(join(file, "out.gguf"), async () => {})).rejects.toMatchObject({
      code: "MOESWARM_IO_NOT_FOUND",
      details: { code: "ENOTDIR" },
    });
  });

  it("passes a moeswarm error through and writes a whole file otherwise", async () => {
    const target = join(dir, "ok.bin");
    await writeFileAtomically(target, (h) => writeAll(h, new Uint8Array([1, 2, 3])));
    expect([...readFileSync(target)]).toEqual([1, 2, 3]);
    const own = new IoError("MOESWARM_IO_ACCESS", "mine");
    await expect(
      writeFileAtomically(join(dir, "no.bin"), async () => {
        throw own;
      }),
    ).rejects.toBe(own);
  });
});

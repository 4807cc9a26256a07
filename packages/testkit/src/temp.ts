import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

export interface TempDir {
  readonly dir: string;
  /** Deletes the folder and everything in it (nothing happens when it is gone already). */
  remove(): void;
}

/**
 * A fresh folder under the OS's temporary directory, named `<prefix><random>`. Keep the prefix
 * short where the folder holds Unix sockets: their paths must stay under 108 bytes.
 */
export function tempDir(prefix = "moeswarm-"): TempDir {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  return { dir, remove: () => rmSync(dir, { recursive: true, force: true }) };
}

import { readdirSync } from "node:fs";
import { join } from "node:path";
import { defineProject } from "vitest/config";

const packagesDir = join(import.meta.dirname, "packages");

// Tests import the workspace's packages from their sources, not their dist/: edit core, run
// dispatch's tests, and they see the change without a rebuild. (Spawned processes — bins, the
// native executables, the examples' CJS consumers — still run what `pnpm build` produced.)
const sourceAliases = readdirSync(packagesDir, { withFileTypes: true })
  .filter((entry) => entry.isDirectory())
  .map((entry) => ({
    find: new RegExp(`^@moeswarm/${entry.name}$`),
    replacement: join(packagesDir, entry.name, "src", "index.ts"),
  }));

/** Per-package vitest settings: tests live in test/, long native/network work gets room. */
export function packageTests(name: string, extra: { testTimeout?: number } = {}) {
  return defineProject({
    resolve: { alias: sourceAliases },
    test: {
      name,
      include: ["test/**/*.test.ts"],
      environment: "node",
      testTimeout: extra.testTimeout ?? 30_000,
      hookTimeout: 120_000,
    },
  });
}

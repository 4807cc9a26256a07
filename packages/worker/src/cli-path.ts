import { fileURLToPath } from "node:url";

/**
 * The `moeswarm-worker` executable script, for an embedder that starts workers as processes of
 * their own (`spawn(process.execPath, [workerCliPath(), "--hub", ...])`). Resolved from the
 * package's root, so it is the same file whether this module runs from `dist/` or, in the
 * repository's tests, from `src/`; it exists once the package is built.
 */
export function workerCliPath(): string {
  return fileURLToPath(new URL("../dist/worker-cli.js", import.meta.url));
}

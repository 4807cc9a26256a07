import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";
import { errorFromCode } from "../src/error-from-code.js";
import { armVariantFor, expertWorkerPath, nativeStatus, probeNative } from "../src/index.js";
import { failureMessage, probe } from "../src/native-binding.js";

describe("loading the native code", () => {
  it("probes the candidates in a child process and says which one is in use", async () => {
    const status = await probeNative();
    expect(nativeStatus()).toBe(status);
    for (const c of status.candidates)
      expect(["MOESWARM_NATIVE_ADDON", "local build", "platform package", "prebuild"]).toContain(c.kind);
    // every candidate before the one in use failed, and says why
    for (const c of status.candidates.slice(0, -1)) expect(c.reason).toBeTypeOf("string");
    if (status.available) {
      expect(status.candidates.filter((c) => c.ok).map((c) => c.path)).toEqual([status.path]);
      expect(status.cpu).toBeTypeOf("string");
    } else {
      expect(status.message).toMatch(/possible solutions/);
    }
    // a second call does not probe again
    expect(await probeNative()).toBe(status);
  });

  it("a broken binary fails its probe without touching this process, with a readable reason", async () => {
    const tmp = tempDir("moeswarm-wn-");
    try {
      const bogus = join(tmp.dir, "bogus.node");
      writeFileSync(bogus, "not an ELF file");
      const r = await probe(bogus);
      expect(r.ok).toBe(false);
      expect(r.reason).toMatch(/probe failed/);
      const msg = failureMessage([
        {
          kind: "local build",
          path: "/x/build/linux-x64/moeswarm_expert.node",
          ok: false,
          reason: "not found",
        },
        { kind: "prebuild", path: bogus, ok: false, reason: r.reason! },
      ]);
      expect(msg.split("\n")[0]).toMatch(/not available/);
      expect(msg).toMatch(
        /candidates tried:\n {4}- local build .*: not found\n {4}- prebuild .*probe failed/,
      );
      expect(msg).toMatch(
        /possible solutions:[\s\S]*(npm install @moeswarm\/worker-native-|no prebuilt addon)[\s\S]*backend: "ts"/,
      );
    } finally {
      tmp.remove();
    }
  });

  it("picks the aarch64 variant from /proc/cpuinfo", () => {
    const pixel =
      "processor\t: 0\nBogoMIPS\t: 38.40\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n";
    const pi4 = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\n";
    expect(armVariantFor(pixel)).toBe("armv82");
    expect(armVariantFor(pi4)).toBe("armv8a");
    expect(armVariantFor("")).toBe("armv8a");
  });

  it("finds the prebuilt executables by target and variant", () => {
    let path: string | undefined;
    try {
      path = expertWorkerPath({ target: "linux-x64" });
    } catch (error) {
      expect(error).toMatchObject({ code: "MOESWARM_NATIVE_PACKAGE_MISSING" });
      expect((error as Error).message).toContain("npm install @moeswarm/worker-native-linux-x64");
    }
    // the platform package when it is staged, else the monorepo's prebuilds/
    if (path) expect(path).toMatch(/(worker-native-linux-x64|prebuilds\/linux-x64)\/moeswarm-expert-worker$/);
    try {
      expect(expertWorkerPath({ target: "android-arm64", variant: "armv82" })).toMatch(
        /android-arm64\/moeswarm-expert-worker-armv82$/,
      );
    } catch (error) {
      // not built here: the platform package to install is named (with npm's --os/--cpu)
      expect(error).toMatchObject({ code: "MOESWARM_NATIVE_PACKAGE_MISSING" });
      expect((error as Error).message).toContain("@moeswarm/worker-native-android-arm64");
    }
  });

  it("turns codes from the native side into the typed error classes", () => {
    expect(errorFromCode("MOESWARM_GGUF_TRUNCATED", "cut")).toMatchObject({
      name: "GgufError",
      code: "MOESWARM_GGUF_TRUNCATED",
      message: "cut",
    });
    expect(errorFromCode("MOESWARM_PROTOCOL_BAD_FIELD", "x")).toMatchObject({ name: "ProtocolError" });
    expect(errorFromCode("MOESWARM_NATIVE_CLOSED", "x")).toMatchObject({ name: "NativeError" });
    expect(errorFromCode("MOESWARM_FROM_THE_FUTURE", "x")).toMatchObject({
      name: "NativeError",
      code: "MOESWARM_NATIVE_COMPUTE",
      details: { code: "MOESWARM_FROM_THE_FUTURE" },
    });
  });
});

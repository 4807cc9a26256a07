// The bridge in its hub form: only the hub's URL, a backbone token and the model id. llama-cpu
// worker processes join and leave the hub's relay while the bridge runs; it follows the hub's
// placement (no restart), every decode stays bit-identical to plain llama.cpp without falling back,
// and the routing statistics and receipts reach the hub (credits, tokens/s).
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { frameAllocatorState } from "@moeswarm/core";
import { mintToken } from "@moeswarm/hub";
import { captureStream } from "@moeswarm/testkit";
import { Agent, request } from "undici";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runDispatcherCli } from "../src/cli/run.js";
import {
  type BackboneBridge,
  createLocalFallback,
  type LocalFallback,
  runLogitsHarness,
  serveBackboneBridge,
} from "../src/index.js";
import { firstByteDiff, type LoopbackCerts, nativeMissing, split } from "./helpers.js";
import { useRelaySwarm } from "./relay-swarm-fixture.js";

const missing = nativeMissing();
const SECRET = "backbone-hub-bridge-test-secret-0123";
const MODEL_ID = "followed";
const N_PREDICT = 48;

describe.skipIf(Boolean(missing))("serveBackboneBridge({hub}): follows the hub's placement", () => {
  // fake workers register without claiming, one copy per expert, stats not routed through the
  // relay: the hub's trust defaults are tested in @moeswarm/hub
  const fx = useRelaySwarm({
    prefix: "mswb-hubb-",
    secret: SECRET,
    model: MODEL_ID,
    preset: "small",
    tls: true,
  });
  let certs: LoopbackCerts;
  let agent: Agent;
  let fallback: LocalFallback;

  /** A llama-cpu process on a slice, and its relay connection registering that slice. */
  const join_ = async (id: string, experts: number[]) => {
    await fx.swarm.join(id, experts);
  };

  const getJson = async <T>(path: string): Promise<T> => {
    const r = await request(`${fx.url}${path}`, { dispatcher: agent });
    expect(r.statusCode).toBe(200);
    return (await r.body.json()) as T;
  };

  beforeAll(async () => {
    certs = fx.swarm.certs!;
    agent = new Agent({ connect: { ca: certs.ca } });
    // there, but never needed while the swarm covers every expert (the test checks it stays unused)
    fallback = await createLocalFallback(fx.modelPath);
  });
  afterAll(async () => {
    // the fixture closes the swarm after this
    await fallback?.close();
    await agent?.close();
  });

  /** An operator drains a worker (`POST /api/workers/:id/drain`); the answer's status. */
  async function drain(id: string): Promise<number> {
    const drained = await request(`${fx.url}/api/workers/${id}/drain`, {
      method: "POST",
      dispatcher: agent,
      headers: {
        authorization: `Bearer ${mintToken({ role: "admin", ttlS: 600 }, SECRET)}`,
        "content-type": "application/json",
      },
      body: "{}",
    });
    await drained.body.dump();
    return drained.statusCode;
  }

  it("workers join and leave; decodes stay bit-identical, never fall back, and stats reach the hub", async () => {
    const [lo, hi] = split(fx.info.nExpert, 2) as [number[], number[]];
    const all = [...lo, ...hi];
    await Promise.all([join_("hw0", lo), join_("hw1", hi)]);

    await using bridge: BackboneBridge = await serveBackboneBridge({
      socket: join(fx.tmp.dir, "hub.sock"),
      hub: {
        url: fx.url,
        token: mintToken({ role: "backbone", id: "bb-hub-test", ttlS: 3600 }, SECRET),
        model: MODEL_ID,
        ca: certs.ca,
        statsIntervalMs: 0, // reports on demand below, so the last one is known
        pollWaitS: 10,
      },
      fallback: fallback.compute,
      // one owner per expert, and "never falls back" is the point: the test's own workers
      trust: "own",
    });
    const link = bridge.hub!;
    expect(link.id).toBe("bb-hub-test");
    const complete = await link.waitForPlacement((p) => p.missing.length === 0);
    expect([...complete.workers].sort()).toEqual(["hw0", "hw1"]);

    const common = {
      modelPath: fx.modelPath,
      prompt: "Workers come and go",
      nPredict: N_PREDICT,
      threads: 1,
    };
    const plainLogits = join(fx.tmp.dir, "plain.bin");
    const plain = await runLogitsHarness({ ...common, logitsPath: plainLogits });
    expect(plain.ok, plain.stderr).toBe(true);
    const decode = async (name: string) => {
      const logitsPath = join(fx.tmp.dir, `${name}.bin`);
      const r = await runLogitsHarness({
        ...common,
        logitsPath,
        plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
      });
      expect(r.ok, r.stderr).toBe(true);
      expect(r.tokens).toEqual(plain.tokens);
      expect(firstByteDiff(readFileSync(logitsPath), readFileSync(plainLogits))).toBe(-1);
      return bridge.metrics();
    };
    const requestsOf = (m: ReturnType<BackboneBridge["metrics"]>, id: string) =>
      m.dispatch.owners[id]?.requests ?? 0;

    // 1. two workers, each half of the experts
    const m1 = await decode("two");
    expect(requestsOf(m1, "hw0")).toBeGreaterThan(0);
    expect(requestsOf(m1, "hw1")).toBeGreaterThan(0);

    // 2. a third worker with every expert joins, an operator drains hw1
    await join_("hw2", all);
    const withThird = await link.waitForPlacement((p) => p.workers.includes("hw2"));
    expect(withThird.version).toBeGreaterThan(complete.version);
    expect(await drain("hw1")).toBe(200);
    const afterDrain = await link.waitForPlacement((p) => !p.workers.includes("hw1"));
    expect(afterDrain.version).toBeGreaterThan(withThird.version);
    expect(afterDrain.missing).toEqual([]);
    const m2 = await decode("drained");
    expect(requestsOf(m2, "hw1")).toBe(requestsOf(m1, "hw1")); // no longer chosen
    expect(requestsOf(m2, "hw2")).toBeGreaterThan(0); // the newcomer is used

    // 3. hw0 dies (its process and its relay connection): hw2 alone covers the model
    await fx.swarm.connections.get("hw0")!.close();
    await fx.swarm.processes.get("hw0")!.close();
    const alone = await link.waitForPlacement((p) => !p.workers.includes("hw0"));
    expect([...alone.workers]).toEqual(["hw2"]);
    const m3 = await decode("alone");
    expect(requestsOf(m3, "hw0")).toBe(requestsOf(m2, "hw0"));
    expect(requestsOf(m3, "hw2")).toBeGreaterThan(requestsOf(m2, "hw2"));

    // never a failover or a fallback: each decode ran on the placement of its time
    expect(m3.failed).toBe(0);
    expect(m3.failovers).toBe(0);
    expect(m3.fallbacks).toBe(0);
    expect(fallback.started).toBe(false);
    expect(m3.hub).toMatchObject({
      placementVersion: alone.version,
      workers: 1,
      missingExperts: 0,
      pollErrors: 0,
    });
    expect(m3.hub!.placementUpdates).toBeGreaterThanOrEqual(3);

    // 4. the statistics: receipts become the workers' credits, tokens/s shows on the status
    const outcome = await link.reportStats();
    expect(outcome?.accepted).toBe(true);
    expect([...outcome!.credited].sort()).toEqual(["hw0", "hw1", "hw2"]);
    const { workers } = await getJson<{ workers: Array<{ id: string; credits: { expertTokens: number } }> }>(
      "/api/workers",
    );
    for (const id of ["hw0", "hw1", "hw2"]) {
      const credited = workers.find((w) => w.id === id)?.credits.expertTokens;
      // exactly the (token, expert) pairs each computed for this backbone
      expect(credited).toBe(m3.dispatch.owners[id]!.slots);
      expect(credited).toBeGreaterThan(0);
    }
    const status = await getJson<{ tokensPerSecond: number }>(`/api/status?model=${MODEL_ID}`);
    expect(status.tokensPerSecond).toBeGreaterThan(0);
    expect(bridge.metrics().hub).toMatchObject({ statsAccepted: 1, statsErrors: 0 });
  }, 90_000); // four worker processes join and leave: 27 s alone on a loaded machine, too near the default 30 s

  it("moeswarm-dispatcher --hub: the bridge beside a llama-server, from the hub's URL and a token file", async () => {
    await join_("hc", [...Array(fx.info.nExpert).keys()]);
    const tokenFile = join(fx.tmp.dir, "backbone.token");
    writeFileSync(tokenFile, `${mintToken({ role: "backbone", id: "bb-cli", ttlS: 3600 }, SECRET)}\n`);
    const caFile = join(fx.tmp.dir, "ca.pem");
    writeFileSync(caFile, certs.ca);
    const out = captureStream();
    const err = captureStream();
    const controller = new AbortController();
    const exit = runDispatcherCli(
      [
        ...[
          "--socket",
          join(fx.tmp.dir, "cli.sock"),
          "--hub",
          fx.url,
          "--token-file",
          tokenFile,
          "--ca",
          caFile,
        ],
        ...["--model-id", MODEL_ID, "--model", fx.modelPath, "--no-fallback", "--json"],
      ],
      { stdout: out.stream, stderr: err.stream },
      controller.signal,
    );
    const early = exit.then((code) => {
      throw new Error(`moeswarm-dispatcher exited with ${code}: ${err.text()}`);
    });
    const listening = JSON.parse(await Promise.race([out.line(/"event":"listening"/), early])) as {
      address: string;
      override: string;
      id: string;
      workers: string[];
      malloc: string;
    };
    expect(listening.id).toBe("bb-cli");
    expect(listening.workers).toContain("hc");
    // the dispatcher receives large results: it says how malloc is set (core frameAllocatorState)
    expect(listening.malloc).toBe(frameAllocatorState());
    const common = { modelPath: fx.modelPath, prompt: "A dispatcher with a hub", nPredict: 16, threads: 1 };
    const plain = await runLogitsHarness({ ...common, logitsPath: join(fx.tmp.dir, "cli-plain.bin") });
    const remote = await runLogitsHarness({
      ...common,
      logitsPath: join(fx.tmp.dir, "cli-remote.bin"),
      overrides: [listening.override],
      plugin: { bridge: listening.address, model: MODEL_ID },
    });
    expect(remote.ok, remote.stderr).toBe(true);
    expect(remote.tokens).toEqual(plain.tokens);
    expect(
      firstByteDiff(
        readFileSync(join(fx.tmp.dir, "cli-remote.bin")),
        readFileSync(join(fx.tmp.dir, "cli-plain.bin")),
      ),
    ).toBe(-1);
    controller.abort();
    expect(await exit).toBe(0);
    const metrics = JSON.parse(await out.line(/"event":"metrics"/)) as {
      failed: number;
      hub: { relay: string; statsAccepted: number; statsErrors: number };
    };
    expect(metrics.failed).toBe(0);
    // printed after the close: the relay connection is closed, the final report was accepted
    expect(metrics.hub).toMatchObject({ relay: "closed", statsErrors: 0 });
    expect(metrics.hub.statsAccepted).toBeGreaterThanOrEqual(1);
    expect(err.text()).toBe("");
    // the final report at exit reached the hub: bb-cli's rate is listed
    const status = await getJson<{ backbones: Array<{ id: string; tokensPerSecond: number }> }>(
      `/api/status?model=${MODEL_ID}`,
    );
    expect(status.backbones.find((b) => b.id === "bb-cli")?.tokensPerSecond).toBeGreaterThan(0);
  });
});

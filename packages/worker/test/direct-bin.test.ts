// The built `moeswarm-worker --listen` as its own process: it publishes its endpoint, a backbone
// dials it (certificate pinned, a ticket from the hub) and gets the bits of a local compute; then
// the process is frozen (SIGSTOP): the backbone's heartbeat cuts the silent link and the worker's
// requests go over the relay, which are answered once the process runs again (SIGCONT); SIGTERM
// drains it (exit 0), and what it answered directly reaches the hub's credits where the
// backbone's receipts agree.
import type { ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import type { PlacementRegistrationJson } from "@moeswarm/core";
import { type Hub, mintToken } from "@moeswarm/hub";
import { connectRelay, type DirectLinkEvent, DirectTransport, RelayTransport } from "@moeswarm/relay-client";
import { type TempDir, waitFor } from "@moeswarm/testkit";
import { loadExpertCompute } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { WorkerEvent } from "../src/events.js";
import { spawnWorkerBin, startTestHub, WORKER_BIN, waitPlacement } from "./fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-direct-bin-secret-0123456789ab";
const N = 2;
const EMBD = 64;

let hub: Hub;
let url: string;
let relayUrl: string;
let modelPath: string;
let work: TempDir | undefined;
let child: ChildProcess | undefined;

beforeAll(async () => {
  if (!existsSync(WORKER_BIN))
    throw new Error(`${WORKER_BIN} is missing: run \`pnpm --filter @moeswarm/worker build\` first`);
  ({ hub, url, relayUrl, modelPath, work } = await startTestHub({
    secret: SECRET,
    model: MODEL,
    preset: "tiny",
    workPrefix: "moeswarm-direct-bin-",
  }));
});
afterAll(async () => {
  if (child && child.exitCode === null && child.signalCode === null) {
    child.kill("SIGCONT");
    child.kill("SIGKILL");
  }
  await hub?.close();
  work?.remove();
});

const req = () => ({
  model: MODEL,
  layer: 0,
  n: N,
  embd: EMBD,
  k: 2,
  dtype: "f32" as const,
  x: Float32Array.from({ length: N * EMBD }, (_, i) => Math.cos(i * 0.13)),
  ids: Int32Array.from([3, 6, 0, 1]),
  mode: "each" as const,
});
const bytes = (a: Float32Array | Float64Array) => Buffer.from(a.buffer, a.byteOffset, a.byteLength);

describe("moeswarm-worker --listen (the built bin, its own process)", () => {
  it("serves a backbone directly; frozen, its link is cut and the relay takes over; credited after the drain", async () => {
    const bin = spawnWorkerBin([
      "--hub",
      url,
      "--token",
      mintToken({ role: "worker", id: "wbin", ttlS: 600 }, SECRET),
      "--capacity",
      "10000000",
      "--cache-dir",
      join(work!.dir, "cache"),
      "--backend",
      "ts",
      "--poll",
      "0.1",
      "--listen",
      "127.0.0.1:0",
    ]);
    child = bin.child;
    const { events, exited } = bin;

    const p = await waitPlacement(url, MODEL, "wbin's slice with its endpoint", (pl) =>
      pl.registrations.some((r) => r.id === "wbin" && (r as PlacementRegistrationJson).direct !== undefined),
    );
    const reg = p.registrations.find((r) => r.id === "wbin") as PlacementRegistrationJson;
    const announced = events.find((e) => e.event === "direct") as Extract<WorkerEvent, { event: "direct" }>;
    expect(announced, bin.stderr).toBeDefined();
    expect(reg.direct).toEqual({
      endpoints: [`wss://127.0.0.1:${announced.port}`],
      fingerprint: announced.fingerprint,
    });

    const bbToken = mintToken({ role: "backbone", id: "bb", ttlS: 600 }, SECRET);
    await using relay = await connectRelay(relayUrl, { role: "backbone", id: "bb", token: bbToken });
    const links: DirectLinkEvent[] = [];
    const t = new DirectTransport({
      fallback: new RelayTransport(relay),
      id: "bb",
      ticket: async (worker) => {
        const r = await fetch(`${url}/api/direct/tickets`, {
          method: "POST",
          headers: { authorization: `Bearer ${bbToken}`, "content-type": "application/json" },
          body: JSON.stringify({ worker }),
        });
        return ((await r.json()) as { ticket: string }).ticket;
      },
      heartbeatMs: 200,
      deadPeerMs: 1500,
      backoff: { initialDelayMs: 600_000, jitter: 0 },
      onEvent: (e) => links.push(e),
    });
    try {
      t.update(new Map([["wbin", reg.direct!]]));
      expect(await t.linked("wbin")).toBe(true);
      await using local = await loadExpertCompute(modelPath, { backend: "ts" });
      const r0 = req();
      const want = await local.run({ layer: r0.layer, x: r0.x, ids: r0.ids, k: r0.k, mode: r0.mode });
      const call = () => ({ signal: new AbortController().signal, deadlineMs: 30_000 });
      const got = await t.request("wbin", req(), call());
      expect(bytes(got.y)).toEqual(bytes(want));
      expect(t.counters()).toMatchObject({ direct: 1, relay: 0 });

      // frozen: the backbone's heartbeat finds the link silent and cuts it
      child.kill("SIGSTOP");
      await waitFor(() => links.some((e) => e.type === "lost"), "the frozen worker's link to be cut", 20_000);
      expect(t.counters().linked).toEqual([]);
      // a request now goes over the relay (the same process answers it once it runs again)
      const viaRelay = t.request("wbin", req(), call());
      child.kill("SIGCONT");
      expect(bytes((await viaRelay).y)).toEqual(bytes(want));
      expect(t.counters()).toMatchObject({ direct: 1, relay: 1 });
    } finally {
      await t.close();
    }

    // SIGTERM drains (the direct endpoint's last counts go to the hub), exit 0
    child.kill("SIGTERM");
    expect(await exited, bin.stderr).toBe(0);
    // bb accepted 4 expert slots over the direct link (the relay forwarded the other 4): the
    // worker's report and bb's receipts agree on the direct ones
    const stats = await fetch(`${url}/api/models/${MODEL}/stats`, {
      method: "POST",
      headers: { authorization: `Bearer ${bbToken}`, "content-type": "application/json" },
      body: JSON.stringify({ seq: 1, counts: {}, receipts: { wbin: { expertTokens: 8 } } }),
    });
    expect(await stats.json()).toMatchObject({ creditedExpertTokens: 8, cut: { expertTokens: 0 } });
  });
});

// The built `moeswarm-worker --listen-native` as its own process (protocol section 10.9): it
// publishes its native address in the placement (with no --listen: no wss endpoints), a client
// speaking the wire over node:tls pins the certificate the placement names, says hello with a
// ticket from the hub (refused with one minted for another backbone), and gets for a dispatch the
// bits of the same model computed here; SIGTERM drains it (exit 0), and what it answered natively
// reaches the hub's credits where the backbone's receipts agree.
import type { ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import type { PlacementRegistrationJson, ResultFrame } from "@moeswarm/core";
import { type Hub, mintToken } from "@moeswarm/hub";
import type { TempDir } from "@moeswarm/testkit";
import { loadExpertCompute, probeNative } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { WorkerEvent } from "../src/events.js";
import { spawnWorkerBin, startTestHub, WORKER_BIN, waitPlacement } from "./fixtures.js";
import { dial, ticketFor } from "./native-fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-native-bin-secret-0123456789a";
const EMBD = 64;

const native = await probeNative();
if (!native.available) {
  if (process.env.CI) throw new Error(`CI must build the native addon:\n${native.message}`);
  console.warn(`skipping the --listen-native test: ${native.message}`);
}

let hub: Hub;
let url: string;
let modelPath: string;
let work: TempDir | undefined;
let child: ChildProcess | undefined;

beforeAll(async () => {
  if (!existsSync(WORKER_BIN))
    throw new Error(`${WORKER_BIN} is missing: run \`pnpm --filter @moeswarm/worker build\` first`);
  ({ hub, url, modelPath, work } = await startTestHub({
    secret: SECRET,
    model: MODEL,
    preset: "tiny",
    workPrefix: "moeswarm-native-bin-",
  }));
});
afterAll(async () => {
  if (child && child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
  await hub?.close();
  work?.remove();
});

describe.skipIf(!native.available)("moeswarm-worker --listen-native (the built bin, its own process)", () => {
  it("publishes its native address, admits a hub ticket, answers with the local bits, is credited after the drain", async () => {
    const bin = spawnWorkerBin([
      "--hub",
      url,
      "--token",
      mintToken({ role: "worker", id: "wnat", ttlS: 600 }, SECRET),
      "--capacity",
      "10000000",
      "--cache-dir",
      join(work!.dir, "cache"),
      "--backend",
      "native",
      "--poll",
      "0.1",
      "--listen-native",
      "127.0.0.1:0",
    ]);
    child = bin.child;
    const { events, exited } = bin;

    const p = await waitPlacement(url, MODEL, "wnat's slice with its native address", (pl) =>
      pl.registrations.some((r) => r.id === "wnat" && (r as PlacementRegistrationJson).direct?.native),
    );
    const reg = p.registrations.find((r) => r.id === "wnat") as PlacementRegistrationJson;
    const listening = events.find((e) => e.event === "native-listening") as Extract<
      WorkerEvent,
      { event: "native-listening" }
    >;
    expect(listening, bin.stderr).toBeDefined();
    expect(reg.direct).toEqual({
      endpoints: [],
      fingerprint: listening.fingerprint,
      native: [`127.0.0.1:${listening.port}`],
    });
    expect(events.find((e) => e.event === "native-routes")).toMatchObject({ layers: reg.layers.length });

    const bbToken = mintToken({ role: "backbone", id: "bb", ttlS: 600 }, SECRET);
    // a ticket the hub minted for another backbone is refused
    const stranger = await dial(reg.direct!.native![0]!);
    const otherTicket = await ticketFor(
      url,
      "wnat",
      mintToken({ role: "backbone", id: "bb2", ttlS: 600 }, SECRET),
    );
    stranger.send({ t: "hello", v: 1, role: "backbone", id: "bb", token: otherTicket });
    expect(await stranger.next()).toMatchObject({ t: "error", code: "MOESWARM_AUTH_TICKET_INVALID" });
    expect(await stranger.next()).toBeUndefined();

    const c = await dial(reg.direct!.native![0]!);
    expect(c.fingerprint).toBe(reg.direct!.fingerprint); // the pin holds
    c.send({ t: "hello", v: 1, role: "backbone", id: "bb", token: await ticketFor(url, "wnat", bbToken) });
    expect(await c.next()).toMatchObject({ t: "hello", role: "backbone", id: "bb", token: "" });
    const layer = reg.layers[0]!;
    const e = reg.experts;
    const ids = Int32Array.from([e[3 % e.length]!, e[1]!, -1, e[0]!, e[2 % e.length]!, e[5 % e.length]!]);
    const w = Float32Array.from([0.5, 0.25, 0, 0.7, 0.2, 0.1]);
    const x = Float32Array.from({ length: 3 * EMBD }, (_, i) => Math.cos(i * 0.13));
    c.send({
      t: "dispatch",
      v: 1,
      id: 2,
      to: "wnat",
      model: MODEL,
      layer,
      n: 3,
      embd: EMBD,
      dtype: "f32",
      x,
      k: 2,
      ids,
      w,
      mode: "sum",
    });
    const r = (await c.next()) as ResultFrame;
    expect(r).toMatchObject({ t: "result", id: 2, n: 3, mode: "sum" });
    await using local = await loadExpertCompute(modelPath, { backend: "native" });
    const want = await local.run({ layer, x, ids, k: 2, w, mode: "sum" });
    expect(Buffer.from(r.y.buffer, r.y.byteOffset, r.y.byteLength)).toEqual(
      Buffer.from(want.buffer, want.byteOffset, want.byteLength),
    );
    c.close();

    // SIGTERM drains (the native listener's counts go to the hub), exit 0
    child.kill("SIGTERM");
    expect(await exited, bin.stderr).toBe(0);
    // bb sent 5 filled slots natively: the worker's report and bb's receipts agree on them
    const stats = await fetch(`${url}/api/models/${MODEL}/stats`, {
      method: "POST",
      headers: { authorization: `Bearer ${bbToken}`, "content-type": "application/json" },
      body: JSON.stringify({ seq: 1, counts: {}, receipts: { wnat: { expertTokens: 5 } } }),
    });
    expect(await stats.json()).toMatchObject({ creditedExpertTokens: 5, cut: { expertTokens: 0 } });
  }, 120_000);
});

// The native plane's bridge side against a real hub: a worker holding every expert advertises a
// native listener (`direct.native`); under trust "own" the bridge's table lists every layer with
// that worker's address, fingerprint and a ticket the worker will accept, and pushes it to a
// plugin connection; the plugin's receipts reach the hub as the worker's credits; failures drop
// it. Under trust "verify" (the default with a hub) or with spot checks the plane stays off.
// No plugin, no native listener: the socket is spoken by the test (the end-to-end test has both).
import { connect, type Socket } from "node:net";
import { join } from "node:path";
import { encodeLengthPrefixed, FrameReader } from "@moeswarm/core";
import { mintToken } from "@moeswarm/hub";
import { parseDirectKey, verifyDirectTicket } from "@moeswarm/relay-client";
import { decode, encode } from "@msgpack/msgpack";
import { Agent, request } from "undici";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { type BackboneBridge, type NativeTableFrame, serveBackboneBridge } from "../src/index.js";
import { nativeMissing } from "./helpers.js";
import { useRelaySwarm } from "./relay-swarm-fixture.js";

const missing = nativeMissing();
const SECRET = "backbone-native-hub-test-secret-0001";
const MODEL_ID = "nativehub";
const FP = Array.from({ length: 32 }, (_, i) => (255 - i).toString(16).toUpperCase()).join(":");
const ADDR = "127.0.0.1:45999";

/** A plugin's side of the socket, spoken by hand: frames in arrival order. */
async function pluginConnection(address: string) {
  const socket: Socket = connect(address.slice("unix:".length));
  const reader = new FrameReader({ maxFrameBytes: 1 << 20 });
  const frames: Uint8Array[] = [];
  socket.on("data", (d) => frames.push(...reader.push(d)));
  await new Promise<void>((resolve) => socket.once("connect", () => resolve()));
  return {
    send: (frame: unknown) => socket.write(encodeLengthPrefixed(encode(frame))),
    /** The next table, waiting for it. */
    table: async (): Promise<NativeTableFrame> => {
      await vi.waitFor(() => expect(frames.length).toBeGreaterThan(0), { timeout: 10_000 });
      return decode(frames.shift()!) as NativeTableFrame;
    },
    pending: () => frames.length,
    close: () => socket.destroy(),
  };
}

describe.skipIf(Boolean(missing))("native plane: the bridge's table from a real hub", () => {
  const fx = useRelaySwarm({
    prefix: "mswb-nhub-",
    secret: SECRET,
    model: MODEL_ID,
    preset: "small",
    tls: true,
  });
  let agent: Agent;
  const backboneToken = (id: string) => mintToken({ role: "backbone", id, ttlS: 3600 }, SECRET);
  const hubOptions = (id: string) => ({
    url: fx.url,
    token: backboneToken(id),
    model: MODEL_ID,
    ca: fx.swarm.certs!.ca,
    statsIntervalMs: 0,
    pollWaitS: 10,
  });

  beforeAll(async () => {
    agent = new Agent({ connect: { ca: fx.swarm.certs!.ca } });
    const all = Array.from({ length: fx.info.nExpert }, (_, e) => e);
    await fx.swarm.join("nw", all);
    const put = await request(`${fx.url}/api/workers/nw/direct`, {
      method: "PUT",
      dispatcher: agent,
      headers: {
        authorization: `Bearer ${mintToken({ role: "worker", id: "nw", ttlS: 600 }, SECRET)}`,
        "content-type": "application/json",
      },
      body: JSON.stringify({ endpoints: [], native: [ADDR], fingerprint: FP }),
    });
    expect(put.statusCode, await put.body.text()).toBe(200);
  });
  afterAll(async () => {
    await agent?.close();
  });

  it("trust own: every layer to the whole-layer owner, tickets it accepts; receipts credit it; failures drop it", async () => {
    await using bridge: BackboneBridge = await serveBackboneBridge({
      socket: join(fx.tmp.dir, "own.sock"),
      hub: hubOptions("bb-own"),
      trust: "own",
      native: { backoff: { initialMs: 60_000 } },
    });
    const placed = await bridge.hub!.waitForPlacement((p) => p.native.has("nw") && p.missing.length === 0);
    expect(placed.native.get("nw")).toEqual({ addrs: [ADDR], fingerprint: FP });
    // a worker with a native listener only: nothing for the direct transport to dial
    expect(placed.direct.has("nw")).toBe(false);
    await vi.waitFor(() => expect(bridge.metrics().native!.table.layers).toEqual(fx.info.layers), {
      timeout: 10_000,
    });
    expect(bridge.metrics().native).toMatchObject({
      enabled: true,
      table: { workers: ["nw"], deadlineMs: 5000 },
    });

    const plugin = await pluginConnection(bridge.address);
    plugin.send({ v: 1, t: "native-hello", pid: process.pid });
    const table = await plugin.table();
    expect(table.backbone).toBe("bb-own");
    expect(table.layers.map((e) => e.layer)).toEqual(fx.info.layers);
    const keyRes = await request(`${fx.url}/api/direct/key`, { dispatcher: agent });
    const { kid, key } = parseDirectKey(await keyRes.body.json());
    for (const e of table.layers) {
      expect(e).toMatchObject({ worker: "nw", addr: ADDR, fp: FP });
      // what the worker's native listener will check (protocol.md 10.8)
      const claims = verifyDirectTicket(e.ticket, {
        keys: new Map([[kid, key]]),
        worker: "nw",
        backbone: "bb-own",
      });
      expect(claims.exp).toBe(e.exp);
      expect(e.exp).toBeGreaterThan(Date.now() + 60_000);
    }

    // receipts: the worker's credits at the hub (testHub trusts reports), the tokens through the layers
    const layer = fx.info.layers[0]!;
    plugin.send({
      v: 1,
      t: "native-receipts",
      seq: 1,
      counts: [{ worker: "nw", layer, splits: 3, tokens: 4, expertTokens: 30 }],
      failures: [],
    });
    await vi.waitFor(() => expect(bridge.metrics().native!.receipts).toBe(1));
    const outcome = await bridge.hub!.reportStats();
    expect(outcome).toMatchObject({ accepted: true, credited: ["nw"] });
    expect(bridge.metrics().native).toMatchObject({
      splits: 3,
      expertTokens: 30,
      workers: { nw: { splits: 3 } },
    });

    // a failure: nw leaves the table (pushed at once), for the backoff
    plugin.send({
      v: 1,
      t: "native-receipts",
      seq: 2,
      counts: [],
      failures: [{ worker: "nw", code: "MOESWARM_TRANSPORT_CONNECT", msg: "connection refused" }],
    });
    const after = await plugin.table();
    expect(after.seq).toBeGreaterThan(table.seq);
    expect(after.layers).toEqual([]);
    expect(bridge.metrics().native).toMatchObject({
      dropped: ["nw"],
      fallbacks: 1,
      failures: { MOESWARM_TRANSPORT_CONNECT: 1 },
    });
    plugin.close();
  });

  it("a worker paused at the hub, or quarantined by the bridge, leaves the table; back when lifted", async () => {
    await using bridge: BackboneBridge = await serveBackboneBridge({
      socket: join(fx.tmp.dir, "pause.sock"),
      hub: hubOptions("bb-pause"),
      trust: "own",
    });
    const layersNow = () => bridge.metrics().native!.table.layers;
    await vi.waitFor(() => expect(layersNow()).toEqual(fx.info.layers), { timeout: 10_000 });
    const pause = (what: "pause" | "resume") =>
      request(`${fx.url}/api/workers/nw/${what}`, {
        method: "POST",
        dispatcher: agent,
        headers: {
          authorization: `Bearer ${mintToken({ role: "worker", id: "nw", ttlS: 600 }, SECRET)}`,
          "content-type": "application/json",
        },
        body: JSON.stringify({ reason: "native test" }),
      });
    expect((await pause("pause")).statusCode).toBe(200);
    // the hub leaves a paused worker out of the placement: the next version empties the table
    await vi.waitFor(() => expect(layersNow()).toEqual([]), { timeout: 15_000 });
    expect((await pause("resume")).statusCode).toBe(200);
    await vi.waitFor(() => expect(layersNow()).toEqual(fx.info.layers), { timeout: 15_000 });

    // quarantined by this bridge (as a proven lie would): out of the table at once
    bridge.verification.quarantine("nw");
    expect(bridge.verification.isQuarantined("nw")).toBe(true);
    const plugin = await pluginConnection(bridge.address);
    plugin.send({ v: 1, t: "native-hello", pid: process.pid });
    expect((await plugin.table()).layers).toEqual([]);
    bridge.verification.release("nw");
    // the next receipts (or placement) look again
    plugin.send({ v: 1, t: "native-receipts", seq: 1, counts: [], failures: [] });
    expect((await plugin.table()).layers.map((e) => e.layer)).toEqual(fx.info.layers);
    plugin.close();
  });

  it("trust verify (the default with a hub) and spot checks keep every layer on the bridge", async () => {
    for (const [name, extra] of [
      ["verify", {}],
      ["spot", { trust: "own" as const, spotCheck: { fraction: 0.5 } }],
      ["off", { trust: "own" as const, native: false }],
    ] as const) {
      await using bridge = await serveBackboneBridge({
        socket: join(fx.tmp.dir, `${name}.sock`),
        hub: hubOptions(`bb-${name}`),
        ...extra,
      });
      await bridge.hub!.waitForPlacement((p) => p.native.has("nw"));
      const m = bridge.metrics().native!;
      expect(m.enabled, name).toBe(false);
      expect(m.off).toMatch({ verify: /verify/, spot: /spot/, off: /off/ }[name]);
      const plugin = await pluginConnection(bridge.address);
      plugin.send({ v: 1, t: "native-hello", pid: process.pid });
      expect((await plugin.table()).layers).toEqual([]);
      plugin.close();
    }
  });
});

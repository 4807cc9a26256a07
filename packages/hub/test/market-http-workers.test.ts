import { createHash } from "node:crypto";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { sleep } from "@moeswarm/core";
import { Placement } from "@moeswarm/dispatch";
import { connectRelay } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createHub, createHubHandler, type Hub } from "../src/index.js";
import { call, type TempDir, waitFor } from "./hub-helpers.js";
import {
  type Body,
  capacity,
  get,
  ID,
  open,
  post,
  SECRET,
  startMarketHub,
  T0,
  token,
} from "./market-http-fixture.js";

let tmp: TempDir;
let tinyPath: string;
let hub: Hub;
let base: string;
let relayUrl: string;

beforeAll(async () => {
  ({ tmp, tinyPath, hub, base, relayUrl } = await startMarketHub(() => T0));
});

afterAll(async () => {
  await Promise.all(open.map((c) => c.close()));
  await hub?.close();
  tmp?.remove();
});

describe("several slices per worker, and a drain from the hub", () => {
  it("lists every slice of a worker, and POST /api/workers/:id/drain takes it out of service", async () => {
    const drains: Array<string | undefined> = [];
    const w9 = await connectRelay(relayUrl, {
      role: "worker",
      id: "w9",
      token: token("worker", "w9"),
      reconnect: false,
      onDispatch: () => ({ y: new Float32Array(0) }),
      onDrain: (reason) => drains.push(reason),
    });
    open.push(w9);
    w9.register({ model: ID, layers: [0], experts: [6, 7] });
    w9.register({ model: ID, layers: [1], experts: [4, 5] });
    await waitFor(() => hub.workers().some((w) => w.id === "w9" && w.slices.length === 2), "w9's two slices");
    const before = await get(`/api/models/${ID}/placement`);
    const mine = before.body.registrations.filter((r: { id: string }) => r.id === "w9");
    expect(mine.map((r: { layers: number[]; experts: number[] }) => [r.layers, r.experts])).toEqual([
      [[0], [6, 7]],
      [[1], [4, 5]],
    ]);
    const placement = Placement.fromRegistrations(before.body.registrations, { model: ID });
    expect(placement.owners(0, 7)).toContain("w9");
    expect(placement.owners(1, 4)).toContain("w9");
    const listed = (await get("/api/workers")).body.workers.find((w: { id: string }) => w.id === "w9");
    expect(listed.slices.map((x: { layers: number[] }) => x.layers)).toEqual([[0], [1]]);
    const status = hub.status({ model: ID }).workers.find((w) => w.id === "w9");
    expect(status?.slices).toEqual([
      { model: ID, layers: "0:1", experts: "6:8" },
      { model: ID, layers: "1:2", experts: "4:6" },
    ]);

    const badReplace = await post(
      "/api/claims",
      { model: ID, layers: "0:1", experts: "0:1", capacity, replaceLeases: "yes" },
      token("worker", "w9"),
    );
    expect([badReplace.status, badReplace.body.error.message]).toEqual([
      400,
      '"replaceLeases" must be a boolean',
    ]);

    // only an admin may drain; only a live worker can be; POST only; a reason is text
    const path = "/api/workers/w9/drain";
    expect((await post(path, undefined, token("worker", "w9"))).status).toBe(403);
    expect((await post(path, undefined)).status).toBe(401);
    expect((await post("/api/workers/nobody/drain", undefined, token("admin"))).status).toBe(404);
    expect((await get(path, token("admin"))).status).toBe(405);
    expect((await post(path, { reason: 5 }, token("admin"))).status).toBe(400);
    expect((await post(path, [1], token("admin"))).status).toBe(400);

    const polled = get(`/api/models/${ID}/placement?since=${before.body.version}&wait=5`);
    await sleep(50);
    const drained = await post(path, { reason: "maintenance" }, token("admin"));
    expect(drained).toMatchObject({ status: 200, body: { worker: "w9", draining: true, inFlight: 0 } });
    // at once: no slice of it in the placement, the relay refuses dispatches to it
    const after = await polled;
    expect(after.body.registrations.some((r: { id: string }) => r.id === "w9")).toBe(false);
    expect(hub.relay.workers().find((w) => w.id === "w9")).toMatchObject({ draining: true, slices: [] });
    await waitFor(() => drains.length === 1, "w9 told to drain");
    expect(drains).toEqual(["maintenance"]);
    await waitFor(
      () => hub.workers().some((w) => w.id === "w9" && w.draining && w.slices.length === 0),
      "w9 listed draining",
    );
    await w9.close();
  });
});

describe("the activation dtypes workers advertise", () => {
  it("placements carry each worker's hello caps.dtypes with its slices, for its connection only", async () => {
    const connect = (id: string, dtypes?: string[]) =>
      connectRelay(relayUrl, {
        role: "worker",
        id,
        token: token("worker", id),
        reconnect: false,
        ...(dtypes ? { caps: { dtypes } } : {}),
        onDispatch: () => ({ y: new Float32Array(0) }),
      });
    const cpu = await connect("wq-cpu", ["f32", "f16", "bf16", "q8_0", "q8_K"]);
    const old = await connect("wq-old");
    open.push(cpu, old);
    cpu.register({ model: ID, layers: [0], experts: [0, 1] });
    old.register({ model: ID, layers: [1], experts: [0, 1] });
    await waitFor(
      () =>
        ["wq-cpu", "wq-old"].every((id) =>
          hub.relay.workers().some((w) => w.id === id && w.slices.length === 1),
        ),
      "both slices",
    );
    const mine = (p: { body: Body }, id: string): Body | undefined =>
      (p.body.registrations as Body[]).find((r) => r.id === id);
    const first = await get(`/api/models/${ID}/placement`);
    expect(mine(first, "wq-cpu")?.dtypes).toEqual(["f32", "f16", "bf16", "q8_0", "q8_K"]);
    // a worker that said nothing has no dtypes: backbones try it once and learn
    expect(mine(first, "wq-old")).toBeDefined();
    expect(mine(first, "wq-old")).not.toHaveProperty("dtypes");
    const placement = Placement.fromRegistrations(first.body.registrations, { model: ID });
    expect(placement.dtypes("wq-cpu")).toContain("q8_K");
    expect(placement.dtypes("wq-old")).toBeUndefined();

    // the same id again without caps (an older build of it): the new connection's word only
    await cpu.close();
    await waitFor(() => !hub.relay.workers().some((w) => w.id === "wq-cpu"), "wq-cpu gone");
    const again = await connect("wq-cpu");
    open.push(again);
    again.register({ model: ID, layers: [0], experts: [0, 1] });
    await waitFor(
      () => hub.relay.workers().some((w) => w.id === "wq-cpu" && w.slices.length === 1),
      "wq-cpu back",
    );
    const second = await get(`/api/models/${ID}/placement`);
    expect(mine(second, "wq-cpu")).toBeDefined();
    expect(mine(second, "wq-cpu")).not.toHaveProperty("dtypes");
    await Promise.all([again.close(), old.close()]);
  });
});

describe("dashboard page", () => {
  it("is served on / with a CSP that allows exactly its inline script", async () => {
    const a = await call(`${base}/`);
    expect(a.status).toBe(200);
    expect(a.headers["content-type"]).toBe("text/html; charset=utf-8");
    const html = a.body.toString("utf8");
    const scripts = [...html.matchAll(/<script>([\s\S]*?)<\/script>/g)].map((m) => m[1] as string);
    expect(scripts).toHaveLength(1);
    const hash = createHash("sha256")
      .update(scripts[0] as string)
      .digest("base64");
    expect(a.headers["content-security-policy"]).toContain(`script-src 'sha256-${hash}'`);
    expect(a.headers["content-security-policy"]).toContain("default-src 'none'");
    // data reaches the page only through textContent and attributes
    expect(scripts[0]).not.toMatch(/innerHTML|outerHTML|insertAdjacentHTML|document\.write/);
    expect((await call(`${base}/`, { method: "POST" })).status).toBe(405);
  });

  it("leaves an embedder's / alone unless dashboard: true, and can be turned off", async () => {
    for (const dashboard of [undefined, true]) {
      const h = createHub({
        secret: SECRET,
        models: [{ id: ID, path: tinyPath }],
        ...(dashboard ? { dashboard } : {}),
      });
      const handle = createHubHandler(h);
      const server = createServer((q, r) => handle(q, r) || r.writeHead(200).end("mine"));
      await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
      try {
        await h.ready;
        const page = await call(`http://127.0.0.1:${(server.address() as AddressInfo).port}/`);
        expect(page.body.toString().startsWith("<!doctype html>")).toBe(dashboard === true);
      } finally {
        await h.close();
        await new Promise<void>((r) => server.close(() => r()));
      }
    }
    const off = createHub({ secret: SECRET, models: [{ id: ID, path: tinyPath }], dashboard: false });
    try {
      const { url } = await off.listen(0);
      expect((await call(`${url}/`)).status).toBe(404);
    } finally {
      await off.close();
    }
  });
});

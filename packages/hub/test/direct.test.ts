// The hub's side of direct links: a worker's endpoints (checked, only by that worker) in the
// placement of its live slices, with a new version so long-polling backbones see them; withdrawn
// with an empty list; the ticket key, and tickets that verify with it and name the asker.
import type { PlacementJson } from "@moeswarm/core";
import { connectRelay, parseDirectKey, verifyDirectTicket } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createHub, type Hub, mintToken } from "../src/index.js";
import { call, json, syntheticModel, waitFor } from "./hub-helpers.js";

const SECRET = "hub-direct-links-test-secret-0123456";
const MODEL = "m";
const FP = Array.from({ length: 32 }, (_, i) => (i * 7).toString(16).padStart(2, "0").toUpperCase()).join(
  ":",
);

let hub: Hub;
let url: string;
let relayUrl: string;

beforeAll(async () => {
  const path = await syntheticModel("tiny");
  hub = createHub({
    secret: SECRET,
    models: [{ id: MODEL, path }],
    requireLeases: false,
    replicas: 1,
    dashboard: false,
  });
  ({ url, relayUrl } = await hub.listen(0));
});
afterAll(async () => {
  await hub?.close();
});

const auth = (role: "worker" | "backbone", id: string) => ({
  authorization: `Bearer ${mintToken({ role, id, ttlS: 600 }, SECRET)}`,
  "content-type": "application/json",
});
const put = (id: string, as: string, body: unknown) =>
  call(`${url}/api/workers/${id}/direct`, {
    method: "PUT",
    headers: auth("worker", as),
    body: JSON.stringify(body),
  });
const placement = async () => json(await call(`${url}/api/models/${MODEL}/placement`)) as PlacementJson;

describe("direct links on the hub", () => {
  it("puts a worker's endpoints in the placement of its slices, with a new version, until withdrawn", async () => {
    await using w = await connectRelay(relayUrl, {
      role: "worker",
      id: "w1",
      token: mintToken({ role: "worker", id: "w1", ttlS: 600 }, SECRET),
      reconnect: false,
    });
    w.register({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
    await waitFor(async () => (await placement()).registrations.length > 0, "w1's slice in the placement");
    const before = await placement();
    expect(before.registrations[0]).not.toHaveProperty("direct");

    const direct = { endpoints: ["wss://w1.example:7443"], fingerprint: FP };
    expect((await put("w1", "w1", direct)).status).toBe(200);
    const after = await placement();
    expect(after.version).toBeGreaterThan(before.version);
    expect(after.registrations.map((r) => r.direct)).toEqual([direct]);

    // only the worker itself, and only well-formed endpoints
    expect((await put("w1", "w2", direct)).status).toBe(403);
    for (const bad of [
      { endpoints: ["https://w1:1"], fingerprint: FP },
      { endpoints: ["wss://u:p@w1:1"], fingerprint: FP },
      { endpoints: ["wss://w1:1"], fingerprint: "aa:bb" },
      { endpoints: "wss://w1:1", fingerprint: FP },
      [],
    ]) {
      const r = await put("w1", "w1", bad);
      expect(r.status, JSON.stringify(bad)).toBe(400);
      expect((json(r) as { error: { code: string } }).error.code).toBe("MOESWARM_HUB_BAD_REQUEST");
    }
    expect((await placement()).registrations[0]!.direct).toEqual(direct);

    expect((await put("w1", "w1", { endpoints: [] })).status).toBe(200);
    const withdrawn = await placement();
    expect(withdrawn.version).toBeGreaterThan(after.version);
    expect(withdrawn.registrations[0]).not.toHaveProperty("direct");
  });

  it("mints tickets that verify with its published key and name the asking backbone", async () => {
    const key = parseDirectKey(json(await call(`${url}/api/direct/key`)));
    const r = await call(`${url}/api/direct/tickets`, {
      method: "POST",
      headers: auth("backbone", "bb"),
      body: JSON.stringify({ worker: "w1" }),
    });
    expect(r.status).toBe(200);
    const { ticket, exp } = json(r) as { ticket: string; exp: number };
    const keys = new Map([[key.kid, key.key]]);
    expect(verifyDirectTicket(ticket, { keys, worker: "w1", backbone: "bb" })).toMatchObject({
      sub: "bb",
      wk: "w1",
      exp,
    });
    expect(() => verifyDirectTicket(ticket, { keys, worker: "w1", backbone: "bb", now: exp })).toThrow(
      expect.objectContaining({ code: "MOESWARM_AUTH_TICKET_EXPIRED" }),
    );
    const anonymous = await call(`${url}/api/direct/tickets`, {
      method: "POST",
      body: JSON.stringify({ worker: "w1" }),
    });
    expect(anonymous.status).toBe(401);
  });
});

// The hub's side of direct links: a worker's endpoints (checked, only by that worker) in the
// placement of its live slices, with a new version so long-polling backbones see them; withdrawn
// with an empty list; the ticket key, and tickets that verify with it and name the asker.
import type { PlacementJson } from "@moeswarm/core";
import { connectRelay, parseDirectKey, verifyDirectTicket } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type DirectHub, DIRECT_MODEL as MODEL, startDirectHub } from "./direct-fixture.js";
import { waitFor } from "./hub-helpers.js";

const FP = Array.from({ length: 32 }, (_, i) => (i * 7).toString(16).padStart(2, "0").toUpperCase()).join(
  ":",
);

let h: DirectHub;

beforeAll(async () => {
  h = await startDirectHub("hub-direct-links-test-secret-0123456");
});
afterAll(async () => {
  await h?.close();
});

const put = (id: string, as: string, body: unknown) =>
  h.send("PUT", `/api/workers/${id}/direct`, body, h.token("worker", as));
const placement = async () => (await h.send("GET", `/api/models/${MODEL}/placement`)).body as PlacementJson;

describe("direct links on the hub", () => {
  it("puts a worker's endpoints in the placement of its slices, with a new version, until withdrawn", async () => {
    await using w = await connectRelay(h.relayUrl, {
      role: "worker",
      id: "w1",
      token: h.token("worker", "w1"),
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
      expect(r.body.error.code).toBe("MOESWARM_HUB_BAD_REQUEST");
    }
    expect((await placement()).registrations[0]!.direct).toEqual(direct);

    expect((await put("w1", "w1", { endpoints: [] })).status).toBe(200);
    const withdrawn = await placement();
    expect(withdrawn.version).toBeGreaterThan(after.version);
    expect(withdrawn.registrations[0]).not.toHaveProperty("direct");
  });

  it("carries the native listener's addresses (section 10.9), checked, and withdraws only when both lists are empty", async () => {
    await using w = await connectRelay(h.relayUrl, {
      role: "worker",
      id: "w3",
      token: h.token("worker", "w3"),
      reconnect: false,
    });
    w.register({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
    const mine = async () => (await placement()).registrations.find((r) => r.id === "w3");
    await waitFor(async () => (await mine()) !== undefined, "w3's slice in the placement");

    // native alone (no --listen): endpoints may be empty
    const nativeOnly = {
      endpoints: [],
      fingerprint: FP,
      native: ["w3.example:7444", "[::1]:7444", "10.0.0.3:1"],
    };
    const r = await put("w3", "w3", nativeOnly);
    expect(r.status).toBe(200);
    expect(r.body).toMatchObject({ worker: "w3", native: nativeOnly.native });
    expect((await mine())!.direct).toEqual(nativeOnly);
    // with endpoints too
    const both = { endpoints: ["wss://w3.example:7443"], fingerprint: FP, native: ["w3.example:7444"] };
    expect((await put("w3", "w3", both)).status).toBe(200);
    expect((await mine())!.direct).toEqual(both);
    // an empty native is as absent: the record stays for its endpoints, without native
    expect((await put("w3", "w3", { ...both, native: [] })).status).toBe(200);
    expect((await mine())!.direct).toEqual({ endpoints: both.endpoints, fingerprint: FP });

    for (const native of [
      "w3:7444",
      ["w3"],
      ["w3:0"],
      ["w3:65536"],
      ["wss://w3:7444"],
      ["::1:7444"],
      ["w3 x:1"],
      [7444],
      [`${"a".repeat(300)}:1`],
      Array.from({ length: 9 }, (_, i) => `w3:${i + 1}`),
    ]) {
      const bad = await put("w3", "w3", { endpoints: [], fingerprint: FP, native });
      expect(bad.status, JSON.stringify(native)).toBe(400);
      expect(bad.body.error.code).toBe("MOESWARM_HUB_BAD_REQUEST");
    }
    // native needs the fingerprint as endpoints do (the same certificate)
    expect((await put("w3", "w3", { endpoints: [], native: ["w3:1"] })).status).toBe(400);
    expect((await mine())!.direct).toEqual({ endpoints: both.endpoints, fingerprint: FP });

    expect((await put("w3", "w3", nativeOnly)).status).toBe(200);
    expect((await put("w3", "w3", { endpoints: [], fingerprint: FP, native: [] })).status).toBe(200);
    expect(await mine()).not.toHaveProperty("direct");
  });

  it("mints tickets that verify with its published key and name the asking backbone", async () => {
    const key = parseDirectKey((await h.send("GET", "/api/direct/key")).body);
    const r = await h.send("POST", "/api/direct/tickets", { worker: "w1" }, h.token("backbone", "bb"));
    expect(r.status).toBe(200);
    const { ticket, exp } = r.body as { ticket: string; exp: number };
    const keys = new Map([[key.kid, key.key]]);
    expect(verifyDirectTicket(ticket, { keys, worker: "w1", backbone: "bb" })).toMatchObject({
      sub: "bb",
      wk: "w1",
      exp,
    });
    expect(() => verifyDirectTicket(ticket, { keys, worker: "w1", backbone: "bb", now: exp })).toThrow(
      expect.objectContaining({ code: "MOESWARM_AUTH_TICKET_EXPIRED" }),
    );
    const anonymous = await h.send("POST", "/api/direct/tickets", { worker: "w1" });
    expect(anonymous.status).toBe(401);
  });
});

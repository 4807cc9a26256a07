// relay-client's HubClient against a loopback HTTP server: the bearer token, JSON both ways, the
// hub's error bodies as typed errors, 304, limits, aborts, and the one rule of what is transient.
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { AbortError, HubError, isMoeswarmError, TransportError } from "@moeswarm/core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { HubClient, isTransient } from "../src/index.js";

let server: Server;
let base: string;
const seen: Array<{ method: string; url: string; auth: string | undefined; body: string }> = [];
let handler: (req: IncomingMessage, res: ServerResponse, body: string) => void = () => {};

beforeAll(async () => {
  server = createServer((req, res) => {
    let body = "";
    req.on("data", (c: Buffer) => {
      body += c.toString("utf8");
    });
    req.on("end", () => {
      seen.push({ method: req.method ?? "", url: req.url ?? "", auth: req.headers.authorization, body });
      handler(req, res, body);
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  base = `http://127.0.0.1:${(server.address() as AddressInfo).port}/`;
});

afterAll(async () => {
  await new Promise<void>((r) => server.close(() => r()));
});

const json = (res: ServerResponse, status: number, value: unknown) => {
  res.writeHead(status, { "content-type": "application/json" });
  res.end(JSON.stringify(value));
};

const LEASE = {
  leaseId: "l1",
  worker: "w",
  model: "m",
  layers: "0:1",
  experts: "0:4",
  bytes: 10,
  grantedAt: 1,
  expiresAt: 2,
  ttlMs: 1000,
  url: "/api/models/m/expert-shard?layers=0:1&experts=0:4",
  manifest: "/api/models/m/manifest",
  capacity: { ramBytes: 10 },
};

describe("HubClient", () => {
  it("sends the token (asked before every request) and JSON, and types the market's answers", async () => {
    let n = 0;
    await using_(new HubClient({ base, token: () => `t${++n}` }), async (hub) => {
      handler = (req, res) =>
        json(
          res,
          req.url?.startsWith("/api/demand") ? 200 : 201,
          req.url?.startsWith("/api/demand") ? { time: 1, ranges: [] } : LEASE,
        );
      seen.length = 0;
      expect(await hub.demand({ model: "m" })).toEqual({ time: 1, ranges: [] });
      const body = { model: "m", layers: "0:1", experts: "0:4", capacity: { ramBytes: 10 } };
      expect(await hub.claim(body)).toEqual(LEASE);
      expect(seen.map((s) => [s.method, s.url, s.auth])).toEqual([
        ["GET", "/api/demand?model=m", "Bearer t1"],
        ["POST", "/api/claims", "Bearer t2"],
      ]);
      expect(JSON.parse(seen[1]!.body)).toEqual(body);
      expect(hub.relayUrl()).toBe(`ws://${new URL(base).host}/relay`);
    });
  });

  it("turns the hub's error body into the error of its code, with the status", async () => {
    await using_(new HubClient({ base, token: "t" }), async (hub) => {
      handler = (_req, res) =>
        json(res, 404, { error: { code: "MOESWARM_HUB_NOT_FOUND", message: "no lease" } });
      const error = await hub.renew("nope", undefined).catch((e: unknown) => e);
      expect(isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND")).toBe(true);
      expect((error as HubError).details).toMatchObject({ status: 404 });
      expect(isTransient(error)).toBe(false);
      handler = (_req, res) => {
        res.writeHead(503);
        res.end("busy");
      };
      const busy = await hub.request("/x").catch((e: unknown) => e);
      expect(busy).toBeInstanceOf(HubError);
      expect(isTransient(busy)).toBe(true);
    });
  });

  it("answers 304 without a body, refuses an answer over the limit and a lease it cannot use", async () => {
    await using_(new HubClient({ base, token: "t" }), async (hub) => {
      handler = (_req, res) => {
        res.writeHead(304);
        res.end();
      };
      expect(await hub.request("/p")).toEqual({ status: 304, json: undefined });
      handler = (_req, res) => json(res, 200, { big: "x".repeat(2000) });
      const big = await hub.request("/p", { maxBodyBytes: 100 }).catch((e: unknown) => e);
      expect(isMoeswarmError(big, "MOESWARM_TRANSPORT_LIMIT")).toBe(true);
      handler = (_req, res) => json(res, 201, { leaseId: 1 });
      const bad = await hub.claimAuto({ capacity: { ramBytes: 1 } }).catch((e: unknown) => e);
      expect(isMoeswarmError(bad, "MOESWARM_HUB_BAD_REQUEST")).toBe(true);
    });
  });

  it("rejects with the signal's reason: already aborted, and aborted while waiting", async () => {
    await using_(new HubClient({ base, token: "t" }), async (hub) => {
      const reason = new AbortError("stop");
      await expect(hub.request("/p", { signal: AbortSignal.abort(reason) })).rejects.toBe(reason);
      handler = () => {}; // never answers
      const controller = new AbortController();
      const p = hub.request("/slow", { signal: controller.signal });
      setTimeout(() => controller.abort(reason), 50);
      await expect(p).rejects.toBe(reason);
    });
  });

  it("reports a refused connection as a transient TransportError", async () => {
    await using_(new HubClient({ base: "http://127.0.0.1:1/", token: "t" }), async (hub) => {
      const error = await hub.request("/p").catch((e: unknown) => e);
      expect(error).toBeInstanceOf(TransportError);
      expect(isTransient(error)).toBe(true);
    });
  });
});

describe("isTransient", () => {
  it.each([
    [408, true],
    [429, true],
    [500, true],
    [501, false],
    [503, true],
    [400, false],
    [404, false],
  ])("status %i -> %s", (status, transient) => {
    expect(isTransient(new HubError("MOESWARM_HUB_BAD_REQUEST", "x", { details: { status } }))).toBe(
      transient,
    );
  });

  it("counts hub errors without a status by code, and other errors never", () => {
    expect(isTransient(new HubError("MOESWARM_HUB_INTERNAL", "not JSON"))).toBe(true);
    expect(isTransient(new HubError("MOESWARM_HUB_BAD_REQUEST", "x"))).toBe(false);
    expect(isTransient(new Error("bug"))).toBe(false);
  });
});

async function using_(hub: HubClient, run: (hub: HubClient) => Promise<void>): Promise<void> {
  try {
    await run(hub);
  } finally {
    await hub.close();
  }
}

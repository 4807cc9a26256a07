import { truncateSync } from "node:fs";
import { Agent, createServer, request } from "node:http";
import type { AddressInfo, Socket } from "node:net";
import { connectRelay } from "@moeswarm/relay-client";
import { readGguf } from "@moeswarm/shard";
import { describe, expect, it } from "vitest";
import {
  createHub,
  createHubHandler,
  createMemoryStore,
  type HubEvent,
  type HubStore,
  mintToken,
} from "../src/index.js";
import {
  call,
  copyModel,
  json,
  parsePrometheus,
  partialDownload,
  referenceSlice,
  sampleValue,
  tempDir,
  waitFor,
} from "./hub-helpers.js";
import { ID, SECRET, useHub } from "./hub-http-fixture.js";

// the hub of this file (hub-http-fixture.ts), started before its tests and closed after them
const fx = useHub();
const { shardUrl } = fx;

describe("errors", () => {
  const codeOf = (a: { body: Buffer }) => (json(a as never) as { error: { code: string } }).error.code;

  it.each([
    ["layers=0:&experts=0:8"],
    ["layers=3:1&experts=0:8"],
    ["layers=0:1&experts=0.5:2"],
    ["layers=-1:1&experts=0:8"],
    ["layers=0:3&experts=0:8"],
    ["layers=0:1&experts=0:9"],
    ["layers=0:1&experts=0:99999999999"],
    ["layers=a:b&experts=0:8"],
  ])("400 MOESWARM_INVALID_RANGE for %s", async (query) => {
    const a = await call(shardUrl(query));
    expect(a.status).toBe(400);
    expect(a.headers["content-type"]).toMatch(/^application\/json/);
    const body = json(a) as { error: { code: string; message: string } };
    expect(body.error.code).toBe("MOESWARM_INVALID_RANGE");
    expect(body.error.message.length).toBeGreaterThan(0);
  });

  it("400 MOESWARM_HUB_BAD_REQUEST for a missing or repeated parameter", async () => {
    for (const q of ["layers=0:1", "experts=0:8", "", "layers=0:1&layers=1:2&experts=0:8"]) {
      const a = await call(shardUrl(q));
      expect(a.status, q).toBe(400);
      expect(codeOf(a)).toBe("MOESWARM_HUB_BAD_REQUEST");
    }
  });

  it("404 for unknown models and resources, 405 with Allow for wrong methods", async () => {
    for (const path of [
      "/api/models/nope/manifest",
      "/api/models/nope/expert-shard?layers=0:1&experts=0:1",
      "/api/models/nope",
      "/api/models/tiny/other",
      "/api/elsewhere",
      "/api",
      "/nothing-here",
    ]) {
      const a = await call(`${fx.base}${path}`);
      expect(a.status, path).toBe(404);
      expect(codeOf(a)).toBe("MOESWARM_HUB_NOT_FOUND");
    }
    const put = await call(shardUrl("layers=0:1&experts=0:1"), { method: "PUT" });
    expect(put.status).toBe(405);
    expect(put.headers.allow).toBe("GET, HEAD");
    expect(codeOf(put)).toBe("MOESWARM_HUB_METHOD_NOT_ALLOWED");
    const del = await call(`${fx.base}/api/models`, { method: "DELETE" });
    expect(del.status).toBe(405);
    expect(del.headers.allow).toBe("GET, HEAD, POST");
  });

  it("answers a plain GET of the relay's path with 426", async () => {
    const a = await call(`${fx.base}/relay`);
    expect(a.status).toBe(426);
    expect(a.headers.upgrade).toBe("websocket");
    expect(codeOf(a)).toBe("MOESWARM_HUB_BAD_REQUEST");
  });

  it("never maps a URL to a path: escapes are unknown models", async () => {
    const escapes = [
      "/api/models/..%2F..%2F..%2Fetc%2Fpasswd/manifest",
      "/api/models/%2e%2e/manifest",
      "/api/models/..%2Ftiny/manifest",
      "/api/models/tiny%2F..%2Ftiny/manifest",
      "/api/models/..%5C..%5Ctiny/manifest",
      "/api/models/%252e%252e%252ftiny/manifest",
      "/api/models/../models/tiny/manifest",
      "/api/models/./tiny/manifest",
      "/api/models/tiny.gguf/manifest",
      "/api/models/%00tiny/manifest",
      "/api/models//manifest",
    ];
    for (const path of escapes) {
      const a = await call(fx.base, { path });
      expect(a.status, path).toBe(404);
      expect(codeOf(a)).toBe("MOESWARM_HUB_NOT_FOUND");
    }
    const bad = await call(fx.base, { path: "/api/models/%E0%A4%A/manifest" });
    expect(bad.status).toBe(400);
    expect(codeOf(bad)).toBe("MOESWARM_HUB_BAD_REQUEST");
  });
});

describe("writes", () => {
  const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
  const post = (body: unknown, token: string | null = admin) =>
    call(`${fx.base}/api/models`, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        ...(token === null ? {} : { authorization: `Bearer ${token}` }),
      },
      body: typeof body === "string" ? body : JSON.stringify(body),
    });

  it("needs an admin token: 401 without or with a bad one, 403 for another role", async () => {
    const none = await post({ path: "tiny.gguf" }, null);
    expect(none.status).toBe(401);
    expect(none.headers["www-authenticate"]).toMatch(/^Bearer/);
    expect(json(none)).toMatchObject({ error: { code: "MOESWARM_AUTH_MISSING" } });
    const forged = await post(
      { path: "tiny.gguf" },
      mintToken({ role: "admin", ttlS: 60 }, "another-secret-0123456789abcdef"),
    );
    expect(forged.status).toBe(401);
    expect(json(forged)).toMatchObject({ error: { code: "MOESWARM_AUTH_INVALID" } });
    const expired = await post(
      { path: "tiny.gguf" },
      mintToken({ role: "admin", ttlS: 1, now: Date.now() - 60_000 }, SECRET),
    );
    expect(expired.status).toBe(401);
    expect(json(expired)).toMatchObject({ error: { code: "MOESWARM_AUTH_EXPIRED" } });
    const worker = await post({ path: "tiny.gguf" }, mintToken({ role: "worker", ttlS: 60 }, SECRET));
    expect(worker.status).toBe(403);
    expect(json(worker)).toMatchObject({ error: { code: "MOESWARM_AUTH_ROLE" } });
  });

  it("registers a file of the model directory, refuses paths outside it", async () => {
    copyModel(fx.tinyPath, fx.tmp.dir, "second.gguf");
    const created = await post({ path: "second.gguf", id: "second" });
    expect(created.status).toBe(201);
    expect(created.headers.location).toBe("/api/models/second");
    expect(json(created)).toMatchObject({ id: "second", layers: 2, experts: 8 });
    const again = await post({ path: "second.gguf", id: "second" });
    expect(again.status).toBe(200);
    const taken = await post({ path: "tiny.gguf", id: "second" });
    expect(taken.status).toBe(409);
    expect(json(taken)).toMatchObject({ error: { code: "MOESWARM_HUB_CONFLICT" } });
    const listed = json(await call(`${fx.base}/api/models`)) as { models: Array<{ id: string }> };
    expect(listed.models.map((m) => m.id)).toEqual([ID, "second"]);
    const a = await call(shardUrl("layers=0:1&experts=0:2", "second"));
    const b = await call(shardUrl("layers=0:1&experts=0:2"));
    expect(a.body.equals(b.body)).toBe(true);

    for (const path of ["../tiny.gguf", "/etc/passwd", `${fx.tmp.dir}/../x.gguf`, "sub/../../x.gguf", "."]) {
      const r = await post({ path });
      expect(r.status, path).toBe(400);
      expect(json(r)).toMatchObject({ error: { code: "MOESWARM_HUB_BAD_REQUEST" } });
    }
    expect((await post({ path: "missing.gguf" })).status).toBe(404);
    expect((await post({ path: "second.gguf", id: "../x" })).status).toBe(400);
    expect((await post("{not json")).status).toBe(400);
    expect((await post({ path: "x".repeat(70_000) })).status).toBe(413);
    const removed = await call(`${fx.base}/api/models/second`, {
      method: "DELETE",
      headers: { authorization: `Bearer ${admin}` },
    });
    expect(removed.status).toBe(200);
    expect((await call(`${fx.base}/api/models/second/manifest`)).status).toBe(404);
  });

  it("refuses to register a symbolic link that leads outside the model directory", async () => {
    const { symlinkSync } = await import("node:fs");
    const outside = tempDir();
    try {
      copyModel(fx.tinyPath, outside.dir, "elsewhere.gguf");
      symlinkSync(`${outside.dir}/elsewhere.gguf`, `${fx.tmp.dir}/link.gguf`);
      const r = await post({ path: "link.gguf" });
      expect(r.status).toBe(400);
    } finally {
      outside.remove();
    }
  });

  it("registers a file that is not a MoE GGUF only to answer 400", async () => {
    const { writeFileSync } = await import("node:fs");
    writeFileSync(`${fx.tmp.dir}/junk.gguf`, "definitely not gguf");
    const r = await post({ path: "junk.gguf" });
    expect(r.status).toBe(400);
    expect(json(r)).toMatchObject({
      error: { code: "MOESWARM_HUB_BAD_REQUEST", details: { cause: "MOESWARM_GGUF_BAD_MAGIC" } },
    });
  });
});

describe("private reads", () => {
  it("asks every read for a token of any role when publicReads is false", async () => {
    const h = createHub({ secret: SECRET, models: [{ id: ID, path: fx.tinyPath }], publicReads: false });
    try {
      const url = (await h.listen(0)).url;
      const worker = { authorization: `Bearer ${mintToken({ role: "worker", ttlS: 60 }, SECRET)}` };
      for (const path of [
        "/api/models",
        `/api/models/${ID}`,
        `/api/models/${ID}/manifest`,
        `/api/models/${ID}/expert-shard?layers=0:1&experts=0:1`,
        "/api/workers",
        "/metrics",
      ]) {
        const denied = await call(`${url}${path}`);
        expect(denied.status, path).toBe(401);
        expect(json(denied)).toMatchObject({ error: { code: "MOESWARM_AUTH_MISSING" } });
        expect((await call(`${url}${path}`, { headers: worker })).status, path).toBe(200);
      }
    } finally {
      await h.close();
    }
  });
});

describe("failures inside the hub", () => {
  it("a store that throws answers 500 MOESWARM_HUB_INTERNAL, never crashes", async () => {
    const broken: HubStore = {
      ...createMemoryStore(),
      listModels: () => {
        throw new TypeError("the store has a bug");
      },
    };
    const seen: HubEvent[] = [];
    const h = createHub({ secret: SECRET, store: broken, onEvent: (e) => seen.push(e) });
    const server = createServer((req, res) => {
      if (!h.handleRequest(req, res)) res.writeHead(418).end();
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    try {
      const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
      const a = await call(`${url}/api/models`);
      expect(a.status).toBe(500);
      expect(json(a)).toEqual({
        error: { code: "MOESWARM_HUB_INTERNAL", message: "the hub failed while answering this request" },
      });
      expect(seen.some((e) => e.type === "request-error" && e.status === 500)).toBe(true);
      // the store's write failing is a 503 with the store's code
      const s2: HubStore = {
        ...createMemoryStore(),
        putModel: () => Promise.reject(new TypeError("disk on fire")),
      };
      const h2 = createHub({ secret: SECRET, store: s2, modelDir: fx.tmp.dir });
      try {
        const l2 = await h2.listen(0);
        const r = await call(`${l2.url}/api/models`, {
          method: "POST",
          headers: { authorization: `Bearer ${mintToken({ role: "admin", ttlS: 60 }, SECRET)}` },
          body: JSON.stringify({ path: "tiny.gguf", id: "t2" }),
        });
        expect(r.status).toBe(503);
        expect(json(r)).toMatchObject({ error: { code: "MOESWARM_HUB_STORE" } });
        expect(json(await call(`${l2.url}/api/models`))).toEqual({ models: [] });
      } finally {
        await h2.close();
      }
    } finally {
      await h.close();
      await new Promise<void>((r) => server.close(() => r()));
    }
  });

  it("a file that shrinks under a download cuts that download and nothing else", async () => {
    const path = copyModel(fx.tinyPath, fx.tmp.dir, "shrinking.gguf");
    const seen: HubEvent[] = [];
    const h = createHub({
      secret: SECRET,
      models: [{ id: "shrinking", path }],
      onEvent: (e) => seen.push(e),
    });
    try {
      const url = (await h.listen(0)).url;
      const q = "/api/models/shrinking/expert-shard?layers=1:2&experts=0:8";
      const head = await call(`${url}${q}`, { method: "HEAD" });
      const header = await readGguf(path);
      truncateSync(path, Number(header.dataOffset) + 1000);
      const cut = await partialDownload(`${url}${q}`, Number.MAX_SAFE_INTEGER, () => {});
      expect(cut.status).toBe(200);
      expect(cut.ended).toBe(false);
      expect(cut.received.byteLength).toBeLessThan(Number(head.headers["content-length"]));
      await waitFor(() => seen.some((e) => e.type === "request-error"), "the error event");
      const e = seen.find((x) => x.type === "request-error") as Extract<HubEvent, { type: "request-error" }>;
      expect((e.error as { code?: string }).code).toBe("MOESWARM_GGUF_TRUNCATED");
      expect((await call(`${url}/api/models`)).status).toBe(200);
    } finally {
      await h.close();
    }
  });
});

describe("close", () => {
  it("ends idle keep-alive sockets, downloads in flight and relay connections; the port is released", async () => {
    const h = createHub({ secret: SECRET, models: [{ id: ID, path: fx.tinyPath }], chunkSize: 1024 });
    const l = await h.listen(0);
    const agent = new Agent({ keepAlive: true });
    const sockets: Socket[] = [];
    agent.on("free", (socket: Socket) => sockets.push(socket));
    await new Promise<void>((resolve, reject) => {
      request(`${l.url}/api/models`, { agent }, (res) => {
        res.resume();
        res.on("end", resolve);
      })
        .on("error", reject)
        .end();
    });
    // a download whose client stopped reading after the first bytes
    const stalled = await new Promise<{ socket: Socket }>((resolve, reject) => {
      request(`${l.url}/api/models/${ID}/expert-shard?layers=0:2&experts=0:8`, { agent: false }, (res) => {
        res.once("data", () => {
          res.pause();
          resolve({ socket: res.socket });
        });
      })
        .on("error", () => undefined)
        .end();
      setTimeout(() => reject(new Error("no first byte")), 5000).unref();
    });
    const ws = await connectRelay(l.relayUrl, {
      role: "worker",
      id: "closing",
      token: mintToken({ role: "worker", id: "closing", ttlS: 60 }, SECRET),
      reconnect: false,
    });
    await waitFor(() => sockets.length === 1, "the idle keep-alive socket");
    const closed = (s: Socket) => new Promise<void>((r) => (s.destroyed ? r() : s.once("close", () => r())));
    await h.close();
    await Promise.all([closed(sockets[0]!), closed(stalled.socket)]);
    await waitFor(() => ws.state === "closed", "the relay connection to close");
    await ws.close();
    agent.destroy();
    const refused = await call(`${l.url}/api/models`).then(
      () => "answered",
      (e: NodeJS.ErrnoException) => e.code,
    );
    expect(refused).toBe("ECONNREFUSED");
  });
});

describe("embedding", () => {
  it("mounts on an embedder's server beside its own routes", async () => {
    const h = createHub({ secret: SECRET, models: [{ id: "emb", path: fx.tinyPath }] });
    const handle = createHubHandler(h);
    const server = createServer((req, res) => {
      if (handle(req, res)) return;
      res.writeHead(200, { "content-type": "text/plain" }).end("the embedder's own page");
    });
    server.on("upgrade", (req, socket, head) => {
      if (!h.handleUpgrade(req, socket, head)) socket.destroy();
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    try {
      await h.ready;
      const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
      expect((await call(`${url}/`)).body.toString()).toBe("the embedder's own page");
      expect((await call(`${url}/relayz`)).status).toBe(200);
      const a = await call(`${url}/api/models/emb/expert-shard?layers=0:1&experts=0:1`);
      expect(a.status).toBe(200);
      const ref = await referenceSlice(fx.tinyPath, { layers: [0], experts: [0] });
      expect(a.body.equals(ref)).toBe(true);
    } finally {
      await h.close();
      await new Promise<void>((r) => server.close(() => r()));
    }
  });

  it("rejects bad options eagerly", () => {
    expect(() => createHub({ secret: "short" })).toThrow(/16 bytes/);
    expect(() => createHub({ secret: SECRET, models: [{ id: "../x", path: fx.tinyPath }] })).toThrow(
      /model id/,
    );
    expect(() =>
      createHub({
        secret: SECRET,
        models: [
          { id: "a", path: fx.tinyPath },
          { id: "a", path: fx.tinyPath },
        ],
      }),
    ).toThrow(/twice/);
    expect(() => createHub({ secret: SECRET, chunkSize: 0 })).toThrow(/chunkSize/);
  });

  it("a configured model that does not load fails listen() with its code", async () => {
    const h = createHub({
      secret: SECRET,
      models: [{ id: "gone", path: `${fx.tmp.dir}/does-not-exist.gguf` }],
    });
    await expect(h.listen(0)).rejects.toMatchObject({ code: "MOESWARM_GGUF_IO" });
    await h.close();
  });
});

describe("metrics", () => {
  it("exposes Prometheus text that counts requests, bytes and relay state", async () => {
    const before = parsePrometheus((await call(`${fx.base}/metrics`)).body.toString()).samples;
    const ok = await call(shardUrl("layers=0:1&experts=0:3"));
    await call(shardUrl("layers=0:9&experts=0:3"));
    await call(shardUrl("layers=0:1&experts=0:3"), { headers: { range: "bytes=0-99" } });
    const a = await call(`${fx.base}/metrics`);
    expect(a.status).toBe(200);
    expect(a.headers["content-type"]).toMatch(/^text\/plain; version=0\.0\.4/);
    const { samples, types } = parsePrometheus(a.body.toString());
    expect(types.get("moeswarm_http_requests_total")).toBe("counter");
    expect(types.get("moeswarm_relay_route_seconds")).toBe("histogram");
    expect(types.get("moeswarm_relay_connections")).toBe("gauge");
    const count = (s: typeof samples, status: string) =>
      sampleValue(s, "moeswarm_http_requests_total", {
        route: "/api/models/:model/expert-shard",
        method: "GET",
        status,
      });
    expect(count(samples, "200") - count(before, "200")).toBe(1);
    expect(count(samples, "400") - count(before, "400")).toBe(1);
    expect(count(samples, "206") - count(before, "206")).toBe(1);
    const bytes = (s: typeof samples) =>
      sampleValue(s, "moeswarm_http_bytes_served_total", { route: "/api/models/:model/expert-shard" });
    expect(bytes(samples) - bytes(before)).toBe(ok.body.byteLength + 100);
    expect(sampleValue(samples, "moeswarm_relay_connections", { role: "worker" })).toBe(0);
    expect(sampleValue(samples, "moeswarm_hub_models")).toBeGreaterThanOrEqual(1);
    // the 404s of path probes land on one label, not one per URL
    const routes = new Set(
      samples.filter((s) => s.name === "moeswarm_http_requests_total").map((s) => s.labels.route),
    );
    expect([...routes].every((r) => r === "other" || r?.startsWith("/"))).toBe(true);
    expect(routes.size).toBeLessThanOrEqual(7);
  });

  it("keeps each hub's metrics in its own registry", async () => {
    const h = createHub({ secret: SECRET });
    try {
      expect(h.metrics.registry).not.toBe(fx.hub.metrics.registry);
      const text = await h.metrics.text();
      const { samples } = parsePrometheus(text);
      expect(sampleValue(samples, "moeswarm_http_requests_total", { route: "/api/models" })).toBe(0);
    } finally {
      await h.close();
    }
  });
});

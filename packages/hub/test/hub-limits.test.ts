// The hub under abuse, on loopback with real sockets: an fd exhauster that opens hundreds of idle
// connections, a slowloris, a flood of WebSockets that never say hello. The attacker dials from
// 127.0.0.2 (Linux routes all of 127/8 to loopback) so that its per-address caps are not the
// honest clients' (127.0.0.1).
import { connect, type Socket } from "node:net";
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import WebSocket from "ws";
import { createHub, createLoopbackCertificates, mintToken } from "../src/index.js";
import { call, copyModel, json, syntheticModel, type TempDir, tempDir, waitFor } from "./hub-helpers.js";

const SECRET = "limits-test-secret-0123456789abcdef";
const ATTACKER = "127.0.0.2";
// long enough that a loaded machine (CI at load 15+) refuses 250 sockets well inside it: the test
// tells "refused at once" from "closed when idle" by this margin
const IDLE_MS = 1200;

let tmp: TempDir;
let tinyPath: string;

beforeAll(async () => {
  tmp = tempDir();
  tinyPath = copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf");
});
afterAll(() => tmp.remove());

async function startHub(limits: NonNullable<Parameters<typeof createHub>[0]["limits"]>, extra = {}) {
  const hub = createHub({
    secret: SECRET,
    models: [{ id: "tiny", path: tinyPath }],
    limits,
    relay: { helloTimeoutMs: 500 },
    ...extra,
  });
  const listener = await hub.listen(0, "127.0.0.1");
  return { hub, port: listener.port, base: listener.url, relayUrl: listener.relayUrl };
}

interface Probe {
  socket: Socket;
  closedAt: number | undefined;
}

/** Opens `n` TCP connections from `from` that send nothing. */
async function openIdle(port: number, n: number, from = ATTACKER): Promise<Probe[]> {
  const probes: Probe[] = [];
  await Promise.all(
    Array.from(
      { length: n },
      () =>
        new Promise<void>((resolve) => {
          const socket = connect({ port, host: "127.0.0.1", localAddress: from });
          const probe: Probe = { socket, closedAt: undefined };
          probes.push(probe);
          socket.on("error", () => {});
          socket.on("close", () => {
            probe.closedAt = Date.now();
            resolve();
          });
          socket.on("connect", () => resolve());
        }),
    ),
  );
  return probes;
}

const openCount = (probes: Probe[]) => probes.filter((p) => p.closedAt === undefined).length;

function refusedMetric(text: string, reason: string): number {
  const m = new RegExp(`^moeswarm_hub_connections_refused_total\\{reason="${reason}"\\} (\\d+)`, "m").exec(
    text,
  );
  return m ? Number(m[1]) : 0;
}

function worker(relayUrl: string, id: string): Promise<RelayConnection> {
  return connectRelay(relayUrl, {
    role: "worker",
    id,
    token: mintToken({ role: "worker", id, ttlS: 600 }, SECRET),
    heartbeatMs: 100,
    deadPeerMs: 2000,
    reconnect: false,
    onDispatch: () => {
      throw new Error("no dispatch expected");
    },
  });
}

describe("the hub under abuse", () => {
  it("refuses idle connections beyond the per-address cap at once and closes the rest when idle; honest clients go on", async () => {
    const { hub, port, base, relayUrl } = await startHub({
      maxConnectionsPerAddress: 50,
      idleConnectionMs: IDLE_MS,
      headersTimeoutMs: 5000,
      requestTimeoutMs: 10_000,
    });
    const probes: Probe[] = [];
    let honest: RelayConnection | undefined;
    try {
      const opened = Date.now();
      probes.push(...(await openIdle(port, 300)));
      // the excess is closed at once: 250 of 300, long before the idle timeout
      await waitFor(() => openCount(probes) === 50, "the connections", IDLE_MS - 100);
      // an honest worker and an HTTP request from another address while the attacker holds its cap
      honest = await worker(relayUrl, "honest-1");
      expect((await call(`${base}/api/models`)).status).toBe(200);
      // the idle ones are closed after the timeout, not before
      await waitFor(() => openCount(probes) === 0, "the connections", 3000);
      const lastClose = Math.max(...probes.map((p) => p.closedAt ?? 0));
      expect(lastClose - opened).toBeGreaterThanOrEqual(IDLE_MS - 50);
      // the worker's WebSocket is no idle connection: it is still there, and the HTTP API answers
      await new Promise((r) => setTimeout(r, IDLE_MS * 2));
      expect(honest.state).toBe("connected");
      expect(hub.relay.stats().workers).toBe(1);
      expect((await call(`${base}/api/status`)).status).toBe(200);
      const metrics = (await call(`${base}/metrics`)).body.toString();
      expect(refusedMetric(metrics, "address-cap")).toBe(250);
      expect(refusedMetric(metrics, "idle")).toBe(50);
      // the cap freed up: the attacker's address may connect again
      const again = await openIdle(port, 5);
      expect(openCount(again)).toBe(5);
      for (const p of again) p.socket.destroy();
    } finally {
      for (const p of probes) p.socket.destroy();
      await honest?.close();
      await hub.close();
    }
  });

  it("the fd exhauster at default limits: 256 idle connections per address, the rest refused at once", async () => {
    // the hub's defaults (limits {}): 8192 in all, 256 per address, idle ones closed after 30 s
    const { hub, port, base, relayUrl } = await startHub({});
    const probes: Probe[] = [];
    let honest: RelayConnection | undefined;
    try {
      probes.push(...(await openIdle(port, 300)));
      await waitFor(() => openCount(probes) === 256, "the connections", 3000);
      // another address is served while the attacker holds its whole cap
      honest = await worker(relayUrl, "honest-default");
      expect((await call(`${base}/api/models`)).status).toBe(200);
      const metrics = (await call(`${base}/metrics`)).body.toString();
      expect(refusedMetric(metrics, "address-cap")).toBe(44);
      // one more from the attacker is refused too; the cap is not a queue
      const more = await openIdle(port, 1);
      await waitFor(() => openCount(more) === 0, "the extra connection", 3000);
      expect(openCount(probes)).toBe(256);
    } finally {
      for (const p of probes) p.socket.destroy();
      await honest?.close();
      await hub.close();
    }
  });

  it("caps connections in all", async () => {
    const { hub, port, base } = await startHub({ maxConnections: 20, idleConnectionMs: 5000 });
    try {
      const probes = await openIdle(port, 30);
      await waitFor(() => openCount(probes) === 20, "the connections", 1000);
      for (const p of probes) p.socket.destroy();
      await waitFor(
        async () => (await call(`${base}/api/models`).catch(() => undefined))?.status === 200,
        "an answer",
        2000,
      );
      expect(hub.metrics).toBeDefined();
      expect(
        refusedMetric((await call(`${base}/metrics`)).body.toString(), "global-cap"),
      ).toBeGreaterThanOrEqual(10);
    } finally {
      await hub.close();
    }
  });

  it("answers a slowloris 408 after the headers timeout", async () => {
    const { hub, port, base } = await startHub({ headersTimeoutMs: 300, requestTimeoutMs: 600 });
    try {
      const socket = connect({ port, host: "127.0.0.1", localAddress: ATTACKER });
      socket.on("error", () => {});
      let answer = "";
      socket.on("data", (d) => {
        answer += d.toString();
      });
      const closed = new Promise<number>((resolve) => socket.on("close", () => resolve(Date.now())));
      await new Promise((r) => socket.once("connect", r));
      const start = Date.now();
      socket.write("GET /api/models HTTP/1.1\r\nHost: x\r\n");
      // one header byte every 50 ms: data keeps flowing, the headers never end
      const drip = setInterval(() => socket.write("X"), 50);
      const end = await closed;
      clearInterval(drip);
      expect(answer).toMatch(/^HTTP\/1\.1 408/);
      expect(end - start).toBeGreaterThanOrEqual(250);
      expect(end - start).toBeLessThan(3000);
      expect(refusedMetric((await call(`${base}/metrics`)).body.toString(), "request-timeout")).toBe(1);
    } finally {
      await hub.close();
    }
  });

  it("does not cut a placement long-poll or a slow slice download; caps WebSockets that never say hello", async () => {
    const { hub, base, relayUrl } = await startHub(
      {
        idleConnectionMs: 300,
        maxUnauthenticatedPerAddress: 5,
        headersTimeoutMs: 300,
        requestTimeoutMs: 600,
      },
      { chunkSize: 4096 },
    );
    const sockets: WebSocket[] = [];
    let honest: RelayConnection | undefined;
    try {
      const placement = json(await call(`${base}/api/models/tiny/placement`)) as { version: number };
      const t0 = Date.now();
      const poll = await call(`${base}/api/models/tiny/placement?since=${placement.version}&wait=1`);
      expect(poll.status).toBe(304);
      expect(Date.now() - t0).toBeGreaterThanOrEqual(900);

      // a download read slowly: 4 KiB every 60 ms, for longer than the idle timeout
      const all = await call(`${base}/api/models/tiny/expert-shard?layers=0:1&experts=0:4`);
      expect(all.status).toBe(200);
      const slow = await slowDownload(`${base}/api/models/tiny/expert-shard?layers=0:1&experts=0:4`, 60);
      expect(slow.ms).toBeGreaterThan(300);
      expect(slow.body.equals(all.body)).toBe(true);

      // WebSockets that never say hello: 5 held, the rest refused at once (503)
      const outcomes = await Promise.all(
        Array.from(
          { length: 12 },
          () =>
            new Promise<string>((resolve) => {
              const ws = new WebSocket(relayUrl, { localAddress: ATTACKER });
              sockets.push(ws);
              ws.on("open", () => resolve("open"));
              ws.on("unexpected-response", (req, res) => {
                req.destroy();
                resolve(String(res.statusCode));
              });
              ws.on("error", () => resolve("error"));
            }),
        ),
      );
      expect(outcomes.filter((o) => o === "open")).toHaveLength(5);
      expect(outcomes.filter((o) => o === "503")).toHaveLength(7);
      honest = await worker(relayUrl, "honest-2");
      expect(honest.state).toBe("connected");
      // the relay's hello timeout ends the silent ones, and the address may try again
      const opened = sockets.filter((s) => s.readyState === WebSocket.OPEN);
      await waitFor(
        () => opened.every((s) => s.readyState === WebSocket.CLOSED),
        "the silent ones' end",
        3000,
      );
      const retry = new WebSocket(relayUrl, { localAddress: ATTACKER });
      sockets.push(retry);
      await new Promise((resolve, reject) => {
        retry.on("open", resolve);
        retry.on("error", reject);
      });
      const metrics = (await call(`${base}/metrics`)).body.toString();
      expect(refusedMetric(metrics, "unauthenticated-cap")).toBe(7);
      expect(refusedMetric(metrics, "idle")).toBe(0);
    } finally {
      for (const s of sockets) s.terminate();
      await honest?.close();
      await hub.close();
    }
  });

  it("closes a TLS connection that never says anything after the handshake timeout", async () => {
    const { cert, key } = await createLoopbackCertificates();
    const { hub, port } = await startHub(
      { headersTimeoutMs: 300, requestTimeoutMs: 600, idleConnectionMs: 300 },
      { tls: { cert, key } },
    );
    try {
      const start = Date.now();
      const probes = await openIdle(port, 20);
      await waitFor(() => openCount(probes) === 0, "the silent TLS connections' end", 3000);
      const last = Math.max(...probes.map((p) => p.closedAt ?? 0));
      expect(last - start).toBeGreaterThanOrEqual(250);
      expect(refusedMetric(await hub.metrics.text(), "tls-handshake")).toBe(20);
    } finally {
      await hub.close();
    }
  });

  it("checks the limits", () => {
    expect(() => createHub({ secret: SECRET, limits: { maxConnections: 0 } })).toThrow(/maxConnections/);
    expect(() =>
      createHub({ secret: SECRET, limits: { headersTimeoutMs: 2000, requestTimeoutMs: 1000 } }),
    ).toThrow(/headersTimeoutMs/);
  });
});

/** Reads `url` pausing `pauseMs` after each chunk; the whole body and how long it took. */
async function slowDownload(url: string, pauseMs: number): Promise<{ body: Buffer; ms: number }> {
  const { request } = await import("node:http");
  const start = Date.now();
  return new Promise((resolve, reject) => {
    const req = request(url, { agent: false }, (res) => {
      const parts: Buffer[] = [];
      res.on("data", (c: Buffer) => {
        parts.push(c);
        res.pause();
        setTimeout(() => res.resume(), pauseMs);
      });
      res.on("end", () => resolve({ body: Buffer.concat(parts), ms: Date.now() - start }));
      res.on("error", reject);
    });
    req.on("error", reject);
    req.end();
  });
}

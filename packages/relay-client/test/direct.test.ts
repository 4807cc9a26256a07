// Direct links over real sockets and TLS: a worker's endpoint (serveDirect), the backbone's
// DirectTransport with the certificate pinned and a ticket signed by a (test) hub key, and every
// refusal with its code: forged, expired or misdirected tickets, a certificate that is not the
// pinned one, frames before the hello. A link that dies under a request sends it over the fallback.
import { generateKeyPairSync, type KeyObject } from "node:crypto";
import {
  decodeFrame,
  type ExpertTransport,
  encodeFrame,
  isMoeswarmError,
  PROTOCOL_VERSION,
} from "@moeswarm/core";
import { expectNoUnhandledRejections, waitFor } from "@moeswarm/testkit";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import WebSocket from "ws";
import {
  connectRelay,
  type DirectServer,
  DirectTransport,
  dialWebSocket,
  directKeyId,
  type IncomingDispatch,
  selfSignedCertificate,
  serveDirect,
  signDirectTicket,
} from "../src/index.js";
import { Fallback, smallRequest } from "./fixtures.js";

expectNoUnhandledRejections(0);

interface Keys {
  privateKey: KeyObject;
  publicKey: KeyObject;
}
const newKeys = (): Keys => generateKeyPairSync("ed25519");

let hub: Keys;
let tls: { cert: string; key: string };
let other: { cert: string; key: string };
const servers: DirectServer[] = [];
const transports: DirectTransport[] = [];

beforeAll(async () => {
  hub = newKeys();
  [tls, other] = await Promise.all([selfSignedCertificate(), selfSignedCertificate()]);
});

afterEach(async () => {
  await Promise.all(transports.splice(0).map((t) => t.close()));
  await Promise.all(servers.splice(0).map((s) => s.close()));
});

/** y = 2x per slot, as a worker's compute would answer (mode "each": n*k rows). */
function doubled(d: IncomingDispatch): Float32Array {
  const x = d.activations();
  const y = new Float32Array(d.n * d.k * d.embd);
  for (let t = 0; t < d.n; t++)
    for (let s = 0; s < d.k; s++)
      for (let e = 0; e < d.embd; e++) y[(t * d.k + s) * d.embd + e] = 2 * x[t * d.embd + e]!;
  return y;
}

async function worker(
  id: string,
  extra: { onDispatch?: (d: IncomingDispatch) => Promise<{ y: Float32Array }>; cert?: typeof tls } = {},
) {
  const server = await serveDirect({
    id,
    ...(extra.cert ?? tls),
    host: "127.0.0.1",
    hubKey: async () => ({ kid: directKeyId(hub.publicKey), key: hub.publicKey }),
    onDispatch: extra.onDispatch ?? ((d) => ({ y: doubled(d) })),
  });
  servers.push(server);
  return { server, url: `wss://127.0.0.1:${server.port}` };
}

function ticket(claims: { sub?: string; wk: string; exp?: number }, keys = hub): string {
  const now = Date.now();
  return signDirectTicket(
    { sub: claims.sub ?? "bb", wk: claims.wk, iat: now, exp: claims.exp ?? now + 60_000 },
    keys.privateKey,
    keys.publicKey,
  );
}

// a Fallback answers zeros (so a test can tell which path answered); the worker doubles x
const req = () => smallRequest((i) => i - 3);
const call = () => ({ signal: new AbortController().signal, deadlineMs: 5000 });

function transport(fallback: ExpertTransport, tickets: (worker: string) => string) {
  const t = new DirectTransport({
    fallback,
    id: "bb",
    ticket: async (w) => tickets(w),
    backoff: { initialDelayMs: 60_000, jitter: 0 },
  });
  transports.push(t);
  return t;
}

async function refusal(url: string, token: string, pin: string): Promise<unknown> {
  return connectRelay(url, {
    role: "backbone",
    id: "bb",
    token,
    reconnect: false,
    dial: (u, d) => dialWebSocket(u, { ...d, pin }),
  }).then(
    async (c) => {
      await c.close();
      return "accepted";
    },
    (e: unknown) => (isMoeswarmError(e) ? e.code : e),
  );
}

describe("direct links", () => {
  it("carries a worker's requests directly and the others' over the fallback, bit for bit", async () => {
    const w = await worker("w1");
    const fallback = new Fallback();
    const t = transport(fallback, (wk) => ticket({ wk }));
    t.update(new Map([["w1", { endpoints: [w.url], fingerprint: w.server.fingerprint }]]));
    expect(await t.linked("w1")).toBe(true);
    const r = req();
    const direct = await t.request("w1", r, call());
    const expected = Float32Array.from({ length: 16 }, (_, i) => 2 * r.x[Math.floor(i / 8) * 4 + (i % 4)]!);
    expect([...direct.y]).toEqual([...expected]);
    await t.request("w2", req(), call());
    expect(fallback.calls).toEqual(["w2"]);
    expect(t.counters()).toMatchObject({ direct: 1, relay: 1, retried: 0, dials: 1, linked: ["w1"] });
    expect(w.server.stats()).toMatchObject({ accepted: 1, refused: 0, connected: 1, dispatches: 1 });
  });

  it("refuses forged, expired and misdirected tickets with their codes", async () => {
    const w = await worker("w1");
    const pin = w.server.fingerprint;
    expect(await refusal(w.url, ticket({ wk: "w1" }, newKeys()), pin)).toBe("MOESWARM_AUTH_TICKET_INVALID");
    expect(await refusal(w.url, ticket({ wk: "w1", exp: Date.now() - 1 }), pin)).toBe(
      "MOESWARM_AUTH_TICKET_EXPIRED",
    );
    expect(await refusal(w.url, ticket({ wk: "w9" }), pin)).toBe("MOESWARM_AUTH_TICKET_INVALID");
    expect(await refusal(w.url, ticket({ wk: "w1", sub: "someone-else" }), pin)).toBe(
      "MOESWARM_AUTH_TICKET_INVALID",
    );
    expect(await refusal(w.url, "msw1.not-a-ticket.x", pin)).toBe("MOESWARM_AUTH_TICKET_INVALID");
    // a tampered claims part with the original signature
    const good = ticket({ wk: "w1" });
    const [, part, sig] = good.split(".");
    const claims = JSON.parse(Buffer.from(part!, "base64url").toString());
    const forged = `mswt1.${Buffer.from(JSON.stringify({ ...claims, exp: claims.exp + 1 })).toString("base64url")}.${sig}`;
    expect(await refusal(w.url, forged, pin)).toBe("MOESWARM_AUTH_TICKET_INVALID");
    expect(await refusal(w.url, good, pin)).toBe("accepted");
    expect(w.server.stats()).toMatchObject({ accepted: 1, refused: 6, dispatches: 0 });
  });

  it("hangs up on a certificate that is not the pinned one before any frame, and uses the fallback", async () => {
    const impostor = await worker("w1", { cert: other });
    const genuine = await worker("w1");
    expect(await refusal(impostor.url, ticket({ wk: "w1" }), genuine.server.fingerprint)).toBe(
      "MOESWARM_TRANSPORT_PIN_MISMATCH",
    );
    // the impostor never saw a hello (no ticket reached it)
    expect(impostor.server.stats()).toMatchObject({ accepted: 0, refused: 0 });

    const fallback = new Fallback();
    const events: string[] = [];
    const t = new DirectTransport({
      fallback,
      id: "bb",
      ticket: async (wk) => ticket({ wk }),
      backoff: { initialDelayMs: 60_000, jitter: 0 },
      onEvent: (e) =>
        events.push(`${e.type}:${e.type === "dial-failed" && isMoeswarmError(e.error) ? e.error.code : ""}`),
    });
    transports.push(t);
    t.update(new Map([["w1", { endpoints: [impostor.url], fingerprint: genuine.server.fingerprint }]]));
    expect(await t.linked("w1")).toBe(false);
    expect(events).toEqual(["dial-failed:MOESWARM_TRANSPORT_PIN_MISMATCH"]);
    // backing off: the next requests go over the fallback without dialing again
    await t.request("w1", req(), call());
    await t.request("w1", req(), call());
    expect(fallback.calls).toEqual(["w1", "w1"]);
    expect(t.counters()).toMatchObject({ direct: 0, relay: 2, dials: 1, dialFailures: 1, linked: [] });
  });

  it("answers frames before the hello with an error frame and a close (no dispatch is read)", async () => {
    let dispatched = 0;
    const w = await worker("w1", {
      onDispatch: async (d) => {
        dispatched++;
        return { y: doubled(d) };
      },
    });
    const ws = new WebSocket(w.url, { rejectUnauthorized: false });
    const got: { code?: string; close?: number } = {};
    await new Promise<void>((resolve) => {
      ws.on("open", () => {
        const r = req();
        ws.send(
          encodeFrame({ t: "dispatch", v: PROTOCOL_VERSION, id: 1, to: "w1", ...r, dtype: "f32" } as never),
        );
      });
      ws.on("message", (data: Buffer) => {
        const frame = decodeFrame(data);
        got.code = frame.t === "error" ? frame.code : frame.t;
      });
      ws.on("close", (code) => {
        got.close = code;
        resolve();
      });
    });
    expect(got).toEqual({ code: "MOESWARM_AUTH_MISSING", close: 4001 });
    expect(dispatched).toBe(0);
  });

  it("refuses connections beyond maxPending waiting for their hello, and cuts a silent backbone", async () => {
    const server = await serveDirect({
      id: "w1",
      ...tls,
      host: "127.0.0.1",
      maxPending: 1,
      deadPeerMs: 300,
      hubKey: async () => ({ kid: directKeyId(hub.publicKey), key: hub.publicKey }),
      onDispatch: (d) => ({ y: doubled(d) }),
    });
    servers.push(server);
    const url = `wss://127.0.0.1:${server.port}`;
    const open = async () => {
      const ws = new WebSocket(url, { rejectUnauthorized: false });
      const closed = new Promise<{ code: number; error?: string }>((resolve) => {
        let error: string | undefined;
        ws.on("message", (data: Buffer) => {
          const f = decodeFrame(data);
          if (f.t === "error") error = f.code;
        });
        ws.on("close", (code) => resolve({ code, ...(error ? { error } : {}) }));
      });
      await new Promise<void>((resolve) => ws.once("open", () => resolve()));
      return { ws, closed };
    };
    const first = await open(); // says nothing: pending
    const second = await open();
    expect(await second.closed).toEqual({ code: 1013, error: "MOESWARM_TRANSPORT_LIMIT" });
    // the silent first one is cut (no hello timeout needed: deadPeerMs is shorter)
    expect((await first.closed).code).toBe(1006);
    // and a backbone with a ticket is accepted again
    expect(await refusal(url, ticket({ wk: "w1" }), server.fingerprint)).toBe("accepted");
    expect(server.stats()).toMatchObject({ accepted: 1, refused: 1 });
  });

  it("sends a request whose direct link dies under it again over the fallback", async () => {
    let release!: () => void;
    const held = new Promise<void>((resolve) => {
      release = resolve;
    });
    let arrived = 0;
    const w = await worker("w1", {
      onDispatch: async (d) => {
        arrived++;
        await held;
        return { y: doubled(d) };
      },
    });
    const fallback = new Fallback();
    const t = transport(fallback, (wk) => ticket({ wk }));
    t.update(new Map([["w1", { endpoints: [w.url], fingerprint: w.server.fingerprint }]]));
    expect(await t.linked("w1")).toBe(true);
    const pending = t.request("w1", req(), call());
    await waitFor(() => arrived === 1, "the dispatch to reach the worker");
    await w.server.close(); // the link dies with the request in flight
    release();
    const r = await pending;
    expect([...r.y].every((v) => v === 0)).toBe(true); // the fallback's answer
    expect(fallback.calls).toEqual(["w1"]);
    expect(t.counters()).toMatchObject({ direct: 0, relay: 1, retried: 1, linked: [] });
  });
});

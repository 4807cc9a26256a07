import { getEventListeners } from "node:events";
import { AuthError, isMoeswarmError, TransportError } from "@moeswarm/core";
import {
  type ConnectRelayOptions,
  connectRelay,
  type IncomingDispatch,
  type RelayConnection,
  type RelayEvent,
  RelayTransport,
} from "@moeswarm/relay-client";
import { rng } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  createLoopbackCertificates,
  type LoopbackCertificates,
  listenRelay,
  mintToken,
  type RelayListener,
  type RelayServerEvent,
} from "../src/index.js";
import { fakeExperts, randomRequest, sameBytes, startProxy, type TcpProxy, waitFor } from "./helpers.js";

const SECRET = "relay-test-secret-0123456789abcdef";
const MODEL = "test-moe";
const FAST = { heartbeatMs: 100, deadPeerMs: 1000 };

const unhandled: unknown[] = [];
const onUnhandled = (e: unknown) => unhandled.push(e);

let certs: LoopbackCertificates;
let listener: RelayListener;
let port: number;
let proxy: TcpProxy;
const events: RelayServerEvent[] = [];
const open: RelayConnection[] = [];

function startRelay(p = 0) {
  return listenRelay({
    port: p,
    secret: SECRET,
    tls: { cert: certs.cert, key: certs.key },
    maxFrameBytes: 4 * 1024 * 1024,
    ...FAST,
    onEvent: (e) => events.push(e),
  });
}

// workers answer with fakeExperts(salt); salt = their index, so misrouting changes the bytes
const SALTS: Record<string, number> = { w1: 1, w2: 2, w4: 4 };
const computed: Record<string, number> = { w1: 0, w2: 0 };
let hold: ((req: IncomingDispatch) => Promise<void>) | undefined;

function computeAnswer(id: string) {
  return async (req: IncomingDispatch) => {
    computed[id] = (computed[id] ?? 0) + 1;
    if (hold) await hold(req);
    const y = fakeExperts(SALTS[id]!, {
      layer: req.layer,
      n: req.n,
      embd: req.embd,
      k: req.k,
      x: req.activations(),
      ids: req.ids,
      w: req.w,
      mode: req.mode,
    });
    return { y };
  };
}

async function connect(
  url: string,
  role: "worker" | "backbone",
  id: string,
  extra: Partial<ConnectRelayOptions> = {},
): Promise<RelayConnection> {
  const conn = await connectRelay(url, {
    role,
    id,
    token: mintToken({ role, id, ttlS: 600 }, SECRET),
    ca: certs.ca,
    ...FAST,
    reconnect: { initialDelayMs: 20, maxDelayMs: 200 },
    onDispatch: role === "worker" ? computeAnswer(id) : undefined,
    ...extra,
  });
  open.push(conn);
  return conn;
}

const url = (p: number) => `wss://localhost:${p}/relay`;
let w1: RelayConnection;
let w2: RelayConnection;
let bb: RelayConnection;

function registered(id: string) {
  return listener.relay.workers().some((w) => w.id === id && w.slices.some((s) => s.model === MODEL));
}

beforeAll(async () => {
  process.on("unhandledRejection", onUnhandled);
  certs = await createLoopbackCertificates({ hosts: ["localhost", "127.0.0.1"], days: 2 });
  listener = await startRelay();
  port = listener.port;
  proxy = await startProxy(port);
  w1 = await connect(url(port), "worker", "w1");
  // w2 reaches the relay through a proxy the tests can cut or black-hole; it gives the relay
  // longer than the relay gives it, so that the relay is the one to notice a black hole first
  w2 = await connect(url(proxy.port), "worker", "w2", { deadPeerMs: 2500 });
  for (const w of [w1, w2]) w.register({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3, 4, 5, 6, 7] });
  bb = await connect(url(port), "backbone", "bb");
  await waitFor(() => registered("w1") && registered("w2"), "both workers registered");
});

afterAll(async () => {
  await Promise.all(open.map((c) => c.close()));
  await proxy?.close();
  await listener?.close();
  process.off("unhandledRejection", onUnhandled);
  expect(unhandled).toEqual([]);
});

async function expectCode(promise: Promise<unknown>, code: string): Promise<unknown> {
  const error = await promise.then(
    () => new Error("expected a rejection"),
    (e: unknown) => e,
  );
  expect(isMoeswarmError(error) ? error.code : error).toBe(code);
  return error;
}

describe("relay over wss (self-signed CA)", () => {
  it("routes dispatches to the named worker and returns byte-exact results", async () => {
    const rand = rng(1);
    const shapes = [
      { n: 1, embd: 64, k: 8, experts: 8, mode: "each" as const },
      { n: 7, embd: 96, k: 4, experts: 8, mode: "sum" as const, layer: 1 },
      { n: 3, embd: 32, k: 2, experts: 8, mode: "each" as const },
    ];
    const checks: Promise<void>[] = [];
    for (const shape of shapes) {
      for (const to of ["w1", "w2"]) {
        for (const dtype of ["f32", "f16", "bf16"] as const) {
          const req = randomRequest(rand, shape);
          checks.push(
            bb.request(to, { ...req, dtype }, { deadlineMs: 5000 }).then((reply) => {
              // the worker computes on what it received: the activations after the dtype's rounding
              const sent = dtype === "f32" ? req.x : new RelayTransportProbe(dtype).roundTrip(req.x);
              const expected = fakeExperts(SALTS[to]!, { ...req, x: sent });
              expect(reply.from).toBe(to);
              expect(reply.y.length).toBe(expected.length);
              expect(sameBytes(reply.y, expected)).toBe(true);
            }),
          );
        }
      }
    }
    await Promise.all(checks);
    // an independent spot check of the arithmetic: slot (0,0) of a known request
    const x = new Float32Array([0.5, -2]);
    const reply = await bb.request("w2", {
      model: MODEL,
      layer: 1,
      n: 1,
      embd: 2,
      k: 2,
      x,
      ids: new Int32Array([3, -1]),
      mode: "each",
    });
    expect([...reply.y]).toEqual([0.5 * 4 + 2 + 1, -2 * 4 + 2 + 1, 0, 0]);

    const workers = listener.relay.workers().sort((a, b) => a.id.localeCompare(b.id));
    expect(workers.map((w) => [w.id, w.slices[0]?.experts.length, w.inFlight, w.draining])).toEqual([
      ["w1", 8, 0, false],
      ["w2", 8, 0, false],
    ]);
    expect(listener.relay.backbones().map((b) => b.id)).toEqual(["bb"]);
  });

  it("a burst of large dispatches and results, forwarded through reused memory, all arrive byte-exact", async () => {
    // the relay reroutes every frame into memory it reuses unless the socket still holds the
    // last bytes; a burst of frames (49 KB out, 98 KB back, sent at once) exercises both cases (a
    // larger one holds this shared test event loop past the fast dead-peer timeout)
    const rand = rng(7);
    const shape = { n: 4, embd: 3072, k: 2, experts: 8, mode: "each" as const };
    const checks: Promise<void>[] = [];
    for (let i = 0; i < 24; i++) {
      const to = i % 2 === 0 ? "w1" : "w2";
      const req = randomRequest(rand, { ...shape, layer: i % 2 });
      checks.push(
        bb.request(to, req, { deadlineMs: 20_000 }).then((reply) => {
          expect(reply.from).toBe(to);
          expect(sameBytes(reply.y, fakeExperts(SALTS[to]!, req))).toBe(true);
        }),
      );
    }
    await Promise.all(checks);
  });

  it("keeps two backbones' equal request ids apart", async () => {
    const bb2 = await connect(url(port), "backbone", "bb2");
    const rand = rng(2);
    const a = Array.from({ length: 20 }, () =>
      randomRequest(rand, { n: 2, embd: 16, k: 2, experts: 8, mode: "each" }),
    );
    const b = Array.from({ length: 20 }, () =>
      randomRequest(rand, { n: 2, embd: 16, k: 2, experts: 8, mode: "each" }),
    );
    // both connections number their requests from the same counter value, so ids collide at the relay
    const [ra, rb] = await Promise.all([
      Promise.all(a.map((r) => bb.request("w1", r))),
      Promise.all(b.map((r) => bb2.request("w1", r))),
    ]);
    expect(ra.map((reply, i) => sameBytes(reply.y, fakeExperts(1, a[i]!)))).toEqual(a.map(() => true));
    expect(rb.map((reply, i) => sameBytes(reply.y, fakeExperts(1, b[i]!)))).toEqual(b.map(() => true));
    await bb2.close();
  });

  it("answers at once for an unknown worker, an unregistered model and a draining worker", async () => {
    const req = randomRequest(rng(3), { n: 1, embd: 8, k: 1, experts: 8, mode: "each" });
    await expectCode(bb.request("nobody", req), "MOESWARM_TRANSPORT_UNKNOWN_PEER");
    await expectCode(bb.request("w1", { ...req, model: "other" }), "MOESWARM_TRANSPORT_UNKNOWN_PEER");
    const w3 = await connect(url(port), "worker", "w3");
    w3.register({ model: MODEL, layers: [0], experts: [0] });
    w3.drain("maintenance");
    await waitFor(() => listener.relay.workers().some((w) => w.id === "w3" && w.draining), "w3 draining");
    const error = await expectCode(bb.request("w3", req), "MOESWARM_TRANSPORT_DRAINING");
    expect(error).toBeInstanceOf(TransportError);
    await w3.close();
    await waitFor(() => !listener.relay.workers().some((w) => w.id === "w3"), "w3 gone");
  });

  it("keeps a worker's slices as a set: each register adds one, a drain from the hub withdraws them all", async () => {
    const drains: Array<string | undefined> = [];
    const w4 = await connect(url(port), "worker", "w4", { onDrain: (reason) => drains.push(reason) });
    const slicesOf = () => listener.relay.workers().find((w) => w.id === "w4")?.slices ?? [];
    w4.register({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3] });
    w4.register({ model: MODEL, layers: [1], experts: [4, 5] });
    w4.register({ model: "other", layers: [2], experts: [0] });
    w4.register({ model: MODEL, layers: [0, 1], experts: [0, 1, 2, 3], capacity: 99 }); // the same slice
    await waitFor(() => slicesOf()[0]?.capacity === 99, "w4's slices");
    expect(slicesOf().map((x) => [x.model, x.layers, x.experts, x.capacity])).toEqual([
      [MODEL, [0, 1], [0, 1, 2, 3], 99],
      [MODEL, [1], [4, 5], undefined],
      ["other", [2], [0], undefined],
    ]);
    const registers = events.filter(
      (e): e is Extract<RelayServerEvent, { type: "register" }> => e.type === "register" && e.id === "w4",
    );
    expect(registers.map((e) => e.experts)).toEqual([[0, 1, 2, 3], [4, 5], [0], [0, 1, 2, 3]]);
    expect(registers.at(-1)?.capacity).toBe(99);
    // a dispatch for experts of both slices is routed (the worker splits it)
    const req = randomRequest(rng(9), { n: 3, embd: 8, k: 2, experts: 6, mode: "sum" });
    expect(sameBytes((await bb.request("w4", req)).y, fakeExperts(4, req))).toBe(true);

    // the hub drains it: the worker is told, gets no new dispatches, its slices are withdrawn
    expect(listener.relay.drainWorker("nobody")).toBe(false);
    expect(listener.relay.drainWorker("w4", "maintenance")).toBe(true);
    expect(slicesOf()).toEqual([]);
    expect(listener.relay.workers().find((w) => w.id === "w4")?.draining).toBe(true);
    await expectCode(bb.request("w4", req), "MOESWARM_TRANSPORT_DRAINING");
    await waitFor(() => drains.length === 1, "w4 told");
    expect(drains).toEqual(["maintenance"]);
    expect(events.filter((e) => e.type === "drain" && e.id === "w4")).toEqual([
      { type: "drain", id: "w4", reason: "maintenance", by: "hub" },
    ]);
    // a register after the drain starts a new set and serves again
    w4.register({ model: MODEL, layers: [0], experts: [7] });
    await waitFor(() => slicesOf().length === 1, "w4 back");
    expect(listener.relay.workers().find((w) => w.id === "w4")?.draining).toBe(false);
    await w4.close();
    await waitFor(() => !listener.relay.workers().some((w) => w.id === "w4"), "w4 gone");

    // a worker may hold at most maxSlicesPerWorker different slices; the same one again is not another
    const small = await listenRelay({ port: 0, secret: SECRET, maxSlicesPerWorker: 2, ...FAST });
    try {
      const w5 = await connect(`ws://127.0.0.1:${small.port}/relay`, "worker", "w5");
      const notices: RelayEvent[] = [];
      w5.on((e) => e.type === "notice" && notices.push(e));
      for (const experts of [[0], [1], [0], [2]]) w5.register({ model: MODEL, layers: [0], experts });
      await waitFor(() => notices.length === 1, "the limit refused");
      expect(notices[0]).toMatchObject({ error: { code: "MOESWARM_TRANSPORT_LIMIT" } });
      expect(small.relay.workers()[0]?.slices.map((x) => x.experts)).toEqual([[0], [1]]);
      await w5.close();
    } finally {
      await small.close();
    }
  });

  it("RelayTransport serves the dispatcher's request shape", async () => {
    const transport = new RelayTransport(bb);
    const req = randomRequest(rng(4), { n: 4, embd: 24, k: 3, experts: 8, mode: "sum" });
    const result = await transport.request("w1", { ...req, dtype: "f32" }, { deadlineMs: 5000 });
    expect(sameBytes(result.y, fakeExperts(1, req))).toBe(true);
    expect(typeof result.ms).toBe("number");
  });

  it("aborts and deadlines reject, remove their listeners and drop the late answer", async () => {
    const req = randomRequest(rng(5), { n: 1, embd: 8, k: 1, experts: 8, mode: "each" });
    const before = computed.w1!;
    const aborted = AbortSignal.abort(new Error("already"));
    await expect(bb.request("w1", req, { signal: aborted })).rejects.toThrow("already");
    expect(computed.w1).toBe(before); // nothing was sent

    let release!: () => void;
    const released = new Promise<void>((r) => {
      release = r;
    });
    let workerSignal: AbortSignal | undefined;
    hold = async (inc) => {
      workerSignal = inc.signal;
      await released;
    };
    const controller = new AbortController();
    const pending = bb.request("w1", req, { signal: controller.signal, deadlineMs: 10_000 });
    await waitFor(() => workerSignal !== undefined, "the worker got the dispatch");
    expect(getEventListeners(controller.signal, "abort").length).toBe(1);
    controller.abort(new Error("changed my mind"));
    await expect(pending).rejects.toThrow("changed my mind");
    expect(getEventListeners(controller.signal, "abort").length).toBe(0);

    // a deadline: the backbone gives up, and the worker's signal says so too
    workerSignal = undefined;
    const timed = bb.request("w1", req, { deadlineMs: 150 });
    await expectCode(timed, "MOESWARM_TRANSPORT_TIMEOUT");
    await waitFor(() => workerSignal?.aborted === true, "the worker's deadline signal");
    hold = undefined;
    release(); // both late answers reach the backbone's connection and are dropped
    const ok = await bb.request("w1", req);
    expect(sameBytes(ok.y, fakeExperts(1, req))).toBe(true);
  });

  it("a worker killed mid-request fails that request at once; the others keep going", async () => {
    const req = randomRequest(rng(6), { n: 2, embd: 8, k: 2, experts: 8, mode: "each" });
    let started = false;
    hold = async (inc) => {
      if (inc.from === "bb" && inc.n === 2) started = true;
      await new Promise<void>((r) => inc.signal.addEventListener("abort", () => r(), { once: true }));
    };
    const doomed = bb.request("w2", req, { deadlineMs: 20_000 });
    await waitFor(() => started, "w2 holding the request");
    hold = undefined;
    proxy.kill(); // w2's TCP connection is reset under it
    // TRANSPORT_CLOSED (not TIMEOUT): the relay answered when the socket died, long before 20 s
    const error = await expectCode(doomed, "MOESWARM_TRANSPORT_CLOSED");
    expect((error as Error).message).toContain("w2");
    const other = await bb.request("w1", req);
    expect(sameBytes(other.y, fakeExperts(1, req))).toBe(true);
    // w2 reconnects through the proxy, registers again, and serves
    await waitFor(() => registered("w2"), "w2 back");
    const back = await bb.request("w2", req);
    expect(sameBytes(back.y, fakeExperts(2, req))).toBe(true);
  });

  it("a worker that goes silent is dropped after deadPeerMs and its requests fail", async () => {
    const req = randomRequest(rng(7), { n: 1, embd: 8, k: 1, experts: 8, mode: "each" });
    await waitFor(() => registered("w2"), "w2 registered");
    const drops = events.length;
    proxy.freeze(); // bytes stop both ways; no socket closes
    const doomed = bb.request("w2", req, { deadlineMs: 20_000 });
    await expectCode(doomed, "MOESWARM_TRANSPORT_CLOSED");
    expect(events.slice(drops).some((e) => e.type === "disconnect" && e.id === "w2" && e.code === 4003)).toBe(
      true,
    );
    // the worker's client sees the relay go silent too, and dials again (a fresh connection passes)
    await waitFor(() => registered("w2") && w2.state === "connected", "w2 reconnected");
    const back = await bb.request("w2", req);
    expect(sameBytes(back.y, fakeExperts(2, req))).toBe(true);
  });

  it("restarting the relay reconnects everyone and requests resume after re-registration", async () => {
    const states: RelayEvent[] = [];
    const off = bb.on((e) => states.push(e));
    const req = randomRequest(rng(8), { n: 2, embd: 8, k: 2, experts: 8, mode: "sum" });
    hold = (inc) => new Promise((r) => inc.signal.addEventListener("abort", () => r(), { once: true }));
    const inFlight = bb.request("w1", req, { deadlineMs: 20_000 });
    await waitFor(() => listener.relay.workers().some((w) => w.id === "w1" && w.inFlight === 1), "in flight");
    hold = undefined;
    const failed = expectCode(inFlight, "MOESWARM_TRANSPORT_CLOSED");
    await listener.close();
    try {
      await failed;
      await waitFor(() => bb.state === "reconnecting", "the backbone to notice");
      await expectCode(bb.request("w1", req), "MOESWARM_TRANSPORT_CLOSED"); // fails fast while away
    } finally {
      listener = await startRelay(port);
    }
    await waitFor(() => registered("w1") && registered("w2"), "workers re-registered on the new relay");
    await bb.waitConnected();
    off();
    expect(states.map((e) => e.type === "state" && e.state)).toContain("reconnecting");
    expect(states.at(-1)).toMatchObject({ type: "state", state: "connected" });
    for (const to of ["w1", "w2"]) {
      const reply = await bb.request(to, req);
      expect(sameBytes(reply.y, fakeExperts(SALTS[to]!, req))).toBe(true);
    }
  });
});

describe("relay auth", () => {
  const hello = (role: "worker" | "backbone", id: string, token: string) =>
    connectRelay(url(port), { role, id, token, ca: certs.ca, ...FAST, reconnect: false });

  it("refuses a wrong, an expired, a role-swapped, an id-bound and a missing token", async () => {
    const wrong = mintToken({ role: "worker", ttlS: 60 }, "another-secret-0123456789abcdef");
    const e1 = await expectCode(hello("worker", "x1", wrong), "MOESWARM_AUTH_INVALID");
    expect(e1).toBeInstanceOf(AuthError);
    const expired = mintToken({ role: "worker", ttlS: 60, now: Date.now() - 120_000 }, SECRET);
    await expectCode(hello("worker", "x2", expired), "MOESWARM_AUTH_EXPIRED");
    const workerToken = mintToken({ role: "worker", ttlS: 60 }, SECRET);
    await expectCode(hello("backbone", "x3", workerToken), "MOESWARM_AUTH_ROLE");
    const bound = mintToken({ role: "worker", id: "someone-else", ttlS: 60 }, SECRET);
    await expectCode(hello("worker", "x4", bound), "MOESWARM_AUTH_ROLE");
    await expectCode(hello("worker", "x5", ""), "MOESWARM_AUTH_MISSING");
    const tampered = `${workerToken.slice(0, -3)}${workerToken.endsWith("AAA") ? "BBB" : "AAA"}`;
    await expectCode(hello("worker", "x6", tampered), "MOESWARM_AUTH_INVALID");
    // an admin token may act as either role
    const admin = await hello("backbone", "x7", mintToken({ role: "admin", ttlS: 60 }, SECRET));
    expect(admin.state).toBe("connected");
    await admin.close();
    expect(
      listener.relay
        .workers()
        .map((w) => w.id)
        .sort(),
    ).toEqual(["w1", "w2"]);
  });

  it("stops reconnecting when the refreshed token is refused", async () => {
    let calls = 0;
    const conn = await connect(url(proxy.port), "worker", "w9", {
      token: () =>
        calls++ === 0
          ? mintToken({ role: "worker", id: "w9", ttlS: 60 }, SECRET)
          : mintToken({ role: "worker", id: "w9", ttlS: 60, now: Date.now() - 120_000 }, SECRET),
      onDispatch: computeAnswer("w1"),
    });
    const closed = new Promise<RelayEvent>((resolve) =>
      conn.on((e) => {
        if (e.type === "state" && e.state === "closed") resolve(e);
      }),
    );
    proxy.kill();
    const event = await closed;
    expect(event.type === "state" && event.error).toBeInstanceOf(AuthError);
    expect(event.type === "state" && isMoeswarmError(event.error) && event.error.code).toBe(
      "MOESWARM_AUTH_EXPIRED",
    );
    expect(calls).toBe(2);
    await waitFor(() => registered("w2"), "w2 back after the proxy cut");
  });
});

/** Rounds f32 activations the way a half-precision wire dtype does. */
class RelayTransportProbe {
  constructor(private readonly dtype: "f16" | "bf16") {}
  roundTrip(x: Float32Array): Float32Array {
    const out = new Float32Array(x.length);
    const f32 = new Float32Array(1);
    const u32 = new Uint32Array(f32.buffer);
    for (let i = 0; i < x.length; i++) {
      if (this.dtype === "bf16") {
        // round to nearest even on the upper 16 bits (finite inputs only here)
        f32[0] = x[i]!;
        const bits = u32[0]!;
        u32[0] = ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) << 16;
        out[i] = f32[0]!;
      } else {
        out[i] = roundToF16(x[i]!);
      }
    }
    return out;
  }
}

/** Nearest f16 value of a finite f32 in the normal range used here (|x| in [2^-14, 65504]). */
function roundToF16(v: number): number {
  if (v === 0) return 0;
  const e = Math.floor(Math.log2(Math.abs(v)));
  const ulp = 2 ** (Math.max(e, -14) - 10);
  const q = v / ulp;
  const r = Math.round(q);
  // ties to even
  const t = Math.abs(q - Math.trunc(q)) === 0.5 ? 2 * Math.round(q / 2) : r;
  return t * ulp;
}
